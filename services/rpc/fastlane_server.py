"""The role side of the fast lane (services/rpc/fastlane.py): the same servicer methods, reached over a Unix socket.

`FastLaneServer.from_registration(register, grpc_port, instance_id)` runs the role's own gRPC registration
against a recorder, so it serves exactly the methods (and the `rpc_method` / `rpc_stream` wrappers: request ids,
error codes, metrics) the gRPC server serves.  Each connection (from a process of this same user: SO_PEERCRED)
may carry up to MAX_CALLS calls at once (a call id per call; more are refused RESOURCE_EXHAUSTED with the
`overloaded` code, so the coordinator treats them as a full role); each call is a task, cancelled when the
client sends CANCEL, when its deadline passes (answered DEADLINE_EXCEEDED, as gRPC would) or when the
connection drops.  Every frame written waits for the socket to drain: a slow reader slows its own calls,
nothing piles up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import Counter

from services.protocol.errors import ERROR_CODE_METADATA_KEY

from . import fastlane as fl

log = logging.getLogger(__name__)
CALLS = Counter("epd_fast_lane_calls", "Calls served over the same-host fast lane (services/rpc/fastlane.py)",
                ["method"])


class _Recorder:
    """Takes what a generated `add_*Servicer_to_server` hands a gRPC server."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, _: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, handler in handlers.items():
            self.handlers[f"{service}/{name}"] = handler


class _Context:
    """What the servicers (and rpc_method / rpc_stream) use of grpc.aio.ServicerContext."""

    def __init__(self, metadata: list[tuple[str, str]], deadline: float | None) -> None:
        self._metadata, self._deadline = tuple(metadata), deadline
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def peer(self) -> str:
        return "unix:fast-lane"

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()


class FastLaneServer:
    def __init__(self, handlers: dict[str, Any], grpc_port: int, instance_id: str) -> None:
        self.handlers, self.grpc_port, self.instance_id = handlers, grpc_port, instance_id
        self._server: asyncio.AbstractServer | None = None
        self._path: Path | None = None
        self._connections: set[asyncio.Task] = set()
        self._running: set[asyncio.Task] = set()
        self._draining = False
        self._counted: dict[str, Any] = {}   # method -> its child of CALLS, looked up once

    @classmethod
    def from_registration(cls, register: Callable[[Any], None], grpc_port: int,
                          instance_id: str) -> FastLaneServer:
        recorder = _Recorder()
        register(recorder)
        return cls(recorder.handlers, grpc_port, instance_id)

    async def start(self) -> Path:
        """Listen; a socket another process left for this port (this process holds the port now) is removed."""
        for stale in fl.sockets_for(self.grpc_port):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        path = fl.socket_path(self.grpc_port, self.instance_id)
        self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=fl.MAX_FRAME)
        os.chmod(path, 0o600)   # this user's processes only, as its folder (and SO_PEERCRED checks each peer)
        self._path = path
        return path

    async def stop(self, grace_s: float) -> None:
        """As grpc's `server.stop(grace)`: new calls are refused (UNAVAILABLE, so the coordinator fails them
        over), running ones get up to `grace_s` to finish, then everything closes."""
        self._draining = True
        if self._running:
            await asyncio.wait(set(self._running), timeout=max(0.0, grace_s))
        await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        calls: dict[int, asyncio.Task] = {}
        try:
            if not fl.peer_is_us(writer):
                log.warning("fast lane: refused a connection from another user's process")
                return
            await _send(writer, fl.frame(fl.HELLO, 0, fl.hello_payload(self.grpc_port, self.instance_id)))
            while True:
                kind, call_id, payload = await fl.read_frame(reader)
                if kind == fl.REQUEST:
                    await self._start_call(call_id, payload, writer, calls)
                elif kind == fl.CANCEL and call_id in calls:
                    calls[call_id].cancel()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # noqa: BLE001 - a broken frame ends this connection only
            log.exception("fast-lane connection closed on a bad frame")
        finally:
            for call in list(calls.values()):
                call.cancel()  # the caller is gone: its calls end as gRPC's would
            writer.close()
            self._connections.discard(task)

    async def _start_call(self, call_id: int, payload: bytes, writer: asyncio.StreamWriter,
                          calls: dict[int, asyncio.Task]) -> None:
        if self._draining:
            await _error(writer, call_id, grpc.StatusCode.UNAVAILABLE, "the role is shutting down")
            return
        if len(calls) >= fl.MAX_CALLS or call_id in calls:
            await _error(writer, call_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"this fast-lane connection carries {fl.MAX_CALLS} calls already",
                         ((ERROR_CODE_METADATA_KEY, "overloaded"),))
            return
        call = asyncio.create_task(self._call(call_id, payload, writer))
        calls[call_id] = call
        self._running.add(call)
        def ended(done: asyncio.Task) -> None:
            calls.pop(call_id, None)
            self._running.discard(done)

        call.add_done_callback(ended)

    async def _call(self, call_id: int, payload: bytes, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):   # the caller left: nobody to answer
            await self._run(call_id, payload, writer)

    async def _run(self, call_id: int, payload: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            method, metadata, timeout, body = fl.parse_request(payload)
        except Exception:  # noqa: BLE001 - answered, not raised
            await _error(writer, call_id, grpc.StatusCode.INTERNAL, "malformed fast-lane request")
            return
        handler = self.handlers.get(method)
        if handler is None:
            await _error(writer, call_id, grpc.StatusCode.UNIMPLEMENTED, f"method {method} is not served here")
            return
        counter = self._counted.get(method)
        if counter is None:
            counter = self._counted[method] = CALLS.labels(method.rsplit("/", 1)[1])
        counter.inc()
        context = _Context(metadata, None if timeout is None else time.monotonic() + timeout)
        try:
            request = handler.request_deserializer(body)
            async with asyncio.timeout(None if timeout is None or math.isinf(timeout) else timeout):
                if handler.unary_stream is not None:
                    async for item in handler.unary_stream(request, context):
                        await _send(writer, fl.frame(fl.ITEM, call_id, handler.response_serializer(item)))
                    await _send(writer, fl.frame(fl.END, call_id))
                else:
                    reply = handler.response_serializer(await handler.unary_unary(request, context))
                    await _send(writer, fl.frame(fl.REPLY, call_id, reply))
        except grpc.aio.AbortError:
            await _error(writer, call_id, context.code or grpc.StatusCode.UNKNOWN, context.details, context.trailing)
        except TimeoutError:
            await _error(writer, call_id, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:  # noqa: BLE001 - a handler outside rpc_method; answered as gRPC answers it
            log.exception("fast-lane call %s failed", method)
            await _error(writer, call_id, grpc.StatusCode.UNKNOWN, "Unexpected error in the handler")


async def _error(writer: asyncio.StreamWriter, call_id: int, code: grpc.StatusCode, details: str,
                 trailing: Any = ()) -> None:
    await _send(writer, fl.frame(fl.ERROR, call_id, fl.error_payload(code.value[0], details, trailing)))


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    if writer.is_closing():
        raise ConnectionError("the fast-lane connection is closed")
    writer.write(data)
    await writer.drain()
