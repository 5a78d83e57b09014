"""Render's image worker processes: encoded bytes in and processed arrays out through shared memory.

Why not a ProcessPoolExecutor: it pickles every image into a pipe and every array back out of one,
through its feeder and manager threads, in 64 KB pipe writes.  For a 448x448 image (a ~0.6 MB PNG in,
1.2 MB of patches out) that cost render's main process ~2.2 ms of CPU per image beside the worker's
~4.8, and the main process shares the cores with the workers: two workers could never reach 1.7x one
(docs/benchmarks.md, "Render throughput").

Here each worker is one spawned process with one control socket and, per slot (two), an input and an
output buffer (memfd, passed over the socket; nothing named, so nothing leaks if a process dies):

- a slot's input buffer belongs to the main process: it writes the image's (or video's) bytes there and
  sends ("job", slot, nbytes, kind), kind "image" or "video";
- a slot's output buffer belongs to the worker: it writes each array there (64-byte aligned) and
  answers ("ok", slot, [(key, dtype, shape, offset)], num_tokens, info), or ("invalid", slot, (message,
  code)) for an image it refuses, or ("error", slot, message) for a failure of its own;
- a buffer that is too small is replaced by a larger one (doubling), announced with ("in" | "out",
  slot, size) and the new descriptor; the other side maps it and drops the old one.

A slot is given a new job only after the main process has copied its arrays out, so no buffer is
written while the other side reads it; with two slots a worker starts its next image while the main
process copies the last one out and its event loop gets round to it (one slot per worker measured
1.5x for two workers against a 1.74x ceiling: the workers waited on the main process).  Replies are
read by the event loop (`add_reader` on the socket): no thread per worker; only arrays over 1 MB are
copied out in a thread, so the loop never spends more than a 1 MB memcpy on an image.  A worker that dies
(OOM, killed) closes its socket: its job fails as `render_worker_died` (503) and a new process takes
its place.  The main process's per-image work is the two memcpys and a few hundred bytes of control.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import mmap
import multiprocessing
import os
import pickle
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import numpy as np

from services.protocol.errors import InternalError, InvalidRequest, Unavailable
from services.render.processor import ProcessedImage
from services.runtime.heap import startup_done

log = logging.getLogger(__name__)
ALIGN = 64
MIN_BUFFER = 4 << 20
SLOTS = 2   # jobs a worker holds: one it works on, one waiting in its buffers
START_TIMEOUT_S = 120.0
OFF_LOOP_BYTES = 1 << 20   # arrays larger than this are copied out of the worker's buffer in a thread


def _nbytes(specs: list) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for _, dtype, shape, _ in specs)


class _Buffer:
    """A growable memfd mapping; `fd` is kept open until the buffer is replaced or closed."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("epd-render", 0)
        os.ftruncate(self.fd, size)
        self.size = size
        self.map = mmap.mmap(self.fd, size)

    @classmethod
    def attach(cls, fd: int, size: int) -> _Buffer:
        buffer = cls.__new__(cls)
        buffer.fd, buffer.size, buffer.map = fd, size, mmap.mmap(fd, size)
        return buffer

    def close(self) -> None:
        with contextlib.suppress(BufferError):   # a view still exported: the mapping goes with the last view
            self.map.close()
        os.close(self.fd)


def _grown(current: _Buffer | None, need: int) -> _Buffer | None:
    """A new buffer when `current` cannot hold `need` bytes (the caller announces it), else None."""
    if current is not None and current.size >= need:
        return None
    size = max(MIN_BUFFER, need, 2 * current.size if current else 0)
    return _Buffer(size)


def _send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


# ---- in the worker process ------------------------------------------------------------------


def _attach(buffers: list[_Buffer | None], slot: int, fd: int, size: int) -> None:
    if buffers[slot] is not None:
        buffers[slot].close()   # type: ignore[union-attr]
    buffers[slot] = _Buffer.attach(fd, size)


