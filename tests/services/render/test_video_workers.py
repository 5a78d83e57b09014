"""A render worker that does not answer within a job's deadline is killed and replaced; its job is a 400.

A video decode that hangs inside FFmpeg (past the worker's own per-frame deadline check) cannot be made on
demand with a real file, so the worker here runs a FAKE job function that sleeps when told to; everything
else (processes, sockets, shared memory, the kill and the replacement) is the real pool.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from services.protocol.errors import InvalidRequest
from services.render.image_procs import WorkerProcesses
from services.render.processor import ProcessedImage


def _init() -> None:
    pass


def fake_job(data: bytes, kind: str) -> tuple[str, object]:
    """FAKE: b"hang" sleeps far past any deadline (a decoder stuck inside FFmpeg); anything else answers."""
    if data == b"hang":
        time.sleep(3600)
    return "ok", ProcessedImage({"x": np.frombuffer(data, np.uint8).copy()}, len(data), {"kind": kind})


def test_a_job_past_its_deadline_kills_the_worker_and_the_pool_serves_on():
    pool = WorkerProcesses(1, _init, (), fake_job)
    try:
        pool.warm_up()
        [first_pid] = pool.pids()

        async def scenario():
            started = time.monotonic()
            with pytest.raises(InvalidRequest, match="did not finish within its deadline") as caught:
                await pool.run(b"hang", "video", timeout_s=0.5)
            assert caught.value.code == "video_decode_timeout" and time.monotonic() - started < 5
            return await pool.run(b"fine", "video", timeout_s=30)

        answer = asyncio.run(scenario())
        assert answer.num_tokens == 4 and answer.info == {"kind": "video"} and bytes(answer.arrays["x"]) == b"fine"
        [second_pid] = pool.pids()
        assert second_pid != first_pid
    finally:
        pool.close()
