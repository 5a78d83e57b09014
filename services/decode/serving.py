"""Decode's core: kv_transfer_params + first token -> a stream of DecodeEvents.

The KV entry is loaded from the KV store by handle (one copy into this
process), released so its producer can free it, and handed to the
continuous-batching engine.  Leaving the stream early (client gone, call
cancelled) aborts the request, which frees its slot before the next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import Counter

from services.connectors.base import ConnectorError, TensorStore
from services.connectors.wiring import as_epd_error
from services.owned_metrics import OwnedGauges
from services.protocol.errors import InvalidRequest

from .engine import DecodeEngine
from .errors import EngineFull
from .params_from import decode_params
from .stream import DecodeEvent

FINISHED = Counter("epd_decode_requests_finished", "Decode requests by finish reason", ["reason"])
TOKENS = Counter("epd_decode_tokens", "Output tokens produced")
GAUGES = {
    "epd_decode_slots_used": ("Decode slots in use", lambda s: s.engine.stats().active),
    "epd_decode_queued": ("Requests waiting for a decode slot", lambda s: s.engine.stats().queued),
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


class DecodeService:
    def __init__(self, engine: DecodeEngine, kv_store: TensorStore) -> None:
        self.engine, self.kv_store = engine, kv_store
        # Read at scrape time: an aborted request's slot shows free as soon as the engine let it go.
        self.gauges = OwnedGauges(self, GAUGES)

    async def decode(self, request_id: str, kv_params: Any, sampling: dict[str, Any],
                     prompt_token_ids: list[int] | None = None) -> AsyncIterator[DecodeEvent]:
        params = decode_params(sampling)
        handle, prompt_len, rope_delta, first_token = _transfer_fields(kv_params)
        self._check_room()  # before the KV is loaded (and released): a full instance leaves it for another
        kv = await asyncio.to_thread(self._load, handle)
        stream = self.engine.submit(request_id, kv, prompt_len, rope_delta, first_token, params,
                                    prompt_token_ids=prompt_token_ids or None)
        finished = False
        try:
            async for event in stream.events():
                TOKENS.inc(len(event.token_ids))
                if event.finished:
                    finished = True
                    FINISHED.labels(event.finish_reason or "unknown").inc()
                yield event
        finally:
            if not finished:
                self.engine.abort(request_id)
                FINISHED.labels("abort").inc()

    def _load(self, handle: dict) -> Any:
        try:
            kv = self.kv_store.get(handle)["kv"]
            self.kv_store.release(handle)
            return kv
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