def worker_main(conn: Connection, init: Any, init_args: tuple, run: Any) -> None:
    """The worker's loop: `init(*init_args)` once, then `run(bytes, kind) -> (status, value)` per job."""
    gc.disable()   # while `init` imports and loads (services/runtime/heap.py: startup_done)
    init(*init_args)
    startup_done()
    _send(conn, ("ready",))
    inbox: list[_Buffer | None] = [None] * SLOTS
    out: list[_Buffer | None] = [None] * SLOTS
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):
            return   # the main process closed the socket or died
        kind, slot = message[0], message[1]
        if kind == "in":
            _attach(inbox, slot, recv_handle(conn), message[2])
            continue
        try:
            status, value = run(bytes(inbox[slot].map[:message[2]]), message[3])   # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the worker carries on
            _send(conn, ("error", slot, f"{type(exc).__name__}: {exc}"))
            continue
        if status != "ok":
            _send(conn, (status, slot, value))
            continue
        # C order, shapes kept: np.ascontiguousarray would make a scalar (second_per_grid_ts) shape (1,)
        arrays = {key: np.asarray(array, order="C") for key, array in value.arrays.items()}
        specs, offset = [], 0
        for key, array in arrays.items():
            specs.append((key, array.dtype.str, array.shape, offset))
            offset += -(-array.nbytes // ALIGN) * ALIGN
        grown = _grown(out[slot], offset)
        if grown is not None:
            if out[slot] is not None:
                out[slot].close()   # type: ignore[union-attr]
            out[slot] = grown
            _send(conn, ("out", slot, grown.size))
            send_handle(conn, grown.fd, os.getppid())
        target = out[slot]
        assert target is not None
        for (_key, _dtype, _shape, at), array in zip(specs, arrays.values(), strict=True):
            np.frombuffer(target.map, np.uint8, array.nbytes, at)[:] = array.reshape(-1).view(np.uint8)
        _send(conn, ("ok", slot, specs, value.num_tokens, value.info))


# ---- in the main process --------------------------------------------------------------------


class _Worker:
    def __init__(self, ctx: Any, init: Any, init_args: tuple, run: Any) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main, args=(child, init, init_args, run), daemon=True,
                                   name="render-worker")
        self.process.start()
        child.close()
        self.ready = False
        self.inbox: list[_Buffer | None] = [None] * SLOTS
        self.out: list[_Buffer | None] = [None] * SLOTS
        self.free = list(range(SLOTS))   # slots whose arrays were copied out
        self.pending: deque[asyncio.Future[ProcessedImage]] = deque()   # replies due, in job order
        self.loop: asyncio.AbstractEventLoop | None = None   # where its socket is watched, while pending

    def read(self) -> tuple | None:
        """The next reply; None when only a "ready" or a replaced output buffer was there."""
        while True:
            message = _recv(self.conn)
            if message[0] == "ready":
                self.ready = True
            elif message[0] == "out":
                _attach(self.out, message[1], recv_handle(self.conn), message[2])
            else:
                return message
            if not self.conn.poll(0):
                return None

    def send_job(self, slot: int, data: bytes, kind: str) -> None:
        grown = _grown(self.inbox[slot], len(data))
        if grown is not None:
            _send(self.conn, ("in", slot, grown.size))
            send_handle(self.conn, grown.fd, self.process.pid)
            if self.inbox[slot] is not None:
                self.inbox[slot].close()   # type: ignore[union-attr]
            self.inbox[slot] = grown
        buffer = self.inbox[slot]
        assert buffer is not None
        buffer.map[:len(data)] = data
        _send(self.conn, ("job", slot, len(data), kind))

    def arrays(self, slot: int, specs: list) -> dict[str, np.ndarray]:
        """The reply's arrays, copied out of the slot's buffer (the slot's next job writes over it)."""
        buffer = self.out[slot]
        assert buffer is not None
        out = {}
        for key, dtype, shape, offset in specs:
            count = int(np.prod(shape, dtype=np.int64))
            out[key] = np.frombuffer(buffer.map, np.dtype(dtype), count, offset).reshape(shape).copy()
        return out

    def close(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.conn.fileno())
        self.conn.close()
        self.process.kill()
        self.process.join(5)
        for buffer in (*self.inbox, *self.out):
            if buffer is not None:
                buffer.close()


def _settle(done: asyncio.Future, outcome: Any) -> None:
    if done.done():
        return
    if isinstance(outcome, BaseException):
        done.set_exception(outcome)
        done.exception()   # retrieved: a caller that left does not log it as never retrieved
    else:
        done.set_result(outcome)


