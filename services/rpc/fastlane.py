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
- REQUEST: `<dH` (timeout in seconds, negative for none; the count of metadata pairs), u16 length +
  "Service/Method", per pair u16 length + key and u16 length + value (UTF-8), then the request message's
  bytes.  Binary, not JSON: a call's header is packed and read in a few microseconds.
- REPLY (unary answer), ITEM (one message of a server stream), END (the stream ended cleanly).
- ERROR: JSON {"code": grpc status code value, "details", "trailing": [[k, v]...]}.
- CANCEL (client -> server): the caller gave up; the handler is cancelled as gRPC would cancel it.
- INPUTS (client -> server, at most one per call): the rest of a call opened ahead of its inputs (a request with
  `inputs_follow_ms`), a protobuf message the handler reads with `context.next_input()`.  gRPC has no such
  frame: over it the coordinator sends whole requests.

Answers forwarded role to role (services/rpc/fastlane_forward.py): a call opened ahead names a random token in
its metadata (INPUTS_TOKEN_KEY, 32 hex digits); its inputs may then come from any connection to this socket.

- FORWARD (client -> server, on a running unary call): `<I` (a role's gRPC port), the 16-byte token of a call
  opened on that role, then suffix bytes.  When this call's answer is ready the role writes it, with the suffix
  appended (protobuf merges the two messages), to that role's socket as the named call's inputs, then answers
  REPLY_FORWARDED instead of REPLY.  A FORWARD that comes after the answer, or names a socket this role cannot
  reach now, changes nothing: the answer is a plain REPLY and the coordinator sends the inputs on itself.
- TOKEN_INPUTS (role -> role, call id 0): the token, then the inputs of the call that named it.
- REPLY_FORWARDED (server -> client): the token the answer went on to (the last FORWARD read before the answer
  was ready), then the unary answer's bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<IBI")
HELLO, REQUEST, REPLY, ITEM, END, ERROR, CANCEL, INPUTS, FORWARD, TOKEN_INPUTS, REPLY_FORWARDED = range(11)
TOKEN_BYTES = 16
INPUTS_TOKEN_KEY = "epd-inputs-token"
MAX_FRAME = 256 * 1024 * 1024  # gRPC's message limit here (services.server.GRPC_MAX_MESSAGE)
ENV_DIR = "EPD_FAST_LANE_DIR"

def socket_path(grpc_port: int) -> Path:
    """Where the role serving gRPC on `grpc_port` listens (EPD_FAST_LANE_DIR, else the temp folder)."""
    return Path(os.environ.get(ENV_DIR) or tempfile.gettempdir()) / f"epd-rpc-{grpc_port}.sock"


CONNECT_ERRORS = (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError)


async def connect(grpc_port: int, timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the fast lane of the role serving gRPC on `grpc_port`, its HELLO read and checked; one of
    CONNECT_ERRORS when there is none (no socket, a slow or foreign one, a socket answering for another port)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_unix_connection(str(socket_path(grpc_port)), limit=MAX_FRAME), timeout_s)
    try:
        size, kind, _ = HEADER.unpack(await asyncio.wait_for(reader.readexactly(HEADER.size), timeout_s))
        hello = json.loads(await asyncio.wait_for(reader.readexactly(size), timeout_s))
        if kind != HELLO or not isinstance(hello, dict) or hello.get("grpc_port") != grpc_port:
            raise ConnectionError(f"the socket answers for {hello}, not port {grpc_port}")
    except BaseException:
        writer.close()
        raise
    return reader, writer


def frame(kind: int, call_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind, call_id) + payload


def hello_payload(grpc_port: int) -> bytes:
    return json.dumps({"grpc_port": grpc_port}).encode()


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


_PORT = struct.Struct("<I")


def forward_payload(port: int, token: bytes, suffix: bytes = b"") -> bytes:
    return _PORT.pack(port) + token + suffix


def parse_forward(payload: bytes) -> tuple[int, bytes, bytes]:
    """(port, token, suffix) of a FORWARD frame; ValueError when it is too short to hold them."""
    if len(payload) < _PORT.size + TOKEN_BYTES:
        raise ValueError("a FORWARD frame shorter than its port and token")
    return _PORT.unpack_from(payload)[0], payload[_PORT.size:_PORT.size + TOKEN_BYTES], \
        payload[_PORT.size + TOKEN_BYTES:]


def inputs_token(metadata: list[tuple[str, str]]) -> bytes | None:
    """The token a call opened ahead named for inputs sent by token, or None (none, or not 16 bytes of hex)."""
    for key, value in metadata:
        if key == INPUTS_TOKEN_KEY:
            try:
                token = bytes.fromhex(value)
            except ValueError:
                return None
            return token if len(token) == TOKEN_BYTES else None
    return None
