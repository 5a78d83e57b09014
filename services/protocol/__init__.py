"""The wire protocol of PROTOCOL.md: pydantic models, the multimodal item format, errors.

Modules (import them directly; this package imports nothing, so `errors` stays cheap):
errors (taxonomy) · common (base model, Usage, ids) · parsing (parse_model) ·
tensors / items / serialization (kwargs_data and mm_metadata bytes, no torch) ·
sampling · features · generate · openai · openai_responses · tokenization ·
derender · streaming (SSE framing).
"""
