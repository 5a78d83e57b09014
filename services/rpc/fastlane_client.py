"""The coordinator side of the fast lane (services/rpc/fastlane.py): a stub that speaks it, gRPC otherwise.

`FastLaneStub(grpc_stub, service, address)` has the generated stub's methods with the same call shapes:
a unary method returns an awaitable answer, a server-streaming one a call with `read()` (a message or
`grpc.aio.EOF`) and `cancel()`; failures are `grpc.aio.AioRpcError`s with the gRPC status code and the
role's trailing metadata (its epd error code), so the coordinator's failover and error mapping see
exactly what gRPC would give them.  A lost connection fails its calls with UNAVAILABLE (no epd error
code: a transport failure).

Used only where it can be: the address is a loopback one, the channel is plaintext, the role's socket
exists and its HELLO names the port the address names.  Otherwise, and for `FAILED_RETRY_S` after a
failed connect, each call goes to the wrapped gRPC stub.  One connection per instance carries all its
calls (a call id each); it is opened on the first call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import secrets
import time
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from . import fastlane as fl
from .relay import Relay, relay_answer

__all__ = ["AheadCall", "FastLaneStub", "Relay", "close_stub", "fast_lane_port", "with_fast_lane"]

log = logging.getLogger(__name__)
FAILED_RETRY_S = 1.0
LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def fast_lane_port(address: str, secure: bool, enabled: bool = True) -> int | None:
    """The gRPC port whose fast lane a call to `address` may use, or None (TLS, another host, switched off)."""
    if secure or not enabled:
        return None
    host, _, port = address.rpartition(":")
    return int(port) if host in LOOPBACK and port.isdigit() else None


def _rpc_error(code: grpc.StatusCode, details: str, trailing: Any = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*[(k, v) for k, v in trailing]),
                                details)


def _unavailable(why: str) -> grpc.aio.AioRpcError:
    return _rpc_error(grpc.StatusCode.UNAVAILABLE, f"fast lane: {why}")


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.ids = itertools.count(1)
        self.calls: dict[int, asyncio.Queue | asyncio.Future] = {}   # a stream's frames, a unary call's answer
        self.relays: dict[int, Relay] = {}   # unary calls whose answer also goes on to a call opened ahead
        self.forwarded_to: dict[int, bytes] = {}   # unary calls told to send their answer on (FORWARD): the token
        self.closed = False
        self.task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                size, kind, call_id = fl.HEADER.unpack(await self.reader.readexactly(fl.HEADER.size))
                payload = await self.reader.readexactly(size) if size else b""
                if kind == fl.REPLY_FORWARDED:   # the role sent it on itself (a FORWARD): a REPLY for the caller
                    kind, token, payload = fl.REPLY, payload[:fl.TOKEN_BYTES], payload[fl.TOKEN_BYTES:]
                    self.forwarded_to.pop(call_id, None)
                    relay = self.relays.get(call_id)
                    if relay is not None and relay.target is not None and relay.target.token == token:
                        del self.relays[call_id]
                        relay.forwarded()
                if self.relays and call_id in self.relays:
                    relay_answer(self.relays.pop(call_id), kind, payload)   # on at once, before any task wakes
                _deliver(self.calls.get(call_id), kind, payload)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.closed = True
            self.writer.close()
            for waiting in self.calls.values():
                _deliver(waiting, None, b"")  # the connection is gone: every call fails UNAVAILABLE

    def open_call(self, method: str, message: bytes, timeout: float | None, metadata: Any,
                  waiting: asyncio.Queue | asyncio.Future, relay: Relay | None = None) -> int:
        """Send the call; its frames go to `waiting`: a stream's queue, or a unary call's future (one frame), and
        a unary call's answer to `relay` too."""
        if self.closed:
            raise _unavailable("the connection is closed")
        call_id = next(self.ids)
        self.calls[call_id] = waiting
        self.writer.write(fl.frame(fl.REQUEST, call_id, fl.request_payload(method, metadata, timeout, message)))
        if relay is not None:
            self.relays[call_id] = relay
            relay.attach(self, call_id)
        return call_id

    def forward(self, call_id: int, port: int, token: bytes, suffix: bytes = b"") -> bool:
        """Tell the role to send call `call_id`'s answer (with `suffix`) on to the call that named `token` on the
        role at `port` (a FORWARD frame); False when the connection is going away."""
        if self.closed or call_id not in self.calls:
            return False
        try:
            self.writer.write(fl.frame(fl.FORWARD, call_id, fl.forward_payload(port, token, suffix)))
        except (RuntimeError, ConnectionError):
            return False
        self.forwarded_to[call_id] = token
        return True

    def end_call(self, call_id: int, cancel: bool) -> None:
        self.relays.pop(call_id, None)
        self.forwarded_to.pop(call_id, None)
        if self.calls.pop(call_id, None) is not None and cancel and not self.closed:
            self.writer.write(fl.frame(fl.CANCEL, call_id))

    def close(self) -> None:
        self.task.cancel()


