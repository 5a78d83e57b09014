"""Decode's core: kv_transfer_params + first token -> a stream of DecodeEvents.

Admission: the engine reserves the request's blocks in its KV pool first (waiting up to
`kv_wait_s` for room, at most `max_waiting` requests at a time, else EngineFull -> 429, with
the KV entry left in the store for another instance); then the entry is opened through the
store's view (zero-copy for shm; Redis falls back to a get) and checked, the first token (which
prefill sampled) is emitted at once, and the entry is copied once, straight into the blocks,
beside it, then released so its producer can free it; only then does the request take a row.
Leaving the stream early (client gone, call cancelled) aborts the request, which frees its row
and blocks before the next step (or, while its KV is still being copied, right after the copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from services.connectors.base import ConnectorError, TensorStore
from services.connectors.wiring import as_epd_error, runs_inline
from services.generation.detokenizer import decode_function
from services.generation.params import DecodeParams
from services.generation.params_from import decode_params
from services.hostcpu import compute_lease
from services.hostcpu.compute_threads import helper_executor
from services.observability import activity
from services.observability.owned_metrics import OwnedGauges
from services.protocol.errors import Conflict, InvalidRequest
from services.protocol.logprobs import FLOOR, TokenLogprob

from .engine import DecodeEngine
from .errors import EngineFull
from .metrics import ENGINE_GAUGES, export_info
from .request import DecodeRequest
from .request_blocks import RequestBlocks
from .samples import SampleGroup

if TYPE_CHECKING:
    from services.weights.role import RoleWeights
from .stream import DecodeEvent

log = logging.getLogger(__name__)
_POLL_S = 0.005   # how often a request waiting for KV room looks again

FINISHED = Counter("epd_decode_requests_finished", "Decode requests by finish reason", ["reason"])
TOKENS = Counter("epd_decode_tokens", "Output tokens produced")
def _engine_gauge(read: Callable[[Any], float]) -> Callable[[Any], float]:
    return lambda service: read(service.engine.stats())


GAUGES: dict[str, tuple[str, Callable[[Any], float]]] = {
    **{name: (doc, _engine_gauge(read)) for name, (doc, read) in ENGINE_GAUGES.items()},
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


def first_tokens(kv_params: dict, samples: int, first_token: int) -> list[int]:
    """The first token of each of the request's samples: prefill sampled one per sample (first_token_ids)."""
    if samples == 1:
        return [first_token]
    firsts = kv_params.get("first_token_ids")
    if not isinstance(firsts, list) or len(firsts) != samples or not all(type(t) is int for t in firsts):
        raise InvalidRequest(f"sampling_params.n is {samples}, but kv_transfer_params.first_token_ids does not hold "
                             f"{samples} token ids: prefill the prompt with the same n",
                             code="invalid_kv_transfer_params")
    return firsts


def _check_kv_version(kv_params: Any, version: str) -> None:
    """A KV entry is of the weights that made it: decode must run the same (kv_transfer_params.weight_version)."""
    made = kv_params.get("weight_version") if isinstance(kv_params, dict) else None
    if made is not None and version and made != version:
        raise Conflict(f"the KV entry was made by weight version {made!r}, this decode serves {version!r}",
                       code="weight_version_mismatch")


def _entry_bytes(handle: dict) -> int:
    """The payload size a handle names (an shm handle carries "length"); unknown counts as large."""
    length = handle.get("length")
    return length if isinstance(length, int) and length >= 0 else 1 << 62


