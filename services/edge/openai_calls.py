"""llm-d's OpenAI-format calls on the roles: POST /v1/chat/completions on encode, prefill and decode, and
POST /v1/completions on prefill and decode (llm-d's completions path; vLLM's E/P/D proxy makes the chat calls).

llm-d's coordinator (`use_openai_format`, its default) calls each stage with a chat body, not a
GenerateRequest (docs/llm-d.md lists the exact bodies):

- encode: one call per image, `{"model", "messages": [{"role": "user", "content": [<the image part>]}],
  "max_tokens": 1, "max_completion_tokens": 1, "stream": false}`; it reads `ec_transfer_params`;
- prefill: the client's chat body capped to one token, plus `tokens` ({token_ids, features: {mm_hashes,
  mm_placeholders}} from its render call), `kv_transfer_params` and the merged `ec_transfer_params`
  {mm_hash: handle}; it reads `kv_transfer_params`;
- decode: the client's chat body, each image part with `uuid` = its mm_hash, and the prefill's
  `kv_transfer_params` (plus do_remote_decode false, do_remote_prefill true); its answer goes to the
  client unchanged;
- completions: prefill gets `{"model", "prompt": <render's token ids>, "max_tokens": 1, ..., "request_id",
  "kv_transfer_params"}` (plus `features` and `ec_transfer_params` with images), decode the client's completion
  body with `prompt` = those ids and the prefill's `kv_transfer_params`.

A role holds no tokenizer, chat template or image processor, so it asks a render instance
(--openai-render-urls, in order, the next one on a connection failure) to render the body into the
GenerateRequest its own /inference/v1/generate takes, then answers in OpenAI's chat shape with the
transfer parameters beside `choices` (`OpenAICall.answer`).  Render's 4xx errors come back unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import Field
from starlette.requests import Request

from services.config import EpdConfig
from services.edge.auth import parse_keys
from services.edge.http_api import header_request_id, read_body
from services.protocol.common import Usage
from services.protocol.errors import EpdError, InvalidRequest, Unavailable
from services.protocol.generate import GenerateRequest, GenerateResponse
from services.protocol.openai_responses import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
)
from services.protocol.parsing import parse_json, validate_model

RENDER_PATH = "/v1/chat/completions/render"
RENDER_PATHS = {"chat": RENDER_PATH, "completion": "/v1/completions/render"}
RENDER_TIMEOUT_S = 60.0


class TransferChatResponse(ChatCompletionResponse):
    """A chat completion of an encode or prefill call: OpenAI's shape plus the transfer parameters."""

    kv_transfer_params: dict[str, Any] | None = Field(default=None, description="KV handle (prefill answers).")
    ec_transfer_params: dict[str, Any] | None = Field(default=None, description="{mm_hash: handle} (encode).")


class TransferCompletionResponse(CompletionResponse):
    """A completion of a prefill call: OpenAI's shape plus the transfer parameters."""

    kv_transfer_params: dict[str, Any] | None = Field(default=None, description="KV handle (prefill answers).")
    ec_transfer_params: dict[str, Any] | None = Field(default=None, description="{mm_hash: handle}.")


class _RenderError(EpdError):
    """An error render answered, passed on with its status, code and message."""

    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        super().__init__(str(error.get("message") or f"render answered {status}"),
                         code=str(error.get("code") or "render_error"))
        self.status, self.type = status, str(error.get("type") or "invalid_request_error")


class RenderClient:
    """Renders OpenAI chat bodies on a render instance over HTTP."""

    def __init__(self, urls: Sequence[str], api_key: str | None = None,
                 timeout_s: float = RENDER_TIMEOUT_S) -> None:
        self.urls = [u.rstrip("/") for u in urls if u.strip()]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def render(self, raw: bytes, request_id: str | None, payload: str = "tensors",
                     kind: str = "chat") -> GenerateRequest:
        """`raw` (a JSON object) rendered with mm_payload `payload` ("none": ids and hashes only; "metadata":
        no pixels, mm_metadata and the body's ec_transfer_params), appended so a large body is not re-encoded.
        A completion (`kind`, text or token ids: no media) must hold one prompt."""
        if payload != "tensors" and kind == "chat":
            raw = raw.rstrip()[:-1] + b', "mm_payload": ' + json.dumps(payload).encode() + b"}"
        if not self.urls:
            raise Unavailable("this role has no render instance to render OpenAI bodies with (set "
                              "--openai-render-urls), so it takes only /inference/v1/generate",
                              code="render_not_configured")
        headers = {**self.headers, "Content-Type": "application/json",
                   **({"X-Request-Id": request_id} if request_id else {})}
        failures = []
        async with aiohttp.ClientSession(timeout=self.timeout) as session:  # per call: nothing to close later
            for url in self.urls:
                try:
                    async with session.post(url + RENDER_PATHS[kind], data=raw, headers=headers) as reply:
                        answer, status = await reply.read(), reply.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    failures.append(f"{url}: {type(exc).__name__}")
                    continue
                if status != 200:
                    raise _RenderError(status, _json_or_none(answer))
                return validate_model(GenerateRequest, _one_prompt(parse_json(answer)))
        raise Unavailable(f"no render instance answered ({'; '.join(failures)})", code="render_unavailable")


