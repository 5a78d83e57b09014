"""The role side of the fast lane (services/rpc/fastlane.py): the same servicer methods, reached over a Unix socket.

`FastLaneServer.from_registration(register)` runs the role's own gRPC registration against a recorder, so
it serves exactly the methods (and the `rpc_method` / `rpc_stream` wrappers: request ids, error codes,
metrics) the gRPC server serves.  Each connection may carry many calls at once (a call id per call);
each call is a task, cancelled when the client sends CANCEL, when its deadline passes (answered
DEADLINE_EXCEEDED, as gRPC would) or when the connection drops.  A stream's items are written as they
come, each write waiting for the socket to drain (a slow reader slows its own stream, nothing piles up).
A call opened ahead of its inputs reads them with `context.next_input(within_s)` (the INPUTS frame, or a
TOKEN_INPUTS frame another role sent: services/rpc/fastlane_forward.py); the time it waited is
`context.waited_s`, which `epd_rpc_seconds` leaves out (services/rpc/handlers.py).  A unary call the client sent
a FORWARD for has its answer written on to the role and call it names before its REPLY_FORWARDED.
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

from . import fastlane as fl
from .fastlane_forward import Forwarder

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

    def __init__(self, metadata: list[tuple[str, str]], deadline: float | None,
                 inputs: asyncio.Future | None = None) -> None:
        self._metadata, self._deadline, self._inputs = tuple(metadata), deadline, inputs
        self.waited_s = 0.0   # spent in next_input: waiting for the stage before, not working
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()
        self.deferred: list[Callable[[bool], None]] = []   # work for after the answer: `after_reply`

    def after_reply(self, done: Callable[[bool], None]) -> None:
        """`done(True)` runs once the unary answer is written to the caller, before it goes on to another role
        (a FORWARD); `done(False)` if the call ends any other way.  A handler's answer may then name what is
        made meanwhile (PrefillService: a KV entry reserved ahead of its copy, docs/architecture.md)."""
        self.deferred.append(done)

    def finish(self, answered: bool) -> None:
        """Run the work left for after the answer, once."""
        work, self.deferred = self.deferred, []
        for done in work:
            try:
                done(answered)
            except Exception:  # noqa: BLE001 - the answer is out; one failed piece of work must not stop the rest
                log.exception("work left for after a fast-lane answer failed")

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

    async def next_input(self, within_s: float) -> bytes:
        """The INPUTS frame's payload of a call opened ahead of its inputs; TimeoutError past `within_s`."""
        if self._inputs is None:
            raise RuntimeError("this call has no inputs to come")
        started = time.monotonic()
        try:
            async with asyncio.timeout(within_s):
                return await self._inputs
        finally:
            self.waited_s += time.monotonic() - started

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()


