"""Derender: generate answers (token ids) -> OpenAI answers (text), as render's core.

The OpenAI shapes come from the one answer builder (services.protocol.answers),
the same the coordinator answers with.  Transport-free; render's api_router
parses the bodies (services.protocol.derender, derender_stream) and calls one
method here.  The text is what epd's decode
streams for the same tokens (see output_text.py), so orchestrator flow and
coordinator give byte-identical answers.  Ids: "chatcmpl-<id>" / "cmpl-<id>"
where <id> is the generate answer's id without "generate-tokens-" (the
coordinator uses the same <id>).

Streaming (module doc of services.protocol.derender_stream): the first call
(stream_state null) also sends the chat role chunk; a generate chunk with no
choices is the usage event and becomes the OpenAI usage chunk.
"""

from __future__ import annotations

from typing import Any, cast

from services.generation.params import DecodeParams
from services.protocol.answers import Kind, OpenAIAnswer
from services.protocol.common import Usage, now_s
from services.protocol.derender_stream import (
    ChatDerenderStreamRequest,
    ChatDerenderStreamResponse,
    CompletionDerenderStreamRequest,
    CompletionDerenderStreamResponse,
    DerenderStreamState,
    OutputState,
)
from services.protocol.errors import InvalidRequest
from services.protocol.generate import RESPONSE_ID_PREFIX, GenerateChoice, GenerateResponse
from services.protocol.logprobs import from_generate
from services.protocol.openai import ChatCompletionRequest, CompletionRequest
from services.protocol.openai_responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
)
from services.render.output_text import OutputText, text_params


def _params(req: ChatCompletionRequest | CompletionRequest | None) -> DecodeParams:
    if req is None:
        return text_params()
    return text_params(req.stop or (), min_tokens=req.min_tokens or 0,
                       skip_special_tokens=req.skip_special_tokens is not False,
                       include_stop_str_in_output=bool(req.include_stop_str_in_output))


def _choice(response: GenerateResponse, where: str) -> GenerateChoice:
    if not response.choices:
        raise InvalidRequest(f"{where}: has no choices", code="invalid_generate_response")
    return response.choices[0]


def _answer_id(prefix: str, response: GenerateResponse) -> str:
    """prefix + the generate id without 'generate-tokens-'; a render id ('chatcmpl-...') is not prefixed twice."""
    base = response.request_id.removeprefix(RESPONSE_ID_PREFIX)
    return base if base.startswith(prefix) else prefix + base


def _answer(kind: Kind, state: DerenderStreamState) -> OpenAIAnswer:
    return OpenAIAnswer(kind, state.id, state.model, state.created)


