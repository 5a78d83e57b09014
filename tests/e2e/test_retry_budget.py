"""The retry budget on real processes: a request that crashes every instance it reaches gets at most
--max-retries retries, only the first instance it broke is taken out at once, and the cluster keeps serving.

The render pool of a coordinator started here is four FAKE render instances
(tests/support/poison_render.py: they forward to the session cluster's real
render, and exit when a chat carries the marker POISON); the other roles are
the session cluster's real encode, prefill and decode.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from services.runtime.server import free_port
from tests.support.cluster import ROOT, metric_value

PROXIES = 4
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "temperature": 0}


def _spawn(*args: str, log=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def poisoned(shm_cluster, tmp_path_factory):
    real = {role: grpc for role, _, grpc in shm_cluster.roles}
    ports = [free_port() for _ in range(PROXIES)]
    proxies = [_spawn("tests.support.poison_render", str(port), real["render"]) for port in ports]
    for proxy in proxies:
        assert proxy.stdout.readline().strip() == "serving"
    port = free_port()
    log_path = tmp_path_factory.mktemp("poison") / "coordinator.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed at teardown
    coordinator = _spawn("services.runtime.cli", "coordinator", "--port", str(port), "--max-retries", "2",
                         "--render-urls", ",".join(f"127.0.0.1:{p}" for p in ports),
                         *(arg for role in ("encode", "prefill", "decode") for arg in (f"--{role}-urls", real[role])),
                         log=log)
    coordinator.log_path = log_path  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    yield url, proxies, coordinator
    for proc in (*proxies, coordinator):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    log.close()


def test_a_poison_request_is_refused_after_the_budget_and_the_rest_keep_serving(poisoned):
    url, proxies, coordinator = poisoned
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    poison = {**CHAT, "messages": [{"role": "user", "content": "POISON"}]}
    reply = httpx.post(url + "/v1/chat/completions", json=poison, timeout=60)
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "retry_budget_exhausted"
    assert "failed at the transport level on 3 instances" in error["message"]
    assert "not retried further (--max-retries 2)" in error["message"]
    time.sleep(1.0)
    assert sum(p.poll() is not None for p in proxies) == 3  # 1 try + 2 retries: the fourth never saw it
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert metric_value(metrics, "epd_coordinator_retries_total", 'reason="budget_exhausted"') == 1
    for _ in range(3):  # the surviving instance serves everyone else
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    output = coordinator.log_path.read_text()
    # The first broken instance is taken out at once; the second is left to its probe; the third ends it.
    assert output.count("not marked down: this request already made an instance fail") == 1
    assert "it is not retried further" in output