def _deliver(waiting: asyncio.Queue | asyncio.Future | None, kind: int | None, payload: bytes) -> None:
    if isinstance(waiting, asyncio.Queue):
        waiting.put_nowait((kind, payload))
    elif waiting is not None and not waiting.done():
        waiting.set_result((kind, payload))


def _answer(kind: int | None, payload: bytes) -> None:
    """Raise what a non-message frame means for the call."""
    if kind is None:
        raise _unavailable("the role's connection closed")
    if kind == fl.ERROR:
        body = json.loads(payload)
        raise _rpc_error(_CODES.get(body["code"], grpc.StatusCode.UNKNOWN), body["details"], body["trailing"])
    raise _unavailable(f"unexpected frame kind {kind}")


class _StreamCall:
    """A server stream over the fast lane, shaped like grpc.aio.UnaryStreamCall (read, cancel)."""

    def __init__(self, stub: FastLaneStub, method: str, request: Any, timeout: float | None, metadata: Any,
                 reply_class: Any) -> None:
        self._stub, self._method, self._request = stub, method, request
        self._timeout, self._metadata, self._reply = timeout, metadata, reply_class
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._open: tuple[_Connection, int, asyncio.Queue] | None = None
        self._fallback: Any = None  # the gRPC call, when the fast lane turned out not to be there
        self._done = False

    async def read(self) -> Any:
        if self._fallback is not None:
            return await self._fallback.read()
        if self._done:
            return grpc.aio.EOF
        if self._open is None:
            try:
                connection = await self._stub.connection()
            except grpc.aio.AioRpcError:  # no fast lane after all: this call goes through gRPC
                left = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
                self._fallback = getattr(self._stub.grpc_stub, self._method.rsplit("/", 1)[1])(
                    self._request, timeout=left, metadata=self._metadata)
                return await self._fallback.read()
            queue: asyncio.Queue = asyncio.Queue()
            call_id = connection.open_call(self._method, self._request.SerializeToString(), self._timeout,
                                           self._metadata, queue)
            self._open = (connection, call_id, queue)
        connection, call_id, queue = self._open
        left = None if self._deadline is None else self._deadline - time.monotonic()
        try:
            async with asyncio.timeout(None if left is None or math.isinf(left) else max(0.0, left)):
                kind, payload = await queue.get()
        except TimeoutError:
            self.cancel()
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if kind == fl.ITEM:
            return self._reply.FromString(payload)
        self._done = True
        connection.end_call(call_id, cancel=False)
        if kind == fl.END:
            return grpc.aio.EOF
        _answer(kind, payload)

    def cancel(self) -> bool:
        if self._fallback is not None:
            return self._fallback.cancel()
        if self._done:
            return False
        self._done = True
        if self._open is not None:
            connection, call_id, _ = self._open
            connection.end_call(call_id, cancel=True)
        return True


