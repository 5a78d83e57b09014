"""Weight updates without a restart, with real processes (`epd serve`, real gRPC): POST /update_weights.

The same weights under a new version give the same greedy tokens; other weights give other tokens and
/reload_weights brings the base ones back; a bad checkpoint is a 400 and changes nothing; under c=8 load an
update fails no request and no request runs two versions (each answer names one, requests after the switch
name the new one); an instance that joins after the update loads the cluster's version before it takes work.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import aiohttp
import httpx
import pytest

from services.runtime.server import free_port
from tests.support.checkpoints import other_shape, other_weights
from tests.support.cluster import ROOT, metric_value, start_cluster
from tests.support.images import chat, noise_image

pytestmark = pytest.mark.timeout(1200)   # a cluster start on a loaded 2-core machine, then minutes of requests
IMAGE = noise_image(64, 48, 11)


@pytest.fixture(scope="module")
def cluster(demo_model_path):
    running = start_cluster("--decode-slots", "8", timeout=900)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def trained(demo_model_path, tmp_path_factory):
    return other_weights(demo_model_path, tmp_path_factory.mktemp("ckpt") / "step-1")


def _greedy(cluster, text: str = "Describe the picture.") -> dict:
    reply = httpx.post(cluster.url + "/v1/chat/completions", timeout=120,
                       json=chat(text, [IMAGE], max_tokens=12, temperature=0, return_token_ids=True))
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def _update(cluster, path: str = "", **body) -> httpx.Response:
    route = "/update_weights" if path else "/reload_weights"
    return httpx.post(cluster.admin_url + route, json={"path": path, **body} if path else None, timeout=600)


def _version(choice: dict) -> str:
    [span] = choice["weight_versions"]
    return span["version"]


def test_same_weights_same_tokens_other_weights_other_tokens_and_reload(cluster, demo_model_path, trained):
    base = _greedy(cluster)
    assert _version(base) == "base"
    same = _update(cluster, str(demo_model_path))
    assert same.status_code == 200, same.text
    report = same.json()
    assert report["weight_version"] == "1" and report["previous"] == "base"
    assert set(report["serving_after_s"]) == {"encode", "prefill", "decode"}
    assert all(0 < s <= report["seconds"] for s in report["serving_after_s"].values())
    again = _greedy(cluster)
    assert again["token_ids"] == base["token_ids"] and _version(again) == "1"
    other = _update(cluster, str(trained), weight_version="step-1")
    assert other.status_code == 200, other.text
    changed = _greedy(cluster)
    assert changed["token_ids"] != base["token_ids"] and _version(changed) == "step-1"
    reused = _update(cluster, str(trained), weight_version="step-1")
    assert reused.status_code == 409 and reused.json()["error"]["code"] == "weight_version_exists"
    assert _update(cluster).json()["weight_version"] == "base"
    back = _greedy(cluster)
    assert back["token_ids"] == base["token_ids"] and _version(back) == "base"


def test_a_bad_checkpoint_is_a_400_and_changes_nothing(cluster, demo_model_path, tmp_path):
    before = httpx.get(cluster.admin_url + "/weights", timeout=10).json()["weight_version"]
    for path, message in ((str(tmp_path / "nowhere"), "is not a folder"),
                          (str(other_shape(demo_model_path, tmp_path / "wide")), "hidden_size")):
        reply = _update(cluster, path)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text
    assert httpx.get(cluster.admin_url + "/weights", timeout=10).json()["weight_version"] == before
    assert _version(_greedy(cluster)) == before
    unauthorized = httpx.post(cluster.url + "/update_weights", json={"path": str(tmp_path)}, timeout=10)
    assert unauthorized.status_code == 404   # the public port has no admin routes


async def _load(url: str, stop: asyncio.Event, results: list) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        index = 0
        while not stop.is_set():
            index += 1
            body = chat(f"Tell me about picture {index}.", [noise_image(48, 48, index % 5)], max_tokens=16,
                        temperature=0, ignore_eos=True)
            started = time.monotonic()
            async with session.post(url + "/v1/chat/completions", json=body) as reply:
                answer = await reply.json(content_type=None)
                results.append((started, time.monotonic(), reply.status, answer))


def test_an_update_under_load_fails_nothing_and_mixes_no_version(cluster, trained):
    async def scenario() -> tuple[list, float, float, dict]:
        stop, results = asyncio.Event(), []
        workers = [asyncio.create_task(_load(cluster.url, stop, results)) for _ in range(8)]
        await asyncio.sleep(3)
        posted = time.monotonic()
        async with aiohttp.ClientSession() as session, \
                session.post(cluster.admin_url + "/update_weights", json={"path": str(trained)}) as reply:
            report = await reply.json()
            assert reply.status == 200, report
        switched = time.monotonic()
        await asyncio.sleep(3)
        stop.set()
        await asyncio.gather(*workers)
        return results, posted, switched, report

    results, posted, switched, report = asyncio.run(scenario())
    assert [r for r in results if r[2] != 200] == []
    versions = [(started, ended, _version(answer["choices"][0])) for started, ended, _, answer in results]
    new = report["weight_version"]
    assert {v for s, e, v in versions if e < posted} <= {report["previous"]}
    assert {v for s, e, v in versions if s > switched} == {new}
    assert sum(1 for s, e, v in versions if s > switched) >= 8
    mixed = metric_value(httpx.get(cluster.url + "/metrics", timeout=10).text,
                         "epd_coordinator_weight_version_mixed_total")
    assert mixed == 0


def test_an_instance_that_joins_later_loads_the_current_version_first(cluster):
    current = httpx.get(cluster.admin_url + "/weights", timeout=10).json()["weight_version"]
    assert current != "base"   # the test before left the trained weights on
    grpc_port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.runtime.cli", "decode", "--grpc-port", str(grpc_port),
                             "--http-port", str(http_port), "--coordinator-url", cluster.admin_url,
                             "--decode-slots", "4", "--instance-id", "late" + uuid.uuid4().hex[:6]],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{grpc_port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            listed = {i["grpc_address"]: i for i in httpx.get(cluster.admin_url + "/v1/instances",
                                                             timeout=10).json()["data"]}
            if listed.get(address, {}).get("healthy"):
                break
            time.sleep(0.3)
        else:
            pytest.fail("the late decode instance was never admitted")
        import grpc

        from services.rpc.v1 import epd_pb2 as pb
        from services.rpc.v1 import epd_pb2_grpc as rpc

        with grpc.insecure_channel(address) as channel:
            info = rpc.WeightsServiceStub(channel).Info(pb.InfoRequest(), timeout=10)
        assert info.weight_version == current
    finally:
        proc.terminate()
        proc.wait(30)