class DecodeService:
    def __init__(self, engine: DecodeEngine, kv_store: TensorStore, kv_wait_s: float = 10.0,
                 max_waiting: int | None = None) -> None:
        self.engine, self.kv_store = engine, kv_store
        self.kv_wait_s = kv_wait_s
        self.max_waiting = engine.max_queued if max_waiting is None else max_waiting
        self._num_waiting = 0
        self._loading: set[asyncio.Future] = set()  # KV copies running beside their first tokens
        self._copies = helper_executor(2)  # large KV copies (threads that run torch on one thread)
        self.weights: RoleWeights | None = None   # set by the app: the served version and its switch
        self.retiring: list[DecodeEngine] = []   # engines of replaced weights, finishing their requests
        # Read at scrape time: an aborted request's row and blocks show free as soon as the engine let them go.
        self.gauges = OwnedGauges(self, GAUGES)
        export_info(engine.stats(), engine.step_report)

    @property
    def num_waiting_for_kv(self) -> int:
        """Requests waiting for room in the KV pool (not yet queued in the engine)."""
        return self._num_waiting

    def serving_version(self, requested: str = "") -> str:
        """The weight version a request naming `requested` runs on ("" names any); Conflict when another."""
        return self.weights.check(requested) if self.weights is not None else ""

    async def decode(self, request_id: str, kv_params: Any, sampling: dict[str, Any],
                     prompt_token_ids: list[int] | None = None,
                     resumed: list[int] | None = None, weight_version: str = "") -> AsyncIterator[DecodeEvent]:
        """`_decode`'s events; once the first is written, or the call ended without one, decode's turn is over:
        the prompt forwards waiting for it may start (services/hostcpu/compute_lease.py)."""
        sent = False
        try:   # closed with this generator: its own cleanup (the engine's abort) runs now, not when collected
            async with contextlib.aclosing(self._decode(request_id, kv_params, sampling, prompt_token_ids, resumed,
                                                        weight_version)) as events:
                async for event in events:
                    yield event
                    if not sent:
                        sent = True
                        compute_lease.sent_first_token()
        finally:
            if not sent:
                compute_lease.sent_first_token()

    async def _decode(self, request_id: str, kv_params: Any, sampling: dict[str, Any],
                      prompt_token_ids: list[int] | None = None,
                      resumed: list[int] | None = None, weight_version: str = "") -> AsyncGenerator[DecodeEvent, None]:
        """The request's events, the first token's first.  `resumed`: the output tokens the client already has
        (its decode instance died): the KV holds the prompt and all but the last of them, which is the first
        token; they are judged again without being sent, and the stream starts with the next token.  The request
        runs on the engine of `weight_version` (the one served now, which it must name or leave ""), whole, even
        if the weights change meanwhile (services/weights/role.py); the KV must be of that version too."""
        version = self.serving_version(weight_version)
        engine = self.engine   # taken with the version check, in the same turn of the loop as a switch would be
        _check_kv_version(kv_params, version)
        params = decode_params(sampling)
        samples = self._samples(engine, sampling, bool(resumed))
        handle, prompt_len, rope_delta, first_token = _transfer_fields(kv_params)
        firsts = first_tokens(kv_params, samples, first_token)
        if resumed:
            first_token = resumed[-1]
        budget_len = prompt_len - max(0, len(resumed or ()) - 1)   # the original prompt: the token budget's base
        if budget_len < 1:
            raise InvalidRequest(f"{len(resumed or ())} resumed tokens for a KV of {prompt_len}",
                                 code="invalid_kv_transfer_params")
        self._check_room(engine, samples)  # before the KV is loaded (and released): a full one leaves it for another
        blocks = await self._reserve(engine, budget_len, params, samples)
        views = contextlib.ExitStack()
        try:
            # The entry is opened and checked before anything is emitted: a missing or malformed one is a typed
            # error the coordinator can act on (kv_entry_missing: prefill again), not a stream that breaks.
            activity.mark("decode.kv_open.start")
            kv = await self._open_entry(engine, handle, prompt_len, views)
            activity.mark("decode.kv_open.end")
            if samples == 1:
                request: DecodeRequest | SampleGroup = engine.open(
                    request_id, blocks, prompt_len, rope_delta, first_token, params,
                    prompt_token_ids=prompt_token_ids or None, resumed=resumed or ())
            else:
                request = engine.open_samples(request_id, blocks, prompt_len, rope_delta, firsts, params,
                                              prompt_token_ids or None)
        except BaseException:
            with contextlib.suppress(ConnectorError):
                views.close()
            blocks.release()
            raise
        # The first token (prefill's) is on the stream already; the copy into the blocks runs beside it.
        loading = asyncio.ensure_future(self._load_then_start(engine, request, handle, kv, views))
        self._loading.add(loading)
        loading.add_done_callback(self._loading.discard)
        texts = _LogprobTexts(engine.tokenizer, kv_params, firsts, bool(resumed)) \
            if params.logprobs is not None else None
        left = samples   # samples whose final event has not been read yet
        try:
            async for event in request.stream.events():
                if texts is not None:
                    event = texts.complete(event)
                TOKENS.inc(len(event.token_ids))
                if event.finished:
                    left -= 1
                    FINISHED.labels(event.finish_reason or "unknown").inc()
                yield event
        finally:
            if left:
                engine.abort(request_id)  # one still loading ends when its copy is done (engine.start)
                FINISHED.labels("abort").inc()

    async def _open_entry(self, engine: DecodeEngine, handle: dict, prompt_len: int,
                          views: contextlib.ExitStack) -> Any:
        """The KV entry's tensor, open in `views` and checked against the prompt: a zero-copy view of a local
        store's memory, opened on the loop (it copies nothing); a remote store's read runs in a thread."""
        def open_checked() -> Any:
            kv = views.enter_context(self.kv_store.view(handle))["kv"]
            engine.check_prefill(kv, prompt_len)
            return kv

        try:
            if not self.kv_store.local:
                return await asyncio.to_thread(open_checked)
            return open_checked()
        except ConnectorError as exc:
            raise as_epd_error(exc, "kv") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"bad KV handle: {exc}", code="invalid_kv_handle") from None

    @staticmethod
    def _samples(engine: DecodeEngine, sampling: dict[str, Any], resumed: bool) -> int:
        """sampling_params.n, checked against what this instance can ever hold at once."""
        samples = sampling.get("n") or 1
        capacity = engine.num_slots + engine.max_queued
        if not isinstance(samples, int) or not 1 <= samples <= capacity:
            raise InvalidRequest(f"sampling_params.n must be an integer in [1, {capacity}] on this decode instance "
                                 f"(--decode-slots + --decode-queue), got {samples!r}", code="invalid_n")
        if resumed and samples > 1:
            raise InvalidRequest("a resumed request carries one sample (n = 1): resume each sample on its own",
                                 code="invalid_n")
        return samples

    async def _load_then_start(self, engine: DecodeEngine, request: DecodeRequest | SampleGroup, handle: dict,
                               kv: Any, views: contextlib.ExitStack) -> None:
        """Copy the entry into the request's blocks (the one copy), close the view (an entry overwritten
        meanwhile fails the request, never a wrong KV), release the entry so its producer can free it, and
        queue the request for steps.  On the loop when the store is local and the entry small, else in a
        thread (a Redis release is a round trip).  Never raises: a failure ends the request with an error."""
        def copy_and_release() -> None:
            if not request.finished:  # its first token did not end it: the steps need the prompt's KV
                engine.load(request.blocks, kv, request.prompt_len)
            views.close()
            try:
                self.kv_store.release(handle)
            except ConnectorError as exc:  # the KV is in the blocks already; the entry expires with its TTL
                log.warning("releasing the KV entry of %s failed: %s", request.request_id, exc)

        try:
            if runs_inline(self.kv_store, _entry_bytes(handle)):
                copy_and_release()
            else:
                copy = self._copies.submit(copy_and_release)
                try:
                    await asyncio.wrap_future(copy)
                except asyncio.CancelledError:  # the loop is going away: end it once the copy lets go
                    copy.add_done_callback(lambda _: engine.fail(request, "decode is shutting down"))
                    raise
        except ConnectorError as exc:
            engine.fail(request, f"kv entry unusable: {exc}")
        except Exception as exc:  # noqa: BLE001 - reported on the request's stream
            log.exception("loading the KV of request %s failed", request.request_id)
            engine.fail(request, f"loading the KV failed: {type(exc).__name__}")
        else:
            engine.start(request)

    async def _reserve(self, engine: DecodeEngine, prompt_len: int, params: DecodeParams,
                       samples: int = 1) -> RequestBlocks:
        """The request's blocks; waits (bounded in time and in waiters) while the pool is full."""
        blocks = engine.reserve(prompt_len, params, samples)
        if blocks is not None:
            return blocks
        if self._num_waiting >= self.max_waiting:
            raise self._pool_full(engine, "its admission queue is full too")
        self._num_waiting += 1
        try:
            deadline = time.monotonic() + self.kv_wait_s
            while blocks is None:
                if time.monotonic() >= deadline:
                    raise self._pool_full(engine, f"no room within {self.kv_wait_s:g} s")
                await asyncio.sleep(_POLL_S)
                blocks = engine.reserve(prompt_len, params, samples)
            return blocks
        finally:
            self._num_waiting -= 1

    @staticmethod
    def _pool_full(engine: DecodeEngine, why: str) -> EngineFull:
        kv = engine.stats().kv
        return EngineFull(f"decode KV pool is full ({kv.free_blocks} of {kv.num_blocks} blocks free) and {why}",
                          code="decode_kv_full")

    def abort(self, request_ids: list[str]) -> int:
        engines = [self.engine, *self.retiring]   # a request may still run on weights being retired
        return sum(any(engine.abort(r) for engine in engines) for r in request_ids)

    @staticmethod
    def _check_room(engine: DecodeEngine, samples: int = 1) -> None:
        stats = engine.stats()
        if stats.active + stats.queued + samples > engine.num_slots + engine.max_queued:
            raise EngineFull(f"decode is full: {engine.num_slots} slots busy, {engine.max_queued} waiting")


class _LogprobTexts:
    """Gives a request's events their logprobs records with token texts; each sample's first token's record
    (sampled by prefill) comes from kv_transfer_params["first_logprobs"] (a list for n > 1; vLLM's -9999.0
    sentinel when prefill sent none)."""

    def __init__(self, tokenizer: Any, kv_params: dict, firsts: list[int], resumed: bool = False) -> None:
        raw = kv_params.get("first_logprobs")
        given = raw if isinstance(raw, list) else [raw]
        self.first: dict[int, TokenLogprob] = {} if resumed else {   # a resumed client has the first record
            index: TokenLogprob.from_json(body) if isinstance(body, dict) else TokenLogprob(token, FLOOR, 0)
            for index, (token, body) in enumerate(zip(firsts, [*given, *[None] * len(firsts)], strict=False))}
        whole = decode_function(tokenizer, False)
        self.decode: Callable[[int], str] = lambda token_id: whole([token_id])

    def complete(self, event: DecodeEvent) -> DecodeEvent:
        records = list(event.logprobs or [])
        if event.token_ids and event.index in self.first:
            records.insert(0, self.first.pop(event.index))
        if not records:
            return event
        return dataclasses.replace(event, logprobs=[r.with_text(self.decode) for r in records])
