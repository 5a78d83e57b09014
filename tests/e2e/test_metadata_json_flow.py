"""JSON-array mm_metadata and is_embed through real roles: render -> encode -> prefill -> decode, and the
coordinator's features path, give the same tokens as the base64 forms."""

from __future__ import annotations

import pytest

from tests.support.images import chat, noise_image
from tests.support.scale_out import Orchestrator, metadata_only

GENERATE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def orch(shm_cluster):
    orchestrator = Orchestrator(shm_cluster)
    yield orchestrator
    orchestrator.close()


def test_json_metadata_and_is_embed_flow_through_the_roles(orch):
    body = chat("Compare these two images.", [noise_image(56, 84, 5), noise_image(84, 56, 6)], max_tokens=10,
                temperature=0)
    asked = orch.render({**body, "mm_metadata_format": "json", "return_is_embed": True})
    grids = [e["image_grid_thw"] for e in asked["features"]["mm_metadata"]["image"]]
    assert grids == [[1, 6, 4], [1, 4, 6]]
    assert all(p["is_embed"] == [True] * p["length"] for p in asked["features"]["mm_placeholders"]["image"])
    direct = orch.ok("coordinator", "/v1/chat/completions", {**body, "return_token_ids": True})
    expected = direct["choices"][0]["token_ids"]
    # the coordinator's features path takes the JSON form as is
    assert orch.ok("coordinator", GENERATE, asked)["choices"][0]["token_ids"] == expected
    # prefill gets only the JSON metadata (no pixels) and the EC handles encode answered
    ec = orch.encode(asked)["ec_transfer_params"]
    prefill = orch.ok("prefill", GENERATE, orch.prefill_body(metadata_only(asked), ec))
    decode = orch.ok("decode", GENERATE, orch.decode_body(asked, prefill["kv_transfer_params"]))
    assert decode["choices"][0]["token_ids"] == expected
