"""Greedy output through the running cluster equals `generate` in one process, token for token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.cluster import metric_value
from tests.support.images import chat, noise_image

MAX_TOKENS = 20
CASES = {
    "text": ("Tell me a story about a lighthouse.", []),
    "one_image": ("Describe this image.", [(448, 448, 1)]),
    "two_images": ("Compare these two images.", [(224, 336, 2), (448, 280, 3)]),
}


def _images(spec):
    return [noise_image(w, h, seed) for w, h, seed in spec]


def _ask(cluster, text, images):
    body = chat(text, images, max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True)
    with cluster.client() as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.fixture(scope="module")
def expected(reference):
    return {name: reference.greedy(text, _images(spec), MAX_TOKENS) for name, (text, spec) in CASES.items()}


@pytest.mark.parametrize("connector", ["shm_cluster", "redis_cluster"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_generate(request, connector, case, expected, reference):
    cluster = request.getfixturevalue(connector)
    text, spec = CASES[case]
    answer = _ask(cluster, text, _images(spec))
    choice = answer["choices"][0]
    assert choice["token_ids"] == expected[case]
    assert choice["message"]["content"] == reference.processor.tokenizer.decode(
        expected[case], skip_special_tokens=True)
    assert answer["usage"]["completion_tokens"] == len(expected[case])
    assert answer["usage"]["prompt_tokens"] == len(answer["prompt_token_ids"])


@pytest.mark.parametrize("connector", ["shm_cluster", "redis_cluster"])
def test_eight_requests_in_flight_stay_exact(request, connector, expected):
    cluster = request.getfixturevalue(connector)
    names = [name for name in sorted(CASES) for _ in range(3)][:8]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda n: _ask(cluster, CASES[n][0], _images(CASES[n][1])), names))
    for name, answer in zip(names, answers, strict=True):
        assert answer["choices"][0]["token_ids"] == expected[name], name


def test_repetition_penalty_counts_the_prompt_like_generate(shm_cluster, reference):
    """Decode gets the prompt ids when a penalty needs them, so the penalty matches HF's (prompt + output)."""
    text = "Repeat after me: the the the the the"
    body = chat(text, max_tokens=MAX_TOKENS, temperature=0, repetition_penalty=1.8, return_token_ids=True)
    with shm_cluster.client() as client:
        answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["choices"][0]["token_ids"] == reference.greedy(text, [], MAX_TOKENS, repetition_penalty=1.8)


def test_the_screen_decided_greedy_tokens_on_the_redis_cluster_only(redis_cluster, shm_cluster, expected):
    """The redis cluster runs --lm-head-screen on: its prefill and decode count the greedy tokens the screen
    decided (and the tokens are generate's, as above); the shm cluster's tiny head stays on the full head."""
    def screened(cluster):
        return [metric_value(cluster.metrics(role), f"epd_{role}_lm_head_screened_rows_total")
                for role in ("prefill", "decode")]

    before = screened(redis_cluster)
    assert _ask(redis_cluster, *CASES["text"][:1], [])["choices"][0]["token_ids"] == expected["text"]
    after = screened(redis_cluster)
    assert after[0] - before[0] == 1 and after[1] - before[1] == len(expected["text"]) - 1
    assert screened(shm_cluster) == [0, 0]