class WorkerProcesses:
    """`num_workers` worker processes; `await run(data, kind)` -> ProcessedImage, at most SLOTS jobs per worker.

    `timeout_s` bounds one job: a worker that has not answered by then (a video whose decode hangs inside
    FFmpeg, past its own cooperative deadline) is killed and replaced, and its job fails with a 400."""

    def __init__(self, num_workers: int, init: Any, init_args: tuple, run: Any) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._spec = (init, init_args, run)
        self._workers = [self._start() for _ in range(num_workers)]
        self._waiting: deque[asyncio.Future[tuple[_Worker, int]]] = deque()

    def _start(self) -> _Worker:
        return _Worker(self._ctx, *self._spec)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def idle(self) -> int:
        """Workers with no job (tests: none is lost to a caller that left)."""
        return sum(1 for w in self._workers if len(w.free) == SLOTS and not w.pending)

    def warm_up(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every worker has loaded the image processor (call before the first job)."""
        for worker in self._workers:
            if not worker.ready:
                try:
                    if not worker.conn.poll(timeout_s):
                        raise Unavailable(f"a render worker did not start in {timeout_s} s",
                                          code="render_worker_died")
                    worker.read()
                except (EOFError, OSError):
                    raise Unavailable(f"a render worker exited at start (exit code {worker.process.exitcode})",
                                      code="render_worker_died") from None

    async def run(self, data: bytes, kind: str = "image", timeout_s: float | None = None) -> ProcessedImage:
        worker, slot = await self._acquire()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[ProcessedImage] = loop.create_future()
        try:
            worker.send_job(slot, data, kind)
        except (OSError, ValueError):
            worker.free.append(slot)
            self._replace(worker)
            raise Unavailable("a render worker died before it took the image", code="render_worker_died") from None
        worker.pending.append(done)
        if worker.loop is None:
            worker.loop = loop
            loop.add_reader(worker.conn.fileno(), self._on_reply, worker)
            # uvloop (libuv's uv_poll) makes a watched fd non-blocking; a reply's body may lag its header by
            # a moment, and `read` waits for it, so the socket stays blocking (only readiness is watched)
            os.set_blocking(worker.conn.fileno(), True)
        # Not cancelled with its caller: the reply is read (and the slot freed) by _on_reply regardless.
        if timeout_s is None:
            return await asyncio.shield(done)
        if not worker.ready:   # a fresh worker loads its processors first: that is not the job's time
            timeout_s += START_TIMEOUT_S
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(done)
        except TimeoutError:
            if not done.done() and done in worker.pending:
                log.error("a render worker ran a %s job past %.1f s; replacing it", kind, timeout_s)
                _settle(done, InvalidRequest(f"processing the {kind} did not finish within its deadline "
                                             f"({timeout_s:g} s): the render worker was replaced",
                                             code=f"{kind}_decode_timeout"))
                self._replace(worker)   # its other job, if any, fails as a dead worker's (503, retried)
            return await asyncio.shield(done)

    def _on_reply(self, worker: _Worker) -> None:
        try:
            message = worker.read()
        except (EOFError, OSError):
            log.error("a render worker process died (exit code %s); starting a new one", worker.process.exitcode)
            self._replace(worker)
            return
        if message is None:
            return   # a "ready" or a new buffer came first; the reply follows
        done = worker.pending.popleft()
        loop = worker.loop
        assert loop is not None
        if not worker.pending:
            self._unwatch(worker)
        kind, slot = message[0], message[1]
        if kind == "ok" and _nbytes(message[2]) > OFF_LOOP_BYTES:   # a large image: copied in a thread
            copy = loop.run_in_executor(None, worker.arrays, slot, message[2])
            copy.add_done_callback(lambda _: self._finish(worker, slot, done, copy.result, message[3], message[4]))
        elif kind == "ok":
            self._finish(worker, slot, done, lambda: worker.arrays(slot, message[2]), message[3], message[4])
        else:
            self._release(worker, slot)
            _settle(done, InvalidRequest(message[2][0], code=message[2][1]) if kind == "invalid" else
                    InternalError(f"render worker failed: {message[2]}", code="render_worker_error"))

    def _unwatch(self, worker: _Worker) -> None:
        if worker.loop is not None:
            if not worker.loop.is_closed():
                worker.loop.remove_reader(worker.conn.fileno())
            worker.loop = None

    def _finish(self, worker: _Worker, slot: int, done: asyncio.Future[ProcessedImage], arrays: Any,
                num_tokens: int, info: dict) -> None:
        """The copied arrays to the caller (if still there); the slot takes a new job again."""
        try:
            _settle(done, ProcessedImage(arrays(), num_tokens, info))
        except Exception as exc:  # noqa: BLE001 - the caller hears of it
            _settle(done, InternalError(f"copying a render worker's arrays failed: {exc}", code="render_worker_error"))
        finally:
            self._release(worker, slot)

    def _free_slot(self) -> tuple[_Worker, int] | None:
        """A free slot of the least busy worker (an idle worker first)."""
        ready = [w for w in self._workers if w.free]
        if not ready:
            return None
        worker = min(ready, key=lambda w: SLOTS - len(w.free))
        return worker, worker.free.pop()

    async def _acquire(self) -> tuple[_Worker, int]:
        if not self._waiting and (found := self._free_slot()) is not None:
            return found
        waiter: asyncio.Future[tuple[_Worker, int]] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(*waiter.result())   # handed over just as its caller left
            raise

    def _release(self, worker: _Worker, slot: int) -> None:
        if worker not in self._workers:
            return   # it died meanwhile: its replacement came with its own slots
        worker.free.append(slot)
        while self._waiting and (found := self._free_slot()) is not None:
            waiter = self._waiting.popleft()
            if waiter.done():
                found[0].free.append(found[1])
                continue
            waiter.set_result(found)

    def _replace(self, dead: _Worker) -> None:
        self._unwatch(dead)
        failed = list(dead.pending)
        dead.pending.clear()
        dead.close()
        fresh = self._start()
        self._workers[self._workers.index(dead)] = fresh
        for done in failed:
            _settle(done, Unavailable("a render worker died while processing the image", code="render_worker_died"))
        if fresh.free:
            self._release(fresh, fresh.free.pop())

    def close(self) -> None:
        for worker in self._workers:
            self._unwatch(worker)
            worker.close()
        for waiter in self._waiting:
            _settle(waiter, Unavailable("render's image workers are closed", code="render_worker_died"))
