"""A request cancelled while its KV is being copied into its blocks releases them only after the copy."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.decode.serving import _uncancelled_thread


def test_a_cancelled_caller_waits_for_the_copy_to_finish():
    copying_done = threading.Event()

    def copy() -> None:
        time.sleep(0.3)
        copying_done.set()

    async def main() -> bool:
        task = asyncio.ensure_future(_uncancelled_thread(copy))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return copying_done.is_set()   # what `blocks.release()` would see right after

    assert asyncio.run(main()) is True


def test_results_and_errors_pass_through():
    assert asyncio.run(_uncancelled_thread(lambda x: x + 1, 41)) == 42
    with pytest.raises(ZeroDivisionError):
        asyncio.run(_uncancelled_thread(lambda: 1 / 0))
