"""The checkpoint's chat template and tokenizer, as render calls them.

Called only from render's one-thread tokenizer executor: Hugging Face fast
tokenizers may fail ("Already borrowed") when called from several threads.
A template error is the caller's fault (e.g. a role order the template
refuses) and becomes an `InvalidRequest`.

Content shapes: templates differ in what a message's content may be.  A
text-only model's template gets strings (text parts joined by newlines, as
vLLM does); a multimodal template that drops string content (llava-hf's
iterates parts only; found by rendering a probe once) gets a string wrapped
as one text part.
"""

from __future__ import annotations

from typing import Any

from services.protocol.errors import InvalidRequest

# apply_chat_template arguments a request's chat_template_kwargs must not override.
_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


_PROBE = "epd-content-probe"


class ChatTemplate:
    def __init__(self, tokenizer: Any, text_only: bool = False) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the checkpoint's tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.text_only = text_only
        self.wraps_strings = not text_only and not self._renders_string_content()

    def _renders_string_content(self) -> bool:
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False)
        except Exception:  # a template that cannot take string content at all
            return False
        return _PROBE in text

    def _shaped(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.text_only:
            return [{**m, "content": _joined_text(m["content"])} for m in messages]
        if self.wraps_strings:
            return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m["content"], str)
                    else m for m in messages]
        return messages

    def render(self, messages: list[dict[str, Any]], req: Any) -> str:
        """The prompt text.

        `req` supplies add_generation_prompt, continue_final_message and chat_template_kwargs.
        """
        extra = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED}
        add_generation_prompt = bool(req.add_generation_prompt)
        if req.continue_final_message:
            if messages[-1]["role"] != "assistant":
                raise InvalidRequest("continue_final_message needs a final assistant message",
                                     code="invalid_messages")
            add_generation_prompt = False
        try:
            return self.tokenizer.apply_chat_template(
                self._shaped(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=bool(req.continue_final_message), **extra)
        except InvalidRequest:
            raise
        except Exception as exc:  # jinja2 TemplateError, or a template's raise_exception()
            raise InvalidRequest(f"chat template failed: {exc}", code="chat_template_error") from None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_and_encode(self, messages: list[dict[str, Any]], req: Any,
                          add_special_tokens: bool = False) -> tuple[str, list[int]]:
        text = self.render(messages, req)
        return text, self.encode(text, add_special_tokens)


def _joined_text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if part.get("type") == "text")