class FastLaneStub:
    """The generated stub's methods, over the fast lane where it is up, else through `grpc_stub`."""

    def __init__(self, grpc_stub: Any, service: ServiceDescriptor, port: int) -> None:
        self._grpc, self._service, self._port = grpc_stub, service, port
        self._conn: _Connection | None = None
        self._lock = asyncio.Lock()
        self._failed_at = -math.inf
        self._methods = {m.name: m for m in service.methods}

    def __getattr__(self, name: str) -> Any:
        method = self.__dict__.get("_methods", {}).get(name)
        if method is None:
            return getattr(self._grpc, name)
        full = f"{self._service.full_name}/{name}"
        reply = message_factory.GetMessageClass(method.output_type)
        if method.server_streaming:
            def stream(request: Any, timeout: float | None = None, metadata: Any = None) -> Any:
                if not self.up():
                    return getattr(self._grpc, name)(request, timeout=timeout, metadata=metadata)
                return _StreamCall(self, full, request, timeout, metadata, reply)
            self.__dict__[name] = stream  # built once per method: later lookups skip __getattr__
            return stream

        def unary(request: Any, timeout: float | None = None, metadata: Any = None, relay: Relay | None = None) -> Any:
            if not self.up():
                return getattr(self._grpc, name)(request, timeout=timeout, metadata=metadata)
            return self._unary(full, request, timeout, metadata, reply, relay)
        self.__dict__[name] = unary
        return unary

    @property
    def grpc_stub(self) -> Any:
        return self._grpc

    @property
    def port(self) -> int:
        """The role's gRPC port, which names its fast-lane socket."""
        return self._port

    def up(self) -> bool:
        """Whether calls go over the fast lane now (open, or worth trying to open)."""
        if self._conn is not None and not self._conn.closed:
            return True
        return time.monotonic() - self._failed_at >= FAILED_RETRY_S

    async def connection(self) -> _Connection:
        async with self._lock:
            if self._conn is not None and not self._conn.closed:
                return self._conn
            try:
                reader, writer = await fl.connect(self._port, 2.0)
            except fl.CONNECT_ERRORS as exc:
                self._failed_at = time.monotonic()
                log.debug("fast lane to port %d not available (%s): gRPC", self._port, exc)
                raise _unavailable(f"no fast lane to port {self._port} ({exc})") from None
            self._conn = _Connection(reader, writer)
            return self._conn

    async def _unary(self, method: str, request: Any, timeout: float | None, metadata: Any, reply: Any,
                     relay: Relay | None = None) -> Any:
        try:
            connection = await self.connection()
        except grpc.aio.AioRpcError:  # no fast lane after all: this call goes through gRPC
            name = method.rsplit("/", 1)[1]
            return await getattr(self._grpc, name)(request, timeout=timeout, metadata=metadata)
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        call_id = connection.open_call(method, request.SerializeToString(), timeout, metadata, answer, relay)
        return await _answer_of(connection, call_id, answer, timeout, reply)

    def open_ahead(self, name: str, request: Any, timeout: float | None = None, metadata: Any = None,
                   token: bytes | None = None) -> AheadCall | None:
        """Send `request` (one that says its inputs follow) now, on the open connection; None when the fast lane
        is not open at this moment (the caller then makes a whole call later).  Never waits.  Its inputs may also
        come from another role by `token` (one already named in a FORWARD, or a new one)."""
        connection, method = self._conn, self._methods.get(name)
        if connection is None or connection.closed or method is None:
            return None
        reply = message_factory.GetMessageClass(method.output_type)
        full = f"{self._service.full_name}/{name}"
        waiting: asyncio.Queue | asyncio.Future = (asyncio.Queue() if method.server_streaming
                                                   else asyncio.get_running_loop().create_future())
        token = token or secrets.token_bytes(fl.TOKEN_BYTES)   # its inputs may come from another role (FORWARD)
        metadata = [*(metadata or ()), (fl.INPUTS_TOKEN_KEY, token.hex())]
        call_id = connection.open_call(full, request.SerializeToString(), timeout, metadata, waiting)
        stream = None
        if method.server_streaming:
            stream = _StreamCall(self, full, request, timeout, metadata, reply)
            stream._open = (connection, call_id, waiting)  # type: ignore[assignment]
        call = AheadCall(connection, call_id, waiting, timeout, reply, stream)
        call.port, call.token = self._port, token
        return call

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(asyncio.CancelledError):
                await self._conn.task


