"""Property-based fuzzing of the coordinator from its own OpenAPI document (schemathesis): never a 5xx.

The document is what GET /openapi.json serves, generated from the protocol
models.  Each operation gets EXAMPLES generated requests (schema-valid and
schema-violating, hypothesis-derandomized so a run is reproducible).  It runs
on the pool cluster, whose short context (1024 tokens) keeps the longest
generation well inside the request deadline: a generation cut by the deadline
is an honest 504, not what this test is about.
"""

from __future__ import annotations

import time

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

EXAMPLES = 12
BUDGET_S = 90.0


@pytest.fixture(scope="module")
def pool(pool_clusters):
    return pool_clusters.intact()


def test_openapi_document_lists_every_route(pool):
    import httpx

    doc = httpx.get(pool.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate", "/v1/models", "/health"):
        assert path in doc["paths"], path
    for path in ("/abort_requests", "/v1/instances"):  # the admin API's, not on the public port
        assert path not in doc["paths"], path


def test_fuzzing_the_openapi_document_finds_no_server_error(pool):
    schema = schemathesis.openapi.from_url(pool.url + "/openapi.json")
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            case.call_and_validate(checks=[not_a_server_error], timeout=40)

        fuzz()
    assert time.monotonic() - started < BUDGET_S
    with pool.client() as client:  # and the cluster still serves
        assert client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