class Derenderer:
    """Stateless; one per render process."""

    def __init__(self, tokenizer: Any, model_id: str) -> None:
        self.tokenizer, self.model_id = tokenizer, model_id

    def _model(self, req: ChatDerenderStreamRequest | CompletionDerenderStreamRequest,
               response: GenerateResponse) -> str:
        return req.model or response.model or self.model_id

    def _logprobs(self, answer: OpenAIAnswer, generated: Any) -> dict[str, Any] | None:
        """A generate answer's GenerateLogProbs (integer ids) in the OpenAI shape of `answer`, with texts."""
        records = from_generate(generated)
        if records is None:
            return None
        return answer.logprobs([r.with_text(lambda t: self.tokenizer.decode([t])) for r in records])

    # ---- chat ---------------------------------------------------------------------------------------

    def chat(self, req: ChatDerenderStreamRequest) -> ChatCompletionResponse:
        response = req.generate_response
        choice = _choice(response, "generate_response")
        out = OutputText(self.tokenizer, _params(req.chat_request))
        text = out.feed(choice.token_ids, choice.finish_reason, choice.stop_reason)
        prompt = req.num_prompt_tokens or response.usage.prompt_tokens
        answer = OpenAIAnswer("chat", _answer_id("chatcmpl-", response), self._model(req, response),
                              response.created)
        whole = answer.choice(text, out.finish_reason or choice.finish_reason, out.stop_reason,
                              self._logprobs(answer, choice.logprobs))
        usage = Usage(prompt_tokens=prompt, completion_tokens=len(choice.token_ids))
        return cast(ChatCompletionResponse, answer.response([whole], usage))

    def chat_stream(self, req: ChatDerenderStreamRequest) -> ChatDerenderStreamResponse:
        response = req.generate_response
        state = req.stream_state or self._new_state("chatcmpl-", response, req, 1)
        out = OutputText.from_state(self.tokenizer, _params(req.chat_request), state.outputs[0].model_dump())
        answer = _answer("chat", state)
        chunks: list[ChatCompletionChunk] = []
        if req.stream_state is None:
            chunks.append(answer.role_chunk())
        if not response.choices:
            prompt = req.num_prompt_tokens or response.usage.prompt_tokens
            usage = Usage(prompt_tokens=prompt, completion_tokens=out.num_tokens)
            chunks.append(cast(ChatCompletionChunk, answer.chunk([], usage)))
        else:
            text, finish = self._feed(out, response.choices[0])
            if response.choices[0].token_ids or text or finish:   # vLLM: a chunk per generate chunk with tokens
                delta = answer.delta_choice(text, finish, self._logprobs(answer, response.choices[0].logprobs))
                chunks.append(cast(ChatCompletionChunk, answer.chunk([delta])))
        state.outputs[0] = OutputState.model_validate(out.state())
        return ChatDerenderStreamResponse(chunks=chunks, stream_state=state)

    # ---- completions --------------------------------------------------------------------------------

    def completion(self, req: CompletionDerenderStreamRequest) -> CompletionResponse:
        first = req.generate_responses[0]
        answer = OpenAIAnswer("completion", _answer_id("cmpl-", first), self._model(req, first), first.created)
        choices, completion = [], 0
        params = _params(req.completion_request)
        for index, response in enumerate(req.generate_responses):
            choice = _choice(response, f"generate_responses[{index}]")
            out = OutputText(self.tokenizer, params)
            text = out.feed(choice.token_ids, choice.finish_reason, choice.stop_reason)
            text = self._echo(req, index) + text
            choices.append(answer.choice(text, out.finish_reason or choice.finish_reason, out.stop_reason,
                                         self._logprobs(answer, choice.logprobs), index))
            completion += len(choice.token_ids)
        usage = Usage(prompt_tokens=sum(req.num_prompt_tokens), completion_tokens=completion)
        return cast(CompletionResponse, answer.response(choices, usage))

    def completion_stream(self, req: CompletionDerenderStreamRequest) -> CompletionDerenderStreamResponse:
        responses = req.generate_responses
        state = req.stream_state or self._new_state("cmpl-", responses[0], req, len(responses))
        if len(state.outputs) != len(responses):
            raise InvalidRequest(f"stream_state has {len(state.outputs)} outputs but generate_responses has "
                                 f"{len(responses)} entries", code="invalid_stream_state")
        params = _params(req.completion_request)
        answer = _answer("completion", state)
        choices, outs = [], []
        for index, response in enumerate(responses):
            out = OutputText.from_state(self.tokenizer, params, state.outputs[index].model_dump())
            outs.append(out)
            if response.choices:
                text, finish = self._feed(out, response.choices[0])
                if req.stream_state is None:
                    text = self._echo(req, index) + text
                if response.choices[0].token_ids or text or finish:
                    logprobs = self._logprobs(answer, response.choices[0].logprobs)
                    choices.append(answer.delta_choice(text, finish, logprobs, index))
            state.outputs[index] = OutputState.model_validate(out.state())
        chunks = [cast(CompletionChunk, answer.chunk(choices))] if choices else []
        if all(not r.choices for r in responses) and all(o.finish_reason for o in outs):
            usage = Usage(prompt_tokens=sum(req.num_prompt_tokens),
                          completion_tokens=sum(o.num_tokens for o in outs))
            chunks.append(cast(CompletionChunk, answer.chunk([], usage)))
        return CompletionDerenderStreamResponse(chunks=chunks, stream_state=state)

    # ---- helpers ------------------------------------------------------------------------------------

    @staticmethod
    def _feed(out: OutputText, choice: GenerateChoice) -> tuple[str, str | None]:
        """(new text, finish_reason if this chunk ended the output)."""
        was_finished = out.finish_reason is not None
        text = out.feed(choice.token_ids, choice.finish_reason, choice.stop_reason)
        return text, (out.finish_reason if not was_finished else None)

    def _echo(self, req: CompletionDerenderStreamRequest, index: int) -> str:
        if req.completion_request is None or not req.completion_request.echo:
            return ""
        prompt = req.prompt_tokens[index]
        if isinstance(prompt, int):
            raise InvalidRequest(f"prompt_tokens[{index}]: echo needs the prompt's token ids, not a count",
                                 code="echo_needs_prompt_ids")
        return self.tokenizer.decode(list(prompt), skip_special_tokens=False)

    def _new_state(self, prefix: str, response: GenerateResponse,
                   req: ChatDerenderStreamRequest | CompletionDerenderStreamRequest,
                   num_outputs: int) -> DerenderStreamState:
        return DerenderStreamState(id=_answer_id(prefix, response), created=response.created or now_s(),
                                   model=self._model(req, response),
                                   outputs=[OutputState() for _ in range(num_outputs)])

