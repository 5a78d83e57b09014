"""The generated gRPC stubs are exactly what protoc makes from proto/ (never edited by hand)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GENERATED = ("epd_pb2.py", "epd_pb2.pyi", "epd_pb2_grpc.py")


def test_stubs_match_the_proto(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    "proto/services/rpc/v1/epd.proto"], cwd=ROOT, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "services" / "rpc" / "v1" / name).read_bytes()
        with open(os.path.join(ROOT, "services", "rpc", "v1", name), "rb") as f:
            assert f.read() == fresh, f"{name} is stale: regenerate with grpc_tools.protoc (see docs/architecture.md)"
