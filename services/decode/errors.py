"""Typed errors of the decode engine, placed in the epd taxonomy (services.protocol.errors)."""

from __future__ import annotations

from services.protocol.errors import InvalidRequest, Overloaded, Unavailable


class EngineFull(Overloaded):
    """All slots are busy and the wait queue is at its bound; retry later or elsewhere."""

    default_code = "decode_queue_full"


class ContextTooLong(InvalidRequest):
    """prompt_len + max_tokens exceeds the engine's max_model_len."""

    default_code = "context_length_exceeded"


class EngineClosed(Unavailable):
    """The engine was closed; it takes no more requests."""

    default_code = "decode_engine_closed"
