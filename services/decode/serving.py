"""Decode's core: kv_transfer_params + first token -> a stream of DecodeEvents.

Admission: the engine reserves the request's blocks in its KV pool first (waiting up to
`kv_wait_s` for room, at most `max_waiting` requests at a time, else EngineFull -> 429, with
the KV entry left in the store for another instance); then the entry is read through the
store's view (zero-copy for shm; Redis falls back to a get) and copied once, straight into the
blocks, and released so its producer can free it.  Leaving the stream early (client gone, call
cancelled) aborts the request, which frees its row and blocks before the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import Counter

from services.connectors.base import ConnectorError, TensorStore
from services.connectors.wiring import as_epd_error
from services.owned_metrics import OwnedGauges
from services.protocol.errors import InvalidRequest
from services.protocol.logprobs import FLOOR, TokenLogprob

from .detokenizer import decode_function
from .engine import DecodeEngine
from .errors import EngineFull
from .metrics import ENGINE_GAUGES, export_info
from .params import DecodeParams
from .params_from import decode_params
from .request_blocks import RequestBlocks
from .stream import DecodeEvent

_POLL_S = 0.005   # how often a request waiting for KV room looks again

FINISHED = Counter("epd_decode_requests_finished", "Decode requests by finish reason", ["reason"])
TOKENS = Counter("epd_decode_tokens", "Output tokens produced")
GAUGES = {
    **{name: (doc, lambda s, read=read: read(s.engine.stats())) for name, (doc, read) in ENGINE_GAUGES.items()},
    "epd_kv_store_bytes_copied_total": ("Payload bytes the KV store reader copied (gets; views none)",
                                        lambda s: s.kv_store.stats().bytes_copied),
}


def _transfer_fields(kv_params: Any) -> tuple[dict, int, int, int]:
    if not isinstance(kv_params, dict):
        raise InvalidRequest("kv_transfer_params must be an object", code="invalid_kv_transfer_params")
    try:
        return (dict(kv_params["handle"]), int(kv_params["num_prompt_tokens"]), int(kv_params["rope_delta"]),
                int(kv_params["first_token_id"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"kv_transfer_params: missing or bad field {exc}",
                             code="invalid_kv_transfer_params") from None


async def _uncancelled_thread(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a worker thread; a cancelled caller still waits for the thread to finish (then
    re-raises), so blocks are never released while the thread is still copying into them."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


class DecodeService:
    def __init__(self, engine: DecodeEngine, kv_store: TensorStore, kv_wait_s: float = 10.0,
                 max_waiting: int | None = None) -> None:
        self.engine, self.kv_store = engine, kv_store
        self.kv_wait_s = kv_wait_s
        self.max_waiting = engine.max_queued if max_waiting is None else max_waiting
        self._num_waiting = 0
        # Read at scrape time: an aborted request's row and blocks show free as soon as the engine let them go.
        self.gauges = OwnedGauges(self, GAUGES)
        export_info(engine)

    @property
    def num_waiting_for_kv(self) -> int:
        """Requests waiting for room in the KV pool (not yet queued in the engine)."""
        return self._num_waiting

    async def decode(self, request_id: str, kv_params: Any, sampling: dict[str, Any],
                     prompt_token_ids: list[int] | None = None) -> AsyncIterator[DecodeEvent]:
        params = decode_params(sampling)
        handle, prompt_len, rope_delta, first_token = _transfer_fields(kv_params)
        self._check_room()  # before the KV is loaded (and released): a full instance leaves it for another
        blocks = await self._reserve(prompt_len, params)
        try:
            await _uncancelled_thread(self._load, handle, blocks, prompt_len)
            stream = self.engine.submit(request_id, blocks, prompt_len, rope_delta, first_token, params,
                                        prompt_token_ids=prompt_token_ids or None)
        except BaseException:
            blocks.release()
            raise
        texts = _LogprobTexts(self.engine.tokenizer, kv_params, first_token) if params.logprobs is not None else None
        finished = False
        try:
            async for event in stream.events():
                if texts is not None:
                    event = texts.complete(event)
                TOKENS.inc(len(event.token_ids))
                if event.finished:
                    finished = True
                    FINISHED.labels(event.finish_reason or "unknown").inc()
                yield event
        finally:
            if not finished:
                self.engine.abort(request_id)
                FINISHED.labels("abort").inc()

    async def _reserve(self, prompt_len: int, params: DecodeParams) -> RequestBlocks:
        """The request's blocks; waits (bounded in time and in waiters) while the pool is full."""
        blocks = self.engine.reserve(prompt_len, params)
        if blocks is not None:
            return blocks
        if self._num_waiting >= self.max_waiting:
            raise self._pool_full("its admission queue is full too")
        self._num_waiting += 1
        try:
            deadline = time.monotonic() + self.kv_wait_s
            while blocks is None:
                if time.monotonic() >= deadline:
                    raise self._pool_full(f"no room within {self.kv_wait_s:g} s")
                await asyncio.sleep(_POLL_S)
                blocks = self.engine.reserve(prompt_len, params)
            return blocks
        finally:
            self._num_waiting -= 1

    def _pool_full(self, why: str) -> EngineFull:
        kv = self.engine.stats().kv
        return EngineFull(f"decode KV pool is full ({kv.free_blocks} of {kv.num_blocks} blocks free) and {why}",
                          code="decode_kv_full")

    def _load(self, handle: dict, blocks: RequestBlocks, prompt_len: int) -> None:
        """Copy the entry from the store's view into `blocks` (one copy), then release the entry."""
        try:
            with self.kv_store.view(handle) as views:
                self.engine.load(blocks, views["kv"], prompt_len)
            self.kv_store.release(handle)
        except ConnectorError as exc:
            raise as_epd_error(exc, "kv") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"bad KV handle: {exc}", code="invalid_kv_handle") from None

    def abort(self, request_ids: list[str]) -> int:
        return sum(self.engine.abort(r) for r in request_ids)

    def _check_room(self) -> None:
        stats, engine = self.engine.stats(), self.engine
        if stats.active + stats.queued >= engine.num_slots + engine.max_queued:
            raise EngineFull(f"decode is full: {engine.num_slots} slots busy, {engine.max_queued} waiting")


class _LogprobTexts:
    """Gives a request's events their logprobs records with token texts; the first token's record (sampled by
    prefill) comes from kv_transfer_params["first_logprobs"] (vLLM's -9999.0 sentinel when prefill sent none)."""

    def __init__(self, tokenizer: Any, kv_params: dict, first_token: int) -> None:
        raw = kv_params.get("first_logprobs")
        self.first: TokenLogprob | None = (TokenLogprob.from_json(raw) if isinstance(raw, dict)
                                           else TokenLogprob(first_token, FLOOR, 0))
        whole = decode_function(tokenizer, False)
        self.decode: Callable[[int], str] = lambda token_id: whole([token_id])

    def complete(self, event: DecodeEvent) -> DecodeEvent:
        records = list(event.logprobs or [])
        if self.first is not None and event.token_ids:
            records.insert(0, self.first)
            self.first = None
        if not records:
            return event
        return dataclasses.replace(event, logprobs=[r.with_text(self.decode) for r in records])
