from __future__ import annotations

import pytest

from services.protocol.errors import InvalidRequest
from services.protocol.openai import ChatCompletionRequest, CompletionRequest
from services.protocol.parsing import parse_model

IMAGE = "data:image/png;base64,iVBORw0KGgo="


def _chat(**fields) -> dict:
    return {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], **fields}


def _error(cls, body: dict) -> str:
    with pytest.raises(InvalidRequest) as caught:
        parse_model(cls, body)
    return caught.value.message


def test_mixed_text_and_image_parts():
    body = _chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": IMAGE, "detail": "high"}},
            {"type": "image_url", "image_url": "http://x/b.jpg"},  # bare string, accepted for leniency
        ]},
        {"role": "assistant", "content": "a cat"},
        {"role": "tool", "content": "{}", "tool_call_id": "c1"},
    ], unknown_field=1)
    request = parse_model(ChatCompletionRequest, body)
    parts = request.messages[1].content
    assert [p.type for p in parts] == ["text", "image_url", "image_url"]
    assert parts[0].text == "what is this?" and parts[1].image_url.detail == "high"
    assert request.image_urls() == [IMAGE, "http://x/b.jpg"]
    assert request.messages[0].content == "be brief"


def test_missing_or_empty_messages():
    assert _error(ChatCompletionRequest, {"model": "m"}) == "messages: field required"
    assert _error(ChatCompletionRequest, {"messages": []}) == "messages: must not be empty"


@pytest.mark.parametrize(("message", "expected"), [
    ({"role": "bot", "content": "x"}, "messages[0].role: must be 'system', 'user', 'assistant' or 'tool'"),
    ({"role": "user", "content": 5}, "messages[0].content: must be a string or must be a list"),
    ({"role": "user"}, "messages[0]: content is required for role 'user'"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0]: a 'text' part needs text"),
    ({"role": "user", "content": [{"type": "image_url"}]},
     "messages[0].content[0]: an 'image_url' part needs image_url"),
    ({"role": "user", "content": [{"type": "input_audio"}]},
     "messages[0].content[0].type: must be 'text', 'image_url' or 'video_url'"),
    ({"role": "user", "content": [{"type": "video_url"}]},
     "messages[0].content[0]: a 'video_url' part needs video_url"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]},
     "messages[0].content[0].image_url.url: must not be empty"),
])
def test_message_rules(message, expected):
    assert _error(ChatCompletionRequest, _chat(messages=[message])) == expected


def test_assistant_content_may_be_null():
    body = _chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                              "tool_calls": [{"id": "c"}]}])
    assert parse_model(ChatCompletionRequest, body).messages[1].content is None


def test_chat_to_sampling_params():
    body = _chat(max_tokens=10, max_completion_tokens=20, temperature=0, top_p=0.5, top_k=3, seed=1,
                 stop="END", presence_penalty=1, frequency_penalty=-1, logprobs=True, top_logprobs=2,
                 ignore_eos=True, min_tokens=2, stop_token_ids=[7], repetition_penalty=1.2, n=1, user="u",
                 cache_salt="s", chat_template_kwargs={"enable_thinking": False})
    params = parse_model(ChatCompletionRequest, body).to_sampling_params()
    assert params.max_tokens == 20  # max_completion_tokens wins
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.0, 0.5, 3, 1)
    assert params.stop == ["END"] and params.stop_token_ids == [7] and params.logprobs == 2
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (1.0, -1.0, 1.2)
    assert params.ignore_eos and params.min_tokens == 2


def test_chat_defaults_leave_server_defaults():
    params = parse_model(ChatCompletionRequest, _chat(temperature=None, logprobs=None)).to_sampling_params()
    assert params.max_tokens is None and params.temperature == 1.0 and params.logprobs is None
    assert parse_model(ChatCompletionRequest, _chat(max_tokens=5)).to_sampling_params().max_tokens == 5


@pytest.mark.parametrize(("fields", "expected"), [
    ({"n": 0}, "n: must be between 1 and 128, got 0"),
    ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
    ({"n": 2, "best_of": 3}, "best_of (3) must be null or equal to n (2): vLLM 0.32 dropped best_of; ask for n "
                             "samples and rank them yourself"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs: `prompt_logprobs` are not available when "
                                             "`stream=True`."),
    ({"temperature": -1}, "temperature: must be >= 0.0"),
    ({"max_completion_tokens": 0}, "max_completion_tokens: must be >= 1"),
    ({"top_logprobs": 21}, "top_logprobs: must be <= 20"),
    ({"cache_salt": ""}, "cache_salt: must be a non-empty string"),
    ({"max_completion_tokens": 2, "min_tokens": 3}, "min_tokens (3) must be <= max_tokens (2)"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage: must be a boolean"),
])
def test_chat_sampling_rules_use_the_callers_names(fields, expected):
    assert _error(ChatCompletionRequest, _chat(**fields)) == expected


def test_stream_options():
    request = parse_model(ChatCompletionRequest, _chat(stream=True, stream_options={}))
    assert request.stream and request.stream_options.include_usage


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_forms(prompt, prompts):
    assert parse_model(CompletionRequest, {"prompt": prompt}).prompts() == prompts


@pytest.mark.parametrize(("prompt", "expected"), [
    ([], "prompt: must be a string, a list of strings, a list of token ids or a list of lists of token ids, "
         "and not empty"),
    ([1, "a"], "prompt: must not mix strings, token ids and token id lists"),
    ([[1], []], "prompt: token id lists must not be empty"),
    ([[1, 2], [3, -1]], "prompt[1][1]: must be >= 0"),
    ([True], "prompt: must not mix strings, token ids and token id lists"),
])
def test_completion_prompt_rules(prompt, expected):
    assert _error(CompletionRequest, {"prompt": prompt}) == expected


def test_completion_missing_prompt_and_sampling():
    assert _error(CompletionRequest, {"model": "m"}) == "prompt: field required"
    request = parse_model(CompletionRequest, {"prompt": "x", "max_tokens": 3, "logprobs": 1, "echo": True,
                                              "stop": ["a"]})
    params = request.to_sampling_params()
    assert (params.max_tokens, params.logprobs, params.stop) == (3, 1, ["a"]) and request.echo
    assert _error(CompletionRequest, {"prompt": "x", "suffix": "y"}) == "suffix: suffix is not supported"
