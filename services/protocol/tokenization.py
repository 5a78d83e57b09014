"""POST /tokenize and POST /detokenize bodies, as vLLM serves them.

/tokenize takes either {prompt} (completion form) or {messages} (chat form);
`parse_tokenize_request` picks the form by the presence of "messages".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from services.protocol.common import ProtocolModel, TokenId
from services.protocol.openai import ChatMessage
from services.protocol.parsing import parse_json, validate_model


class TokenizeCompletionRequest(ProtocolModel):
    """Tokenize a plain prompt."""

    model: str | None = Field(default=None, description="Model name; null passes the model check.")
    prompt: str = Field(description="Text to tokenize.")
    add_special_tokens: bool = Field(default=True, description="Add BOS and the like.")
    return_token_strs: bool = Field(default=False, description="Also return the token strings.")


class TokenizeChatRequest(ProtocolModel):
    """Tokenize a conversation after applying the chat template (images expand their placeholders)."""

    model: str | None = Field(default=None, description="Model name; null passes the model check.")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation.")
    add_generation_prompt: bool = Field(default=True, description="End with the assistant header.")
    continue_final_message: bool = Field(default=False, description="Continue the last message.")
    add_special_tokens: bool = Field(
        default=False, description="Add BOS and the like (the template usually does).")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="Extra template variables.")
    return_token_strs: bool = Field(default=False, description="Also return the token strings.")


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def parse_tokenize_request(data: bytes | str | Mapping[str, Any]) -> TokenizeRequest:
    """Either form of the /tokenize body; failures -> InvalidRequest."""
    obj = data if isinstance(data, Mapping) else parse_json(data)
    if isinstance(obj, Mapping) and "messages" in obj:
        return validate_model(TokenizeChatRequest, obj)
    return validate_model(TokenizeCompletionRequest, obj)


class TokenizeResponse(ProtocolModel):
    count: int = Field(description="Number of tokens.")
    max_model_len: int = Field(description="Context length of the served model.")
    tokens: list[int] = Field(description="The token ids.")
    token_strs: list[str] | None = Field(default=None, description="Token strings, when asked for.")


class DetokenizeRequest(ProtocolModel):
    model: str | None = Field(default=None, description="Model name; null passes the model check.")
    tokens: list[TokenId] = Field(description="Token ids to turn into text.")


class DetokenizeResponse(ProtocolModel):
    prompt: str = Field(description="The decoded text.")
