"""The same-host fast lane: the roles' gRPC methods, with their own protobuf messages, over a Unix socket.

Why: one request at a time, a gRPC round trip here costs 0.5-1.5 ms against 0.1-0.5 ms for the same call over
this lane (`python -m benchmarks.hop_latency`: gRPC over TCP, gRPC over a Unix socket and this lane, side by
side): gRPC's C core and its asyncio poller wake several threads per message, and a Unix socket does not
change that.  The lane keeps every method, message, status code and error code of the gRPC API; only the
framing is ours, and it is one more channel behind the coordinator's role clients, never a different path:
the same calls, the same answers, the same failures (a lost connection is UNAVAILABLE, as gRPC's is).

Where: every role listens on it beside its gRPC port (services/rpc/fastlane_server.py); the coordinator uses it
for a role it reaches over plaintext gRPC on a loopback address when the role's socket answers for that port
(services/rpc/fastlane_client.py), gRPC otherwise.  TLS deployments, other hosts and `--fast-lane off` keep gRPC;
health probes always use gRPC.

Safety: the sockets live in a folder only this user can enter (services/private_dir.py; EPD_FAST_LANE_DIR names
another), each named with its role's gRPC port and instance id; both ends check the other is this same user
(SO_PEERCRED) before any frame is read; a frame's size is checked before its body is read (MAX_FRAME); a
connection carries at most MAX_CALLS calls at once (more are refused as a full role refuses); every write waits
for the socket to drain.

Frames, both ways: a header `<IBI` (payload bytes, kind, call id) and the payload.

- HELLO (server -> client, call id 0, once per connection): JSON {"grpc_port", "instance_id"}.
- REQUEST: `<dH` (timeout in seconds, negative for none; the count of metadata pairs), u16 length +
  "Service/Method", per pair u16 length + key and u16 length + value (UTF-8), then the request message's
  bytes.  Binary, not JSON: a call's header is packed and read in a few microseconds.
- REPLY (unary answer), ITEM (one message of a server stream), END (the stream ended cleanly).
- ERROR: JSON {"code": grpc status code value, "details", "trailing": [[k, v]...]}.
- CANCEL (client -> server): the caller gave up; the handler is cancelled as gRPC would cancel it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from services.private_dir import private_dir

HEADER = struct.Struct("<IBI")
HELLO, REQUEST, REPLY, ITEM, END, ERROR, CANCEL = range(7)
MAX_FRAME = 256 * 1024 * 1024  # gRPC's message limit here (services.server.GRPC_MAX_MESSAGE)
MAX_CALLS = 1024               # calls one connection carries at once
ENV_DIR = "EPD_FAST_LANE_DIR"
CONNECT_ERRORS = (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError)


def socket_dir() -> Path:
    """The private folder of this user's fast-lane sockets (PrivateDirError when it is not private)."""
    return private_dir("epd-rpc", os.environ.get(ENV_DIR) or None)


def socket_path(grpc_port: int, instance_id: str) -> Path:
    return socket_dir() / f"rpc-{grpc_port}-{instance_id}.sock"


def sockets_for(grpc_port: int) -> list[Path]:
    """The sockets that may answer for `grpc_port`, newest first (a dead process's socket may be left)."""
    found = list(socket_dir().glob(f"rpc-{grpc_port}-*.sock"))
    return sorted(found, key=lambda p: p.stat().st_mtime if p.exists() else 0.0, reverse=True)


def peer_is_us(writer: asyncio.StreamWriter) -> bool:
    """Whether the process at the other end of this Unix socket runs as this user (SO_PEERCRED, Linux)."""
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "SO_PEERCRED", None)
    if sock is None or option is None:
        return False
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    return bool(uid == os.geteuid())


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """(kind, call id, payload); ValueError for a frame larger than MAX_FRAME, before its body is read."""
    size, kind, call_id = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME:
        raise ValueError(f"a fast-lane frame of {size} bytes (at most {MAX_FRAME})")
    return kind, call_id, await reader.readexactly(size) if size else b""


async def connect(grpc_port: int, timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the fast lane of the role serving gRPC on `grpc_port`, its peer and HELLO checked; one of
    CONNECT_ERRORS when there is none (no socket, a stale one, another user's, one answering for another port)."""
    errors = []
    for path in sockets_for(grpc_port):
        try:
            return await _connect_one(path, grpc_port, timeout_s)
        except CONNECT_ERRORS as exc:
            errors.append(f"{path.name}: {exc}")
    raise ConnectionError(f"no fast lane answers for port {grpc_port}" + (f" ({'; '.join(errors)})" if errors else ""))


async def _connect_one(path: Path, grpc_port: int,
                       timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path), limit=MAX_FRAME), timeout_s)
    try:
        if not peer_is_us(writer):
            raise ConnectionError("the socket's process is not this user's")
        kind, _, payload = await asyncio.wait_for(read_frame(reader), timeout_s)
        hello = json.loads(payload)
        if kind != HELLO or not isinstance(hello, dict) or hello.get("grpc_port") != grpc_port:
            raise ConnectionError(f"the socket answers for {hello}, not port {grpc_port}")
    except BaseException:
        writer.close()
        raise
    return reader, writer


def frame(kind: int, call_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind, call_id) + payload


def hello_payload(grpc_port: int, instance_id: str) -> bytes:
    return json.dumps({"grpc_port": grpc_port, "instance_id": instance_id}).encode()


_CALL = struct.Struct("<dH")
_LEN = struct.Struct("<H")


def _text(value: Any) -> bytes:
    raw = str(value).encode()
    return _LEN.pack(len(raw)) + raw


def request_payload(method: str, metadata: Any, timeout: float | None, message: bytes) -> bytes:
    pairs = list(metadata or ())
    parts = [_CALL.pack(-1.0 if timeout is None else timeout, len(pairs)), _text(method)]
    for key, value in pairs:
        parts += (_text(key), _text(value))
    parts.append(message)
    return b"".join(parts)


def parse_request(payload: bytes) -> tuple[str, list[tuple[str, str]], float | None, bytes]:
    """(method, metadata, timeout or None, message bytes); ValueError (struct.error, UnicodeDecodeError) if cut."""
    timeout, count = _CALL.unpack_from(payload, 0)
    at = _CALL.size
    texts = []
    for _ in range(1 + 2 * count):
        (size,) = _LEN.unpack_from(payload, at)
        if at + 2 + size > len(payload):
            raise ValueError("a fast-lane request's header runs past its frame")
        texts.append(bytes(payload[at + 2:at + 2 + size]).decode())
        at += 2 + size
    pairs = [(texts[i], texts[i + 1]) for i in range(1, len(texts), 2)]
    return texts[0], pairs, None if timeout < 0 else timeout, payload[at:]


def error_payload(code: int, details: str, trailing: Any) -> bytes:
    return json.dumps({"code": code, "details": details,
                       "trailing": [[str(k), str(v)] for k, v in (trailing or ())]}).encode()
