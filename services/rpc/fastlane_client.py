"""The coordinator side of the fast lane (services/rpc/fastlane.py): a stub that speaks it, gRPC otherwise.

`FastLaneStub(grpc_stub, service, port)` has the generated stub's methods with the same call shapes: a unary
method returns an awaitable answer, a server-streaming one a call with `read()` (a message or `grpc.aio.EOF`)
and `cancel()`; failures are `grpc.aio.AioRpcError`s with the gRPC status code and the role's trailing
metadata (its epd error code), so the coordinator's failover and error mapping see exactly what gRPC would
give them.  A lost connection fails its calls with UNAVAILABLE (no epd error code: a transport failure).

Used only where it can be: the address is a loopback one, the channel is plaintext, the role's socket exists
and its HELLO names the port the address names.  Otherwise, and for `FAILED_RETRY_S` after a failed connect,
each call goes to the wrapped gRPC stub.  One connection per instance carries all its calls (a call id each);
it is opened on the first call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from . import fastlane as fl

__all__ = ["FastLaneStub", "close_stub", "fast_lane_port", "with_fast_lane"]

log = logging.getLogger(__name__)
FAILED_RETRY_S = 1.0
CONNECT_TIMEOUT_S = 2.0
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
        self.closed = False
        self.task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                kind, call_id, payload = await fl.read_frame(self.reader)
                _deliver(self.calls.get(call_id), kind, payload)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.CancelledError):
            pass
        finally:
            self.closed = True
            self.writer.close()
            for waiting in self.calls.values():
                _deliver(waiting, None, b"")  # the connection is gone: every call fails UNAVAILABLE

    async def open_call(self, method: str, message: bytes, timeout: float | None, metadata: Any,
                        waiting: asyncio.Queue | asyncio.Future) -> int:
        """Send the call, waiting for the socket to drain; its frames go to `waiting`: a stream's queue, or a unary
        call's future (one frame)."""
        if self.closed:
            raise _unavailable("the connection is closed")
        call_id = next(self.ids)
        self.calls[call_id] = waiting
        try:
            self.writer.write(fl.frame(fl.REQUEST, call_id, fl.request_payload(method, metadata, timeout, message)))
            await self.writer.drain()
        except (RuntimeError, ConnectionError) as exc:
            self.calls.pop(call_id, None)
            raise _unavailable(f"the connection closed ({exc})") from None
        except BaseException:
            self.end_call(call_id, cancel=True)
            raise
        return call_id

    def end_call(self, call_id: int, cancel: bool) -> None:
        if self.calls.pop(call_id, None) is not None and cancel and not self.closed:
            with contextlib.suppress(RuntimeError, ConnectionError):
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


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _StreamCall:
    """A server stream over the fast lane, shaped like grpc.aio.UnaryStreamCall (read, cancel)."""

    def __init__(self, stub: FastLaneStub, method: str, request: Any, timeout: float | None, metadata: Any,
                 reply_class: Any) -> None:
        self._stub, self._method, self._request = stub, method, request
        self._timeout, self._metadata, self._reply = timeout, metadata, reply_class
        self._deadline = None if timeout is None or math.isinf(timeout) else time.monotonic() + timeout
        self._open: tuple[_Connection, int, asyncio.Queue] | None = None
        self._fallback: Any = None  # the gRPC call, when the fast lane turned out not to be there
        self._done = False

    async def read(self) -> Any:
        if self._fallback is not None:
            return await self._fallback.read()
        if self._done:
            return grpc.aio.EOF
        if self._open is None and not await self._start():
            return await self._fallback.read()
        assert self._open is not None
        connection, call_id, queue = self._open
        try:
            async with asyncio.timeout(_left(self._deadline)):
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

    async def _start(self) -> bool:
        """Open the call on the fast lane; False when it is not there after all (the call then goes by gRPC)."""
        try:
            connection = await self._stub.connection()
        except grpc.aio.AioRpcError:
            self._fallback = getattr(self._stub.grpc_stub, self._method.rsplit("/", 1)[1])(
                self._request, timeout=_left(self._deadline), metadata=self._metadata)
            return False
        queue: asyncio.Queue = asyncio.Queue()
        call_id = await connection.open_call(self._method, self._request.SerializeToString(), self._timeout,
                                             self._metadata, queue)
        self._open = (connection, call_id, queue)
        return True

    def cancel(self) -> bool:
        if self._fallback is not None:
            return bool(self._fallback.cancel())
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

        def unary(request: Any, timeout: float | None = None, metadata: Any = None) -> Any:
            if not self.up():
                return getattr(self._grpc, name)(request, timeout=timeout, metadata=metadata)
            return self._unary(full, request, timeout, metadata, reply)
        self.__dict__[name] = unary
        return unary

    @property
    def grpc_stub(self) -> Any:
        return self._grpc

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
                reader, writer = await fl.connect(self._port, CONNECT_TIMEOUT_S)
            except fl.CONNECT_ERRORS as exc:
                self._failed_at = time.monotonic()
                log.debug("fast lane to port %d not available (%s): gRPC", self._port, exc)
                raise _unavailable(f"no fast lane to port {self._port} ({exc})") from None
            self._conn = _Connection(reader, writer)
            return self._conn

    async def _unary(self, method: str, request: Any, timeout: float | None, metadata: Any, reply: Any) -> Any:
        try:
            connection = await self.connection()
        except grpc.aio.AioRpcError:  # no fast lane after all: this call goes through gRPC
            name = method.rsplit("/", 1)[1]
            return await getattr(self._grpc, name)(request, timeout=timeout, metadata=metadata)
        deadline = None if timeout is None or math.isinf(timeout) else time.monotonic() + timeout
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        call_id = await connection.open_call(method, request.SerializeToString(), timeout, metadata, answer)
        finished = False
        try:
            async with asyncio.timeout(_left(deadline)):
                kind, payload = await answer
            finished = True
        except TimeoutError:
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            connection.end_call(call_id, cancel=not finished)
        if kind == fl.REPLY:
            return reply.FromString(payload)
        _answer(kind, payload)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(asyncio.CancelledError):
                await self._conn.task


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
