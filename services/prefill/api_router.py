"""Prefill's HTTP routes (PROTOCOL.md): POST /inference/v1/generate, /v1/chat/completions, /v1/completions,
/abort_requests.

POST /v1/chat/completions and /v1/completions take llm-d's (and vLLM's E/P/D proxy's) OpenAI-format prefill calls
(services.edge.openai_calls).

Generate on prefill means: token ids + each item's mm_metadata + the
ec_transfer_params encode answered -> the first token (choices[0].token_ids)
and the kv_transfer_params decode must carry.  Same PrefillService as gRPC.

An item without an EC handle is found as vLLM's EC consumers find it: by its
mm_hash in the EC store, where any encoder put it (vLLM's E/P/D proxy and
llm-d's generate path send no handles).  Only when it is not there are its
kwargs_data encoded here (--prefill-inline-encode); with that off, or without
kwargs_data, the answer is 400 no_vision_encoder / 404 ec_entry_missing.  An
item with a handle ignores its pixels (mm_metadata wins; if it is absent the
light keys are taken from kwargs_data).  The answer is never streamed: stream
chunks carry no kv_transfer_params.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.edge.http_api import (
    check_model,
    check_tokens_mode,
    endpoint,
    header_request_id,
    model_response,
    parse_body,
)
from services.edge.openai_calls import RenderClient, openai_call
from services.generation.params_from import decode_params
from services.generation.stop import StopChecker
from services.protocol.common import Usage
from services.protocol.errors import InvalidRequest
from services.protocol.features import FeatureItem
from services.protocol.generate import (
    AbortRequest,
    FinishReason,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    response_id,
)
from services.protocol.items import Item, metadata_only
from services.protocol.logprobs import generate_logprobs
from services.protocol.serialization import item_from_b64

from .serving import MM_BYTES, PrefillItem, PrefillOutcome, PrefillService

NO_VISION_ENCODER = "this prefill instance has no vision encoder; send kwargs_data to encode"


def _decode(b64: str, where: str) -> Item:
    MM_BYTES.inc(len(b64) * 3 // 4)
    try:
        return item_from_b64(b64)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc.message}", code=exc.code) from None


def prefill_item(item: FeatureItem, ec_params: dict[str, Any], metadata_keys: Sequence[str],
                 encodes: bool = False) -> PrefillItem:
    """The item as PrefillService takes it.  Without a handle its pixels are kept for an inline encode when this
    instance `encodes` (used only if the EC store has no entry under its mm_hash); refused when it does not."""
    where = f"features.{{}}.{item.modality}[{item.index}]"
    kwargs = None
    if item.mm_hash not in ec_params and item.kwargs_b64 is not None:
        kwargs = _decode(item.kwargs_b64, where.format("kwargs_data"))
    if item.metadata_b64 is not None:
        metadata = _decode(item.metadata_b64, where.format("mm_metadata"))
    elif item.kwargs_b64 is not None:
        metadata = metadata_only(kwargs or _decode(item.kwargs_b64, where.format("kwargs_data")), metadata_keys)
    else:
        raise InvalidRequest(f"{where.format('mm_metadata')}: prefill needs mm_metadata (or kwargs_data) "
                             "for every item", code="missing_mm_metadata")
    place = item.placeholder
    return PrefillItem(item.modality, item.mm_hash, place.offset, place.length, metadata,
                       kwargs if encodes else None)


def check_prompt(token_ids: Sequence[int], max_model_len: int) -> None:
    if len(token_ids) >= max_model_len:
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, the "
                             f"prompt has {len(token_ids)} tokens, leaving none for the completion.",
                             code="context_length_exceeded")


def first_token_finish(first: int, sampling: dict[str, Any],
                       eos_ids: Sequence[int]) -> tuple[FinishReason, int | None]:
    """finish_reason of the one token prefill makes: "stop" on EOS or a stop id, else "length"."""
    finish, reason = StopChecker(decode_params(sampling), eos_ids, max_tokens=1).check_token(first, 1)
    return ("stop" if finish == "stop" else "length"), reason


def _payload(body: dict[str, Any]) -> str:
    """With EC handles prefill needs no pixels from render (mm_metadata only); without (vLLM's E/P/D proxy), render's
    full answer: each image is looked up by mm_hash and its pixels are encoded here only if it is not stored."""
    return "metadata" if isinstance(body.get("ec_transfer_params"), dict) and body["ec_transfer_params"] \
        else "tensors"


def first_logprobs(outcome: PrefillOutcome, index: int = 0) -> dict[str, Any] | None:
    """vLLM's GenerateLogProbs of the one token prefill samples (ids only: prefill decodes no text)."""
    record = (outcome.sample_logprobs or [outcome.first_logprobs])[index]
    return None if record is None else generate_logprobs([record])


def first_choices(outcome: PrefillOutcome, sampling: dict[str, Any], eos_ids: Sequence[int]) -> list[GenerateChoice]:
    """One choice per sample (sampling_params.n), each with the one token prefill sampled for it."""
    choices = []
    for index, token in enumerate(outcome.firsts):
        finish, stop_reason = first_token_finish(token, sampling, eos_ids)
        choices.append(GenerateChoice(index=index, token_ids=[token], finish_reason=finish, stop_reason=stop_reason,
                                      logprobs=first_logprobs(outcome, index)))
    return choices


class PrefillApi:
    def __init__(self, service: PrefillService, model_id: str, metadata_keys: Sequence[str],
                 render: RenderClient) -> None:
        self.service, self.model_id, self.metadata_keys = service, model_id, tuple(metadata_keys)
        self.render = render

    @endpoint
    async def generate(self, request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        check_tokens_mode(body.output_mode, "prefill")
        answer, cached = await self._prefill(body, request)
        return model_response(answer, headers={"X-Cached-Tokens": str(cached)})

    @endpoint
    async def chat(self, request: Request) -> Response:
        """llm-d's OpenAI-format prefill call: the chat capped to one token + transfer params."""
        call = await openai_call(request, self.render, _payload)
        answer, cached = await self._prefill(call.generate, request)
        return model_response(call.answer(answer), headers={"X-Cached-Tokens": str(cached)})

    @endpoint
    async def completion(self, request: Request) -> Response:
        """llm-d's completions-path prefill call: the prompt's token ids capped to one token + transfer params."""
        call = await openai_call(request, self.render, kind="completion")
        answer, cached = await self._prefill(call.generate, request)
        return model_response(call.answer(answer), headers={"X-Cached-Tokens": str(cached)})

    async def _prefill(self, body: GenerateRequest, request: Request) -> tuple[GenerateResponse, int]:
        check_model(body.model, self.model_id)
        self._check_shape(body)
        ec_params = body.ec_transfer_params or {}
        encodes = self.service.model.inline is not None
        items = [prefill_item(item, ec_params, self.metadata_keys, encodes) for item in body.items()]
        lm = self.service.lm
        check_prompt(body.token_ids, lm.layout.max_model_len)
        rid = header_request_id(request) or body.request_id
        sampling = body.sampling_params.model_dump(exclude={"extra_args"})
        outcome = await self.service.prefill(rid, list(body.token_ids), items, ec_params, sampling,
                                             body.cache_salt)
        answer = GenerateResponse(
            request_id=response_id(body.request_id, header_request_id(request)),
            model=body.model or self.model_id,
            choices=first_choices(outcome, sampling, lm.eos_token_ids),
            usage=Usage(prompt_tokens=outcome.prompt_tokens, completion_tokens=len(outcome.firsts)),
            kv_transfer_params=outcome.kv_transfer_params)
        return answer, outcome.cached_tokens

    @staticmethod
    def _check_shape(body: GenerateRequest) -> None:
        if body.stream:
            raise InvalidRequest("prefill answers are never streamed (stream chunks carry no "
                                 "kv_transfer_params): send stream=false", code="stream_not_supported")
        if body.content_parts:
            raise InvalidRequest(f"{NO_VISION_ENCODER}; content_parts go to render or the coordinator",
                                 code="no_vision_encoder")

    @endpoint
    async def abort(self, request: Request) -> Response:
        await parse_body(request, AbortRequest)
        return JSONResponse({"aborted": 0})  # a prefill is one forward pass; nothing runs long enough to stop


def routes(service: PrefillService, model_id: str, metadata_keys: Sequence[str],
           render: RenderClient | None = None) -> list[Route]:
    api = PrefillApi(service, model_id, metadata_keys, render or RenderClient([]))
    return [Route("/inference/v1/generate", api.generate, methods=["POST"]),
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completion, methods=["POST"]),
            Route("/abort_requests", api.abort, methods=["POST"])]
