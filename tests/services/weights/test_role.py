"""A role's weights: staged beside the served ones, switched at commit (the replaced ones retired), discarded on
an update that failed elsewhere; a request naming another version is refused."""

from __future__ import annotations

import asyncio

import pytest

from services.protocol.errors import Conflict, InvalidRequest
from services.weights.role import BASE_VERSION, RoleWeights
from tests.support.checkpoints import other_weights


def _weights(base, log):
    served = {"now": ("built", base)}

    def build(folder, version):
        log.append(("build", folder.name, version))
        return ("built", folder)

    def swap(new):
        old, served["now"] = served["now"], new
        log.append(("swap", new[1].name))
        return old

    return RoleWeights("decode", base, build, swap, lambda old: log.append(("retire", old[1].name))), served


def test_stage_then_commit_switches_and_retires_the_old(demo_model_path, tmp_path):
    log: list = []
    weights, served = _weights(demo_model_path, log)
    folder = other_weights(demo_model_path, tmp_path / "step-1")
    assert weights.check("") == weights.check(BASE_VERSION) == BASE_VERSION

    async def scenario():
        await weights.stage("1", str(folder))
        assert weights.version == BASE_VERSION and weights.info()["staged_version"] == "1"
        await weights.commit("1")
        await weights.commit("1")   # a retried call is a no-op

    asyncio.run(scenario())
    assert served["now"] == ("built", folder) and weights.version == "1" and weights.path == str(folder)
    assert log == [("build", "step-1", "1"), ("swap", "step-1"), ("retire", demo_model_path.name)]
    with pytest.raises(Conflict, match="serves weight version '1', the request runs on 'base'") as caught:
        weights.check(BASE_VERSION)
    assert caught.value.code == "weight_version_mismatch" and caught.value.status == 409


def test_a_bad_checkpoint_stages_nothing_and_discard_drops_a_staged_one(demo_model_path, tmp_path):
    log: list = []
    weights, served = _weights(demo_model_path, log)

    async def scenario():
        with pytest.raises(InvalidRequest, match="not a folder"):
            await weights.stage("1", str(tmp_path / "missing"))
        with pytest.raises(Conflict, match="no weights '1' staged"):
            await weights.commit("1")
        await weights.stage("2", str(other_weights(demo_model_path, tmp_path / "s2")))
        await weights.discard("2")

    asyncio.run(scenario())
    assert weights.version == BASE_VERSION and weights.staged is None
    assert log == [("build", "s2", "2"), ("retire", "s2")] and served["now"][1] == demo_model_path
