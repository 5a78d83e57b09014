"""POST /v1/chat/completions/derender and /v1/completions/derender bodies.

Derender turns generate answers (token ids) back into OpenAI answers (text).
`prompt_tokens` is the prompt's token count; the prompt's token ids are
accepted too (their length is the count), since callers hold either.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from services.protocol.common import ProtocolModel, TokenId
from services.protocol.generate import GenerateResponse
from services.protocol.openai import ChatCompletionRequest, CompletionRequest

PromptTokens = Annotated[int, Field(ge=0)] | list[TokenId]


def count_prompt_tokens(value: PromptTokens) -> int:
    return value if isinstance(value, int) else len(value)


class ChatDerenderRequest(ProtocolModel):
    """A generate answer to turn into a ChatCompletion."""

    model: str | None = Field(default=None, description="Model name for the answer.")
    generate_response: GenerateResponse = Field(description="What /inference/v1/generate answered.")
    prompt_tokens: PromptTokens = Field(
        default=0, description="Prompt token count (or the prompt's token ids).")
    prompt_token_ids: list[TokenId] | None = Field(default=None, description="vLLM's field: the prompt's ids; "
                                                   "counted when prompt_tokens is absent.")
    chat_request: ChatCompletionRequest | None = Field(default=None, description="The original request (stop "
                                                       "strings, skip_special_tokens, ...).")

    @property
    def num_prompt_tokens(self) -> int:
        if not self.prompt_tokens and self.prompt_token_ids:
            return len(self.prompt_token_ids)
        return count_prompt_tokens(self.prompt_tokens)


class CompletionDerenderRequest(ProtocolModel):
    """Generate answers, one per prompt, to turn into one Completion."""

    model: str | None = Field(default=None, description="Model name for the answer.")
    generate_responses: list[GenerateResponse] = Field(min_length=1, description="One answer per prompt.")
    prompt_tokens: list[PromptTokens] = Field(description="Per prompt: token count (or token ids).")
    completion_request: CompletionRequest | None = Field(default=None, description="The original request.")

    @model_validator(mode="after")
    def _one_count_per_answer(self) -> CompletionDerenderRequest:
        if len(self.prompt_tokens) != len(self.generate_responses):
            raise ValueError(f"prompt_tokens has {len(self.prompt_tokens)} entries but generate_responses "
                             f"has {len(self.generate_responses)}")
        return self

    @property
    def num_prompt_tokens(self) -> list[int]:
        return [count_prompt_tokens(value) for value in self.prompt_tokens]
