"""Prefill's core: token ids + mm_metadata + EC handles -> first token + KV in the KV store.

Prefill never receives pixels: each image's embedding is loaded from the EC
store by the handle encode returned, and its positions come from the light
metadata (image_grid_thw).  Prompts wait for the engine as futures, not
threads, so every prompt waiting joins the next batched forward.  The KV goes
from the engine's blocks to the KV store under the request id with
`put_into` (the store hands out its memory, the blocks are copied into it
once), on the engine thread as soon as the prompt's last forward ends; the
answer (kv_transfer_params) carries its handle and the per-request position
state (rope_delta) decode needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from services.connectors.base import ConnectorError, EntryMissing, TensorStore
from services.connectors.ec import ec_key, ec_key_version
from services.connectors.kv import kv_key
from services.connectors.mm import MmRef, open_item
from services.connectors.wiring import as_epd_error
from services.generation.params import DecodeParams, sample_params
from services.generation.params_from import decode_params
from services.models.base import LanguageModel, MultiModalInput
from services.observability import activity
from services.observability.owned_metrics import OwnedGauges
from services.protocol.errors import Conflict, InvalidRequest
from services.protocol.items import Item
from services.protocol.logprobs import TokenLogprob
from services.protocol.tensors import to_torch
from services.runtime.admission import Admission
from services.sampling.sampler import sample_first_logprobs

from .engine import PrefillEngine
from .inline_encode import InlineEncoder
from .jobs import HeldPrefill, release_when_done
from .prompt_logprobs import TokenTexts, answer

if TYPE_CHECKING:
    from services.weights.role import RoleWeights

PROMPT_TOKENS = Counter("epd_prefill_prompt_tokens", "Prompt tokens prefilled")
CACHED_TOKENS = Counter("epd_prefill_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
EC_BY_HASH = Counter("epd_prefill_ec_lookups", "Items that came without an EC handle, looked up in the EC store by "
                     "mm_hash (as vLLM's EC consumers find them), by result", ["result"])
MM_BYTES = Counter("epd_prefill_mm_bytes_received", "Multimodal bytes (kwargs_data + mm_metadata) received")
GAUGES = {
    "epd_kv_store_bytes": ("Bytes held by this instance's KV store", lambda s: s.kv_store.stats().bytes_used),
    "epd_kv_store_entries": ("Entries held by this instance's KV store", lambda s: s.kv_store.stats().entries),
    "epd_kv_store_bytes_copied_total": ("Payload bytes the KV store copied (put_into's fill; views none)",
                                        lambda s: s.kv_store.stats().bytes_copied),
    "epd_ec_store_bytes_copied_total": ("Payload bytes the EC store reader copied (gets; views none)",
                                        lambda s: s.ec_store.stats().bytes_copied),
    "epd_prefill_forwards": ("Prefill forward passes so far (each runs one or more prompts or chunks)",
                             lambda s: s.engine.num_forwards),
    "epd_prefill_lm_head_screened_rows_total": ("Greedy first tokens the LM head screen (int8 or bfloat16) decided "
                                                "exactly (services/models/head_screen.py)",
                                                lambda s: s.engine.screen.rows_screened if s.engine.screen else 0),
    "epd_prefill_prefix_cache_blocks": ("KV blocks the prefix cache keeps for later prompts",
                                        lambda s: s.engine.blocks.num_cached),
}


@dataclass
class PrefillItem:
    modality: str
    mm_hash: str
    offset: int
    length: int
    metadata: Item
    kwargs: Item | None = None  # only when no encoder could take the item (inline_encode.py)
    kwargs_ref: MmRef | None = None  # kwargs is the skeleton; its tensors are in the mm store


@dataclass
class PrefillOutcome:
    first_token_id: int
    kv_transfer_params: dict[str, Any]
    prompt_tokens: int
    cached_tokens: int
    first_logprobs: TokenLogprob | None = None  # when sampling asked for logprobs
    first_token_ids: list[int] | None = None    # one per sample (sampling n); [0] is first_token_id
    sample_logprobs: list[TokenLogprob | None] | None = None   # each sample's first token's, when asked
    weight_version: str = ""                    # the weights that made the KV and the first tokens
    prompt_logprobs: list[Any] | None = None    # with sampling prompt_logprobs: vLLM's per-prompt-token records

    @property
    def firsts(self) -> list[int]:
        return self.first_token_ids or [self.first_token_id]


@dataclass(frozen=True)
class PrefillModel:
    """What one weight version prefills with; a request takes the served one whole (services/weights/role.py)."""

    engine: PrefillEngine
    lm: LanguageModel
    inline: InlineEncoder | None = None
    version: str = ""


class PrefillService:
    def __init__(self, engine: PrefillEngine, lm: LanguageModel, ec_store: TensorStore, kv_store: TensorStore,
                 instance_id: str, max_queue: int = 32, inline: InlineEncoder | None = None,
                 mm_store: TensorStore | None = None, tokenizer_path: Path | None = None,
                 logprobs_mode: str = "raw_logprobs", model_id: str = "") -> None:
        self.model = PrefillModel(engine, lm, inline)
        self.logprobs_mode = logprobs_mode   # of the first tokens' logprobs (prompt logprobs are raw: vLLM's)
        self.texts = TokenTexts(tokenizer_path)   # prompt logprobs' decoded tokens, loaded on first use
        self.instance_id = instance_id
        self.model_id = model_id  # scopes the lookup of an item by mm_hash as encode keys its entries (ec_key)
        self.ec_store, self.kv_store, self.mm_store = ec_store, kv_store, mm_store
        self.weights: RoleWeights | None = None   # set by the app: the served version and its switch
        self._puts: set[asyncio.Future] = set()   # remote KV puts running in threads
        self.admission = Admission("prefill", max_queue)
        # Read at scrape time, so entries that decode released or that expired show at once.
        self.gauges = OwnedGauges(self, GAUGES)

    @property
    def engine(self) -> PrefillEngine:
        return self.model.engine

    @property
    def lm(self) -> LanguageModel:
        return self.model.lm

    def served(self, requested: str = "") -> PrefillModel:
        """The model a request naming weight version `requested` ("" names any) runs on, whole; Conflict when
        another version is served."""
        version = self.weights.check(requested) if self.weights is not None else ""
        return dataclasses.replace(self.model, version=version)

    async def prefill(self, request_id: str, token_ids: list[int], items: list[PrefillItem],
                      ec_params: dict[str, Any], sampling: dict[str, Any], cache_salt: str | None,
                      weight_version: str = "") -> PrefillOutcome:
        """Refused at once (Overloaded) while `max_queue` prefills are already running or waiting.  With
        sampling n > 1 the prompt runs once and each sample gets a first token of its own (seed + index).
        It runs on the weights of `weight_version` (the served one, which it must name or leave "")."""
        model = self.served(weight_version)
        params = decode_params(sampling)
        samples = sampling.get("n") or 1
        if not isinstance(samples, int) or samples < 1:
            raise InvalidRequest(f"sampling_params.n must be a positive integer, got {samples!r}", code="invalid_n")
        self._check_ids(model, token_ids)
        prompt_logprobs = sampling.get("prompt_logprobs")
        with self.admission.admit():
            return await self._prefill(model, request_id, token_ids, items, ec_params, params, cache_salt, samples,
                                       prompt_logprobs)

    async def _prefill(self, model: PrefillModel, request_id: str, token_ids: list[int], items: list[PrefillItem],
                       ec_params: dict[str, Any], params: DecodeParams, cache_salt: str | None,
                       samples: int = 1, prompt_logprobs: int | None = None) -> PrefillOutcome:
        key = kv_key(request_id, model.version)
        draws = [sample_params(params, i) for i in range(samples)] if not params.plain_greedy else []
        held = await self._forward(model, token_ids, items, ec_params, cache_salt, key, params.plain_greedy,
                                   prompt_logprobs, draws if model.engine.can_draw(draws) else [])
        if not self.kv_store.local:
            await self._put_remote(key, held)
        if held.kv_error is not None:
            raise as_epd_error(held.kv_error, "kv") from None
        handle = held.kv_handle
        assert handle is not None
        try:
            firsts, records = self._first_tokens(model, held, params, token_ids, samples)
        except BaseException:
            self._delete_quietly(key)  # nobody will read it
            raise
        PROMPT_TOKENS.inc(held.num_prompt_tokens)
        CACHED_TOKENS.inc(held.num_cached_tokens)
        params_out = {"do_remote_prefill": True, "remote_engine_id": self.instance_id, "handle": handle,
                      "rope_delta": held.rope_delta, "num_prompt_tokens": held.num_prompt_tokens,
                      "first_token_id": firsts[0]}
        if model.version:
            params_out["weight_version"] = model.version   # decode must run the weights that made the KV
        if samples > 1:
            params_out["first_token_ids"] = firsts
        if records[0] is not None:  # decode answers the first tokens' logprobs too
            params_out["first_logprobs"] = (records[0].to_json() if samples == 1
                                            else [r.to_json() for r in records if r is not None])
        prompt = None if held.prompt_records is None else await asyncio.to_thread(answer, held.prompt_records,
                                                                                   self.texts)
        return PrefillOutcome(firsts[0], params_out, held.num_prompt_tokens, held.num_cached_tokens, records[0],
                              firsts, records, model.version, prompt)

    def _first_tokens(self, model: PrefillModel, held: HeldPrefill, params: DecodeParams, token_ids: list[int],
                      samples: int) -> tuple[list[int], list[TokenLogprob | None]]:
        """Each sample's first token (sample i draws with seed + i, services/decode/samples.py) and its logprobs
        when asked; a plain greedy prompt's token is the engine's pick, the same for every sample."""
        if held.first_tokens is not None:   # the greedy pick (params.plain_greedy), or each sample's draw
            tokens = held.first_tokens if len(held.first_tokens) == samples else held.first_tokens * samples
            return tokens, [None] * samples
        mode = self.logprobs_mode
        assert held.first_logits is not None   # kept whenever no token was picked
        picked = [sample_first_logprobs(held.first_logits, sample_params(params, i), 0, model.lm.eos_token_ids,
                                        token_ids, logprobs_mode=mode) for i in range(samples)]
        return [token for token, _ in picked], [record for _, record in picked]

    async def _forward(self, model: PrefillModel, token_ids: list[int], items: list[PrefillItem],
                       ec_params: dict[str, Any], cache_salt: str | None, key: str,
                       greedy: bool = False, prompt_logprobs: int | None = None,
                       draws: list[DecodeParams] | None = None) -> HeldPrefill:
        """The prompt through the engine with each embedding read as a zero-copy view of the EC store, kept
        open until the forward is done: the scatter into the prompt's embeddings is the one copy.  An entry
        evicted meanwhile fails the prompt (ec_entry_missing) rather than use bytes that changed under it.
        The views are opened on the loop when the EC store is local and nothing is encoded here (opening
        one copies nothing); a Redis store's reads and an inline encode run in a thread."""
        views = contextlib.ExitStack()
        held: HeldPrefill | None = None
        try:
            with views:
                activity.mark("prefill.ec_views.start")
                if self.ec_store.local and all(isinstance(ec_params.get(i.mm_hash), dict) for i in items):
                    mm_inputs = self._load_embeddings(model, items, ec_params, views)
                else:
                    mm_inputs = await asyncio.to_thread(self._load_embeddings, model, items, ec_params, views)
                activity.mark("prefill.ec_views.end")
                held = await self._run_engine(model, token_ids, mm_inputs, cache_salt, key, greedy, prompt_logprobs,
                                              draws or [])
        except ConnectorError as exc:
            if held is not None:
                held.release()
            raise as_epd_error(exc, "ec") from None
        return held

    async def _run_engine(self, model: PrefillModel, token_ids: list[int], mm_inputs: list[MultiModalInput],
                          cache_salt: str | None, key: str, greedy: bool = False,
                          prompt_logprobs: int | None = None, draws: list[DecodeParams] | None = None) -> HeldPrefill:
        """Wait for the engine without holding a thread (so every waiting prompt can join a batch).  With a
        local store the engine thread puts the KV into it as soon as the prompt's last forward ends
        (`_put_kv`: a memcpy), so the result comes back with its blocks already released.  A caller that gives
        up leaves the blocks to be released, and the entry nobody will read to be deleted, when the prompt
        finishes."""
        on_finish = (lambda held: self._put_kv(key, held)) if self.kv_store.local else None
        # An idle engine runs a small prompt right here (the future comes back done: no thread hand-off)
        future = model.engine.submit(token_ids, mm_inputs, cache_salt, on_finish=on_finish, greedy=greedy,
                                     inline=True, prompt_logprobs=prompt_logprobs, logprobs_mode=self.logprobs_mode,
                                     draws=draws or (), hands_off=True)   # every answer goes on to a decode
        if future.done():
            activity.mark("prefill.engine_done")
            return future.result()
        try:
            held = await asyncio.wrap_future(future)
            activity.mark("prefill.engine_done")
            return held
        except asyncio.CancelledError:
            release_when_done(future)
            future.add_done_callback(lambda done: self._drop_unread(done, key))
            raise

    async def _put_remote(self, key: str, held: HeldPrefill) -> None:
        """A store that does I/O (Redis): the put runs in a thread, so the engine's next forward never waits on
        the network.  If the caller gives up meanwhile, the entry nobody will read is deleted once written."""
        put = asyncio.ensure_future(asyncio.to_thread(self._put_kv, key, held))
        self._puts.add(put)   # held until done: a task nobody references can be collected mid-way
        put.add_done_callback(self._puts.discard)
        try:
            await asyncio.shield(put)
        except asyncio.CancelledError:
            def drop(_: asyncio.Future) -> None:
                if held.kv_handle is not None:
                    self._delete_quietly(key)

            put.add_done_callback(drop)
            raise

    def _put_kv(self, key: str, held: HeldPrefill) -> None:
        """On the engine thread (a local store) or a worker thread (`_put_remote`): the KV into the store (one
        copy from the blocks), then the blocks go back.  A store error is kept on `held` for the caller to
        raise as a kv_* error."""
        try:
            activity.mark("prefill.kv_put.start")
            held.kv_handle = self.kv_store.put_into(key, held.kv_spec(), held.fill)
            activity.mark("prefill.kv_put.end")
        except ConnectorError as exc:
            held.kv_error = exc
        finally:
            held.release()

    def _drop_unread(self, done: Future, key: str) -> None:
        if done.cancelled() or done.exception() is not None or done.result().kv_handle is None:
            return
        self._delete_quietly(key)

    def _delete_quietly(self, key: str) -> None:
        with contextlib.suppress(ConnectorError):   # the TTL removes it
            self.kv_store.delete(key)

    @staticmethod
    def _check_ids(model: PrefillModel, token_ids: list[int]) -> None:
        # An id past the embedding table would fail inside the forward as an internal error.
        bad = next((t for t in token_ids if not 0 <= t < model.lm.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is out of range [0, {model.lm.vocab_size})",
                                 code="invalid_token_id")

    def _load_embeddings(self, model: PrefillModel, items: list[PrefillItem], ec_params: dict[str, Any],
                         views: contextlib.ExitStack) -> list[MultiModalInput]:
        inputs = []
        for item in items:
            extras = self._entry(model, item, ec_params, views)
            embedding = extras.pop("embedding")  # the rest (e.g. Qwen3-VL deepstack) goes to the adapter
            inputs.append(MultiModalInput(item.modality, item.offset, item.length, _metadata(item), embedding,
                                          mm_hash=item.mm_hash, extras=extras))
        return inputs

    def _inline(self, model: PrefillModel, kwargs: Item, ref: MmRef | None) -> dict[str, Any]:
        """Encoded here; an item by handle is read from the mm store (the same handle encode would read)."""
        assert model.inline is not None
        if ref is None:
            return model.inline.entry(kwargs)
        if self.mm_store is None:
            raise InvalidRequest("this prefill reads no mm store: send kwargs_data inline", code="no_mm_store")
        try:
            with open_item(self.mm_store, kwargs, ref) as full:
                return model.inline.entry(full)
        except ConnectorError as exc:
            raise as_epd_error(exc, "mm") from None

    def _entry(self, model: PrefillModel, item: PrefillItem, ec_params: dict[str, Any],
               views: contextlib.ExitStack) -> dict[str, Any]:
        """The item's EC entry: a view of the EC store by handle (open until `views` closes); without a handle,
        the entry encode stored under the item's mm_hash by these weights; encoded here only when it is in
        neither."""
        handle = ec_params.get(item.mm_hash)
        if not isinstance(handle, dict):
            handle = self._by_hash(item.mm_hash, model.version)
        if not isinstance(handle, dict) and item.kwargs is not None and model.inline is not None:
            return self._inline(model, item.kwargs, item.kwargs_ref)
        if not isinstance(handle, dict):
            raise as_epd_error(EntryMissing(f"ec_transfer_params has no handle for mm_hash {item.mm_hash} and the "
                                            "EC store has no entry under it: encode it first"), "ec")
        made = ec_key_version(str(handle.get("key", "")))
        if made and model.version and made != model.version:   # an embedding of other weights: never mixed in
            raise Conflict(f"the embedding of {item.mm_hash} was made by weight version {made!r}, this prefill "
                           f"serves {model.version!r}", code="weight_version_mismatch")
        try:
            extras = dict(views.enter_context(self.ec_store.view(handle)))
            if "embedding" not in extras:
                raise KeyError("embedding")
            return extras
        except ConnectorError as exc:
            raise as_epd_error(exc, "ec") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"bad EC handle for {item.mm_hash}: {exc}", code="invalid_ec_handle") from None

    def _by_hash(self, mm_hash: str, version: str = "") -> dict[str, Any] | None:
        """The handle of the entry encode stored for `mm_hash` under this model and weight version (a Redis
        store: any encoder's; a shm consumer sees none), or None."""
        if not self.model_id:
            return None
        try:
            handle = self.ec_store.lookup(ec_key(self.model_id, mm_hash, version))
        except ConnectorError as exc:
            raise as_epd_error(exc, "ec") from None
        EC_BY_HASH.labels("found" if handle is not None else "absent").inc()
        return handle


def _metadata(item: PrefillItem) -> dict[str, Any]:
    """The item's mm_metadata as tensors (image_grid_thw: what its positions come from)."""
    return {k: to_torch(e.data) for k, e in item.metadata.items() if e.data is not None}