def render_client(config: EpdConfig) -> RenderClient:
    """The role's client: --openai-render-urls, with the first role API key when the roles' APIs need one."""
    keys = parse_keys(config.security.role_api_key or config.security.api_key)
    return RenderClient(config.cluster.openai_render_urls.split(","), keys[0] if keys else None,
                        config.limits.ttft_timeout_s)


def _one_prompt(answer: Any) -> Any:
    """A chat render is one GenerateRequest; a completion render a list of them, of which a role takes one."""
    if not isinstance(answer, list):
        return answer
    if len(answer) != 1:
        raise InvalidRequest(f"a role takes one prompt per call, this completion has {len(answer)}",
                             code="one_prompt_per_call")
    return answer[0]


def _json_or_none(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return None


@dataclass(frozen=True)
class OpenAICall:
    """One chat-format call: the raw body as sent, and the GenerateRequest render made of it."""

    body: dict[str, Any]
    generate: GenerateRequest
    kind: str = "chat"   # or "completion"

    @property
    def include_usage(self) -> bool:
        options = self.body.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True

    def transfer_params(self, name: str) -> dict[str, Any] | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, dict):
            raise InvalidRequest(f"{name}: must be an object", code="invalid_type")
        return value

    def check_tokens(self) -> None:
        """llm-d's `tokens.token_ids` (its render's ids) must be the ids this call renders to."""
        tokens = self.body.get("tokens")
        if tokens is None:
            return
        given = tokens.get("token_ids") if isinstance(tokens, dict) else None
        if not isinstance(given, list):
            raise InvalidRequest("tokens: must be an object with token_ids", code="invalid_type")
        ours = self.generate.token_ids
        if given != ours:
            at = next((i for i, (a, b) in enumerate(zip(given, ours, strict=False)) if a != b), min(len(given),
                                                                                                len(ours)))
            raise InvalidRequest(f"tokens.token_ids differ from this chat's rendering at position {at} "
                                 f"({len(given)} ids given, {len(ours)} rendered): render and this role must "
                                 "serve the same model and template", code="tokens_mismatch")

    def answer(self, generated: GenerateResponse,
               content: str | None = None) -> TransferChatResponse | TransferCompletionResponse:
        """An encode or prefill answer in the call's shape (its text is not detokenized: content null / "")."""
        choice = generated.choices[0]
        if self.kind == "completion":
            return TransferCompletionResponse(
                id=self.generate.request_id, created=generated.created,
                model=generated.model or self.generate.model or "",
                choices=[CompletionChoice(text=content or "", finish_reason=choice.finish_reason,
                                          stop_reason=choice.stop_reason)],
                usage=Usage(prompt_tokens=generated.usage.prompt_tokens,
                            completion_tokens=generated.usage.completion_tokens),
                kv_transfer_params=generated.kv_transfer_params, ec_transfer_params=generated.ec_transfer_params)
        return TransferChatResponse(
            id=self.generate.request_id, created=generated.created,
            model=generated.model or self.generate.model or "",
            choices=[ChatCompletionChoice(message=ChatResponseMessage(content=content),
                                          finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)],
            usage=Usage(prompt_tokens=generated.usage.prompt_tokens,
                        completion_tokens=generated.usage.completion_tokens),
            kv_transfer_params=generated.kv_transfer_params, ec_transfer_params=generated.ec_transfer_params)


def _tensors(_: dict[str, Any]) -> str:
    return "tensors"


async def openai_call(request: Request, render: RenderClient,
                      payload: Callable[[dict[str, Any]], str] = _tensors, kind: str = "chat") -> OpenAICall:
    """Read a chat- (or completion-) format call and have it rendered; transfer parameters are taken from the raw
    body.  `payload(body)`: the mm_payload the role needs (decode "none": ids only; prefill "metadata").  A
    completion's `features` (llm-d sends its render's with images) are validated against the rendered ids."""
    raw = await read_body(request)
    body = parse_json(raw)
    if not isinstance(body, dict) or not body:
        raise InvalidRequest(f"the body must be a non-empty JSON object (an OpenAI {kind} request)",
                             code="invalid_type")
    generate = await render.render(raw, header_request_id(request), payload(body), kind)
    call = OpenAICall(body, generate, kind)
    update = {"kv_transfer_params": call.transfer_params("kv_transfer_params"),
              "ec_transfer_params": call.transfer_params("ec_transfer_params")}
    if kind == "completion" and body.get("features") is not None:
        generate = validate_model(GenerateRequest, {**generate.model_dump(), "features": body["features"]})
    call = OpenAICall(body, generate.model_copy(update=update), kind)
    call.check_tokens()
    return call