class FastLaneServer:
    def __init__(self, handlers: dict[str, Any], grpc_port: int) -> None:
        self.handlers, self.grpc_port = handlers, grpc_port
        self._server: asyncio.AbstractServer | None = None
        self._path: Path | None = None
        self._connections: set[asyncio.Task] = set()
        self._running: set[asyncio.Task] = set()
        self._draining = False
        self._counted: dict[str, Any] = {}   # method -> its child of CALLS, looked up once
        self.forwarder = Forwarder()   # answers sent on to other roles, inputs other roles send here

    @classmethod
    def from_registration(cls, register: Callable[[Any], None], grpc_port: int) -> FastLaneServer:
        recorder = _Recorder()
        register(recorder)
        return cls(recorder.handlers, grpc_port)

    async def start(self) -> Path:
        path = fl.socket_path(self.grpc_port)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a socket left by a process that held this port before
        self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=fl.MAX_FRAME)
        os.chmod(path, 0o600)  # this user's processes only, as the shm segments
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
        await self.forwarder.close()
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        calls: dict[int, asyncio.Task] = {}
        inputs: dict[int, asyncio.Future] = {}   # per running call: where its INPUTS frame goes
        forwards: dict[int, tuple[int, bytes, bytes]] = {}   # per running unary call: where its answer goes on
        loop = asyncio.get_running_loop()
        try:
            writer.write(fl.frame(fl.HELLO, 0, fl.hello_payload(self.grpc_port)))
            while True:
                size, kind, call_id = fl.HEADER.unpack(await reader.readexactly(fl.HEADER.size))
                if size > fl.MAX_FRAME:
                    raise ValueError(f"fast-lane frame of {size} bytes")
                payload = await reader.readexactly(size) if size else b""
                if kind == fl.REQUEST and self._draining:
                    await _error(writer, call_id, grpc.StatusCode.UNAVAILABLE, "the role is shutting down")
                elif kind == fl.REQUEST:
                    inputs[call_id] = loop.create_future()
                    call = asyncio.create_task(self._call(call_id, payload, writer, inputs[call_id], forwards))
                    calls[call_id] = call
                    self._running.add(call)
                    call.add_done_callback(lambda done, cid=call_id: (calls.pop(cid, None), inputs.pop(cid, None),
                                                                      forwards.pop(cid, None),
                                                                      self._running.discard(done)))
                elif kind == fl.CANCEL and call_id in calls:
                    calls[call_id].cancel()
                elif kind == fl.INPUTS and call_id in inputs and not inputs[call_id].done():
                    inputs[call_id].set_result(payload)   # a second one, or one for an ended call, is dropped
                elif kind == fl.TOKEN_INPUTS and len(payload) >= fl.TOKEN_BYTES:
                    self.forwarder.deliver(payload[:fl.TOKEN_BYTES], payload[fl.TOKEN_BYTES:])
                elif kind == fl.FORWARD and call_id in calls:
                    forwards[call_id] = fl.parse_forward(payload)   # one too short ends the connection (bad frame)
                    self.forwarder.prepare(forwards[call_id][0])
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # noqa: BLE001 - a broken frame ends this connection only
            log.exception("fast-lane connection closed on a bad frame")
        finally:
            for call in list(calls.values()):
                call.cancel()  # the caller is gone: its calls end as gRPC's would
            writer.close()
            self._connections.discard(task)

    async def _call(self, call_id: int, payload: bytes, writer: asyncio.StreamWriter,
                    inputs: asyncio.Future, forwards: dict[int, tuple[int, bytes, bytes]]) -> None:
        try:
            await self._run(call_id, payload, writer, inputs, forwards)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the caller cancelled or went away: nobody to answer

    async def _run(self, call_id: int, payload: bytes, writer: asyncio.StreamWriter,
                   inputs: asyncio.Future | None = None,
                   forwards: dict[int, tuple[int, bytes, bytes]] | None = None) -> None:
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
        context = _Context(metadata, None if timeout is None else time.monotonic() + timeout, inputs)
        token = fl.inputs_token(metadata) if inputs is not None else None
        forget = self.forwarder.expect(token, inputs) if token is not None and inputs is not None else None
        try:
            request = handler.request_deserializer(body)
            async with asyncio.timeout(None if timeout is None or math.isinf(timeout) else timeout):
                if handler.unary_stream is not None:
                    async for item in handler.unary_stream(request, context):
                        await _send(writer, fl.frame(fl.ITEM, call_id, handler.response_serializer(item)))
                    await _send(writer, fl.frame(fl.END, call_id))
                else:
                    reply = handler.response_serializer(await handler.unary_unary(request, context))
                    forward = forwards.pop(call_id, None) if forwards else None
                    if context.deferred:
                        await self._answer_then_finish(writer, call_id, context, reply, forward)
                    # forwarded first: the next role's wake-up is the one the request waits for
                    elif forward is not None and self.forwarder.send(forward[0], forward[1], reply + forward[2]):
                        await _send(writer, fl.frame(fl.REPLY_FORWARDED, call_id, forward[1] + reply))
                    else:
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
        finally:
            context.finish(False)
            if forget is not None:
                forget()

    async def _answer_then_finish(self, writer: asyncio.StreamWriter, call_id: int, context: _Context, reply: bytes,
                                  forward: tuple[int, bytes, bytes] | None) -> None:
        """An answer with work left for after it: the caller gets the answer first, then the work runs, then the
        answer goes on to the next role (which may read what the work made); without a forward the work runs
        first (the caller may send the answer on itself)."""
        if forward is not None and self.forwarder.can_send(forward[0]):
            # written, the work done and the answer sent on in one turn of the loop: nothing can close the next
            # role's connection in between, so the caller is never told of a forward that did not happen
            if writer.is_closing():
                raise ConnectionError("the fast-lane connection is closed")
            writer.write(fl.frame(fl.REPLY_FORWARDED, call_id, forward[1] + reply))
            context.finish(True)
            self.forwarder.send(forward[0], forward[1], reply + forward[2])
            await writer.drain()
        else:
            context.finish(True)
            await _send(writer, fl.frame(fl.REPLY, call_id, reply))


async def _error(writer: asyncio.StreamWriter, call_id: int, code: grpc.StatusCode, details: str,
                 trailing: Any = ()) -> None:
    await _send(writer, fl.frame(fl.ERROR, call_id, fl.error_payload(code.value[0], details, trailing)))


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    if writer.is_closing():
        raise ConnectionError("the fast-lane connection is closed")
    writer.write(data)
    await writer.drain()
