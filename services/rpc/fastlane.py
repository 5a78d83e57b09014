"""The same-host fast lane: the roles' gRPC methods, with their own protobuf messages, over a Unix socket.

Why: one request at a time, each gRPC hop costs ~0.7 ms to reach the role and ~0.3 ms back on this box
(`python -m benchmarks.request_trace`), against ~0.12 ms for a plain asyncio round trip after idling
(`python -m benchmarks.hop_latency`): gRPC's C core and its asyncio poller wake several threads per message.
The fast lane keeps every method, message, status code and error code of the gRPC API; only the
framing is ours.  Every role listens on it beside its gRPC port (services/rpc/fastlane_server.py); the
coordinator uses it for a role it reaches over plaintext gRPC on a loopback address, when the socket
is there and answers for that port (services/rpc/fastlane_client.py), and gRPC otherwise.  TLS
deployments, other hosts and `--fast-lane off` keep gRPC.  Health probes always use gRPC.

Frames, both ways: a header `<IBI` (payload bytes, kind, call id) and the payload.

- HELLO (server -> client, call id 0, once per connection): JSON {"grpc_port"}.
- REQUEST: u16 name length, "Service/Method", u32 JSON length, JSON {"metadata": [[k, v]...],
  "timeout": seconds | null}, then the request message's bytes.
- REPLY (unary answer), ITEM (one message of a server stream), END (the stream ended cleanly).
- ERROR: JSON {"code": grpc status code value, "details", "trailing": [[k, v]...]}.
- CANCEL (client -> server): the caller gave up; the handler is cancelled as gRPC would cancel it.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<IBI")
HELLO, REQUEST, REPLY, ITEM, END, ERROR, CANCEL = range(7)
MAX_FRAME = 256 * 1024 * 1024  # gRPC's message limit here (services.server.GRPC_MAX_MESSAGE)
ENV_DIR = "EPD_FAST_LANE_DIR"

def socket_path(grpc_port: int) -> Path:
    """Where the role serving gRPC on `grpc_port` listens (EPD_FAST_LANE_DIR, else the temp folder)."""
    return Path(os.environ.get(ENV_DIR) or tempfile.gettempdir()) / f"epd-rpc-{grpc_port}.sock"


def frame(kind: int, call_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind, call_id) + payload


def hello_payload(grpc_port: int) -> bytes:
    return json.dumps({"grpc_port": grpc_port}).encode()


def request_payload(method: str, metadata: Any, timeout: float | None, message: bytes) -> bytes:
    name = method.encode()
    meta = json.dumps({"metadata": [[str(k), str(v)] for k, v in (metadata or ())], "timeout": timeout}).encode()
    return struct.pack("<H", len(name)) + name + struct.pack("<I", len(meta)) + meta + message


def parse_request(payload: bytes) -> tuple[str, list[tuple[str, str]], float | None, bytes]:
    (name_len,) = struct.unpack_from("<H", payload, 0)
    name = payload[2:2 + name_len].decode()
    (meta_len,) = struct.unpack_from("<I", payload, 2 + name_len)
    start = 6 + name_len
    meta = json.loads(payload[start:start + meta_len])
    return name, [(k, v) for k, v in meta["metadata"]], meta["timeout"], payload[start + meta_len:]


def error_payload(code: int, details: str, trailing: Any) -> bytes:
    return json.dumps({"code": code, "details": details,
                       "trailing": [[str(k), str(v)] for k, v in (trailing or ())]}).encode()