async def _answer_of(connection: _Connection, call_id: int, answer: asyncio.Future, timeout: float | None,
                     reply: Any) -> Any:
    finished = False
    try:
        async with asyncio.timeout(None if timeout is None or math.isinf(timeout) else timeout):
            kind, payload = await answer
        finished = True
    except TimeoutError:
        raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
    finally:
        connection.end_call(call_id, cancel=not finished)
    if kind == fl.REPLY:
        return reply.FromString(payload)
    _answer(kind, payload)


class AheadCall:
    """A call opened ahead of its inputs (FastLaneStub.open_ahead): its request is with the role, which works on
    what it can; `send_inputs(message)` sends the rest (one INPUTS frame), or a `Relay` does, with the answer of
    the call before it as that answer arrives.  A unary call's answer is `await answer()`; a server stream's
    calls are `stream` (read / cancel, as any stream call).  `cancel()` ends it (the role's handler is
    cancelled, as gRPC would cancel it); ending a call that already ended does nothing."""

    def __init__(self, connection: _Connection, call_id: int, waiting: asyncio.Queue | asyncio.Future,
                 timeout: float | None, reply: Any, stream: _StreamCall | None) -> None:
        self._connection, self._call_id, self._waiting = connection, call_id, waiting
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._reply, self.stream = reply, stream
        self.sent = self.relayed = self.forwarded = self._ended = False
        self.port: int | None = None      # the role's gRPC port and the token its inputs may come by from another
        self.token: bytes | None = None   # role (FastLaneStub.open_ahead sets both)

    def send_inputs(self, message: Any) -> None:
        self.send_raw(message.SerializeToString())

    def send_raw(self, payload: bytes) -> None:
        """The inputs, once (later sends do nothing); on a closed connection nothing is sent (the answer then
        fails UNAVAILABLE)."""
        if self.sent or self._ended:
            return
        self.sent = True
        if self._connection.closed:
            return
        try:
            self._connection.writer.write(fl.frame(fl.INPUTS, self._call_id, payload))
        except (RuntimeError, ConnectionError):
            pass   # the connection is going away: its calls fail UNAVAILABLE (a transport failure, failed over)

    def forward_to(self, port: int, token: bytes) -> bool:
        """This (unary) call's answer goes from its role straight to the call that names `token` at `port`."""
        return self.stream is None and not self._ended and self._connection.forward(self._call_id, port, token)

    def relay_answer(self, relay: Relay) -> bool:
        """This (unary) call's answer goes on through `relay` as soon as it arrives; False when it is too late."""
        if self.stream is not None or self._ended or self._waiting.done() or \
                self._call_id not in self._connection.calls:
            return False
        self._connection.relays[self._call_id] = relay
        relay.attach(self._connection, self._call_id)
        return True

    async def answer(self) -> Any:
        assert isinstance(self._waiting, asyncio.Future), "a stream's frames are read through .stream"
        self._ended = True
        left = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        return await _answer_of(self._connection, self._call_id, self._waiting, left, self._reply)

    def cancel(self) -> None:
        if self.stream is not None:
            self._ended = True
            self.stream.cancel()
        elif not self._ended:
            self._ended = True
            self._connection.end_call(self._call_id, cancel=True)


def with_fast_lane(stub: Any, address: str, secure: bool, enabled: bool = True) -> Any:
    """`stub` (a generated one) wrapped to use the fast lane where `address` may have one, else `stub`."""
    from services.rpc.v1 import epd_pb2

    port = fast_lane_port(address, secure, enabled)
    service = epd_pb2.DESCRIPTOR.services_by_name.get(type(stub).__name__.removesuffix("Stub"))
    return stub if port is None or service is None else FastLaneStub(stub, service, port)


async def close_stub(stub: Any, grace_s: float = 0.0) -> None:
    """Close a fast-lane stub's connection (after `grace_s`, for calls still running); others need nothing."""
    if isinstance(stub, FastLaneStub):
        if grace_s:
            await asyncio.sleep(grace_s)
        await stub.close()
