"""`epd config` prints the effective configuration, each value with its source."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _epd_config(*args: str, env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    out = subprocess.run([sys.executable, "-m", "services.runtime.cli", "config", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**clean, "PYTHONPATH": ROOT, **env}, check=True)
    return out.stdout


def test_env_flag_and_default_are_told_apart():
    text = _epd_config("--port", "9000", env={"EPD_EC_CONNECTOR": "redis", "EPD_DECODE_SLOTS": "4"})
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert lines["--ec-connector"].split() == ['--ec-connector', '"redis"', "env", "EPD_EC_CONNECTOR"]
    assert lines["--decode-slots"].split() == ["--decode-slots", "4", "env", "EPD_DECODE_SLOTS"]
    assert lines["--port"].split() == ["--port", "9000", "flag"]
    assert lines["--kv-connector"].split() == ["--kv-connector", '"shm"', "default"]
    assert lines["--instance-id"].endswith("default (random per process)")


def test_a_flag_beats_the_environment_and_json_has_every_setting():
    rows = json.loads(_epd_config("--json", "--port", "9100", env={"EPD_PORT": "9000"}))
    port = next(r for r in rows if r["flag"] == "--port")
    assert port == {"flag": "--port", "env": "EPD_PORT", "value": 9100, "source": "flag", "default": 8000}
    assert len(rows) == len(json.loads(_epd_config("--schema", env={})))


def test_secrets_are_not_printed():
    rows = json.loads(_epd_config("--json", env={"EPD_API_KEY": "sk-very-secret",
                                                 "EPD_REDIS_URL": "redis://:hunter2@redis:6379/0"}))
    by_flag = {r["flag"]: r for r in rows}
    assert by_flag["--api-key"]["value"] == "***" and by_flag["--api-key"]["source"] == "env"
    assert by_flag["--redis-url"]["value"] == "redis://***@redis:6379/0"
    assert "sk-very-secret" not in json.dumps(rows) and "hunter2" not in json.dumps(rows)
