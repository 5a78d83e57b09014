"""OpenAI chat messages -> chat-template messages plus the images they reference.

Accepted (anything else is an `InvalidRequest` naming the message index):

- roles ``system``, ``user`` and ``assistant`` (the Qwen2-VL template knows no
  tool or developer turns);
- content as a string, null (empty; assistant turns only carry text), or a list
  of parts ``{"type": "text", "text"}`` and ``{"type": "image_url",
  "image_url": {"url"} | "<url>", "uuid"?}``;
- images only in ``user`` messages, as in the OpenAI API.  A part-level
  ``uuid`` (also accepted inside ``image_url``) becomes the item's mm_hash,
  when the request model keeps it (protocol's ChatContentPart does not yet).

Images are listed in prompt order, which is the order the template emits one
``<|vision_start|><|image_pad|><|vision_end|>`` per image.  Messages may be
dicts or pydantic models (they are dumped first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.protocol.errors import InvalidRequest

ROLES = ("system", "user", "assistant")
IMAGE_ROLES = ("user",)


@dataclass(frozen=True)
class ImageRef:
    """One image a prompt refers to, before fetching."""

    url: str
    uuid: str | None = None


@dataclass
class NormalizedChat:
    messages: list[dict[str, Any]] = field(default_factory=list)   # ready for apply_chat_template
    images: list[ImageRef] = field(default_factory=list)


def normalize_messages(messages: Sequence[Any]) -> NormalizedChat:
    if not messages:
        raise InvalidRequest("messages must contain at least one message", code="invalid_messages")
    chat = NormalizedChat()
    for index, message in enumerate(messages):
        chat.messages.append(_normalize_message(index, _as_dict(message), chat.images))
    return chat


def _normalize_message(index: int, message: dict[str, Any], images: list[ImageRef]) -> dict[str, Any]:
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"messages[{index}]: unsupported role {role!r}; supported: {', '.join(ROLES)}",
                             code="invalid_messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return {"role": role, "content": content or ""}
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{index}]: content must be a string or a list of parts",
                             code="invalid_messages")
    parts = [_normalize_part(index, role, _as_dict(part), images) for part in content]
    return {"role": role, "content": parts}


def _normalize_part(index: int, role: str, part: dict[str, Any], images: list[ImageRef]) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"messages[{index}]: text part without a string 'text'",
                                 code="invalid_messages")
        return {"type": "text", "text": text}
    if kind == "image_url":
        if role not in IMAGE_ROLES:
            raise InvalidRequest(f"messages[{index}]: images are only allowed in user messages, not {role}",
                                 code="invalid_messages")
        images.append(_image_ref(index, part))
        return {"type": "image"}
    raise InvalidRequest(f"messages[{index}]: unsupported content part type {kind!r}; "
                         "supported: text, image_url", code="invalid_messages")


def _image_ref(index: int, part: dict[str, Any]) -> ImageRef:
    image_url = part.get("image_url")
    if isinstance(image_url, str):
        image_url = {"url": image_url}
    inner = image_url if isinstance(image_url, dict) else {}
    url, inner_uuid = inner.get("url"), inner.get("uuid")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"messages[{index}]: image_url part without a url", code="invalid_messages")
    uuid: Any = part.get("uuid") or inner_uuid
    if uuid is not None and not isinstance(uuid, str):
        raise InvalidRequest(f"messages[{index}]: uuid must be a string", code="invalid_messages")
    return ImageRef(url=url, uuid=uuid or None)


def _as_dict(value: Any) -> dict[str, Any]:
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=False)
    if isinstance(value, dict):
        return value
    raise InvalidRequest(f"expected an object, got {type(value).__name__}", code="invalid_messages")
