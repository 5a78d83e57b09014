"""OpenAI chat messages -> chat-template messages plus the images and videos they reference.

Accepted (anything else is an `InvalidRequest` naming the message index):

- roles ``system``, ``user`` and ``assistant`` (the Qwen2-VL template knows no
  tool or developer turns);
- content as a string, null (empty; assistant turns only carry text), or a list
  of parts ``{"type": "text", "text"}``, ``{"type": "image_url",
  "image_url": {"url"} | "<url>", "uuid"?}`` and (vLLM's shape) ``{"type": "video_url",
  "video_url": {"url"} | "<url>", "uuid"?}``;
- images and videos only in ``user`` messages, as in the OpenAI API.  A part-level
  ``uuid`` (also accepted inside ``image_url`` / ``video_url``) names the item (uuid_scope.py).

Media are listed in prompt order, which is the order the template emits one
``<|vision_start|><|image_pad|><|vision_end|>`` per image (``<|video_pad|>`` per video).
Messages may be dicts or pydantic models (they are dumped first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.protocol.errors import InvalidRequest

ROLES = ("system", "user", "assistant")
IMAGE_ROLES = ("user",)
PART_MODALITY = {"image_url": "image", "video_url": "video"}


@dataclass(frozen=True)
class MediaRef:
    """One image or video a prompt refers to, before fetching."""

    url: str
    uuid: str | None = None
    modality: str = "image"


@dataclass
class NormalizedChat:
    messages: list[dict[str, Any]] = field(default_factory=list)   # ready for apply_chat_template
    media: list[MediaRef] = field(default_factory=list)            # images and videos, in prompt order

    def count(self, modality: str) -> int:
        return sum(1 for ref in self.media if ref.modality == modality)


def normalize_messages(messages: Sequence[Any]) -> NormalizedChat:
    if not messages:
        raise InvalidRequest("messages must contain at least one message", code="invalid_messages")
    chat = NormalizedChat()
    for index, message in enumerate(messages):
        chat.messages.append(_normalize_message(index, _as_dict(message), chat.media))
    return chat


def _normalize_message(index: int, message: dict[str, Any], media: list[MediaRef]) -> dict[str, Any]:
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
    parts = [_normalize_part(index, role, _as_dict(part), media) for part in content]
    return {"role": role, "content": parts}


def _normalize_part(index: int, role: str, part: dict[str, Any], media: list[MediaRef]) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"messages[{index}]: text part without a string 'text'",
                                 code="invalid_messages")
        return {"type": "text", "text": text}
    if kind in PART_MODALITY:
        modality = PART_MODALITY[kind]
        if role not in IMAGE_ROLES:
            raise InvalidRequest(f"messages[{index}]: {modality}s are only allowed in user messages, not {role}",
                                 code="invalid_messages")
        media.append(_media_ref(index, part, kind))
        return {"type": modality}
    raise InvalidRequest(f"messages[{index}]: unsupported content part type {kind!r}; "
                         "supported: text, image_url, video_url", code="invalid_messages")


def _media_ref(index: int, part: dict[str, Any], kind: str) -> MediaRef:
    payload = part.get(kind)
    if isinstance(payload, str):
        payload = {"url": payload}
    inner = payload if isinstance(payload, dict) else {}
    url, inner_uuid = inner.get("url"), inner.get("uuid")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"messages[{index}]: {kind} part without a url", code="invalid_messages")
    uuid: Any = part.get("uuid") or inner_uuid
    if uuid is not None and not isinstance(uuid, str):
        raise InvalidRequest(f"messages[{index}]: uuid must be a string", code="invalid_messages")
    return MediaRef(url=url, uuid=uuid or None, modality=PART_MODALITY[kind])


def _as_dict(value: Any) -> dict[str, Any]:
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=False)
    if isinstance(value, dict):
        return value
    raise InvalidRequest(f"expected an object, got {type(value).__name__}", code="invalid_messages")
