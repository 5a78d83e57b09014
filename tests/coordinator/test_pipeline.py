"""The pipeline as one straight line over real gRPC (scripted roles): order, skips, recovery, failover."""

from __future__ import annotations

import asyncio
import json

import pytest

from coordinator.pipeline import RECOVERIES, STEPS, Pipeline
from coordinator.steps.decode import DecodeStep
from coordinator.steps.encode import EncodeStep
from coordinator.steps.generate_input import GenerateInputStep
from coordinator.steps.prefill import PrefillStep
from coordinator.steps.render import RenderStep
from services.protocol.answers import OpenAIAnswer
from services.protocol.errors import NotFound, Unavailable
from tests.support.scripted_roles import Bench, chat_context


def run(scenario, **start):
    """Start the bench, run `scenario(bench, pipeline)`, stop everything; the scenario's result."""
    async def main():
        bench = Bench()
        setup = start.pop("setup", None)
        if setup is not None:
            setup(bench)
        cluster = await bench.start(**start)
        try:
            return await scenario(bench, Pipeline(cluster))
        finally:
            await bench.stop()

    return asyncio.run(main())


async def answer(pipeline: Pipeline, ctx) -> dict:
    await pipeline.prepare(ctx)
    built = OpenAIAnswer("chat", "chatcmpl-" + ctx.request_id, ctx.rendered.model, ctx.created, ctx.prompt_tokens())
    return await built.collect(pipeline.stream(ctx))


def retries(bench: Bench) -> dict[tuple[str, str], float]:
    samples = bench.cluster.metrics.retries.collect()[0].samples
    return {(s.labels["role"], s.labels["reason"]): s.value for s in samples if s.name.endswith("_total")}


def test_the_steps_run_in_one_order_and_no_step_holds_another():
    assert [cls.name for cls in STEPS] == ["generate_input", "render", "encode", "prefill", "decode"]
    assert set(RECOVERIES) == {"ec_entry_missing", "kv_entry_missing", "mm_entry_missing"}
    assert [RECOVERIES[c].rerun_from for c in ("ec_entry_missing", "kv_entry_missing")] == ["encode", "prefill"]


def test_one_request_runs_each_stage_once_and_prefill_gets_no_pixels():
    async def scenario(bench, pipeline):
        ctx = chat_context()
        body = await answer(pipeline, ctx)
        return bench, ctx, body

    bench, ctx, body = run(scenario)
    assert body["choices"][0]["message"]["content"] == "abc"
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
    assert (bench.render.calls, len(bench.encode.requests), len(bench.prefill.requests),
            len(bench.decode.requests)) == (1, 1, 1, 1)
    [item] = bench.prefill.requests[0].items
    assert item.kwargs_data == b"" and item.mm_metadata == b"grid"
    assert json.loads(bench.prefill.requests[0].ec_transfer_params_json) == {"h0": {"n": 1}}
    assert bench.decode.requests[0].sampling.max_tokens == 3  # render's sampling, typed in ctx.sampling
    assert set(ctx.instances) == {"render", "encode", "prefill", "decode"}
    assert {"render", "encode", "prefill", "decode_first_chunk", "decode"} <= set(ctx.timings)
    assert ctx.recovered == set() and ctx.failovers == 0


def test_kv_entry_missing_prefills_again_then_decodes_the_new_entry():
    async def scenario(bench, pipeline):
        bench.decode.script = ["kv_missing"]
        ctx = chat_context()
        return bench, ctx, await answer(pipeline, ctx)

    bench, ctx, body = run(scenario)
    assert body["choices"][0]["message"]["content"] == "abc"
    assert len(bench.prefill.requests) == 2 and len(bench.encode.requests) == 1  # embeddings still there
    kv = [json.loads(r.kv_transfer_params_json) for r in bench.decode.requests]
    assert kv == [{"handle": 1}, {"handle": 2}]
    assert ctx.recovered == {"kv_entry_missing"}
    assert retries(bench) == {("decode", "kv_entry_missing"): 1.0}


def test_kv_entry_missing_twice_is_reported_not_looped():
    async def scenario(bench, pipeline):
        bench.decode.script = ["kv_missing", "kv_missing"]
        with pytest.raises(NotFound) as caught:
            await pipeline.prepare(chat_context())
        return bench, caught.value

    bench, err = run(scenario)
    assert (err.status, err.code) == (404, "kv_entry_missing")
    assert len(bench.prefill.requests) == 2 and len(bench.decode.requests) == 2


def test_ec_entry_missing_encodes_again_then_prefills():
    async def scenario(bench, pipeline):
        bench.prefill.script = ["ec_missing"]
        ctx = chat_context()
        await answer(pipeline, ctx)
        return bench, ctx

    bench, ctx = run(scenario)
    assert len(bench.encode.requests) == 2 and len(bench.prefill.requests) == 2
    assert json.loads(bench.prefill.requests[1].ec_transfer_params_json) == {"h0": {"n": 2}}
    assert bench.cluster.ec_handles.get("h0") == b'{"n": 2}'
    assert retries(bench) == {("prefill", "ec_entry_missing"): 1.0}


def test_mm_entry_missing_renders_again_then_encodes():
    async def scenario(bench, pipeline):
        bench.encode.script = ["mm_missing"]
        ctx = chat_context()
        body = await answer(pipeline, ctx)
        return bench, ctx, body

    bench, ctx, body = run(scenario)
    assert body["choices"][0]["message"]["content"] == "abc"
    assert bench.render.calls == 2 and len(bench.encode.requests) == 2 and len(bench.prefill.requests) == 1
    assert ctx.recovered == {"mm_entry_missing"} and retries(bench) == {("encode", "mm_entry_missing"): 1.0}


def test_an_image_seen_before_is_not_sent_to_an_encoder_again():
    async def scenario(bench, pipeline):
        await answer(pipeline, chat_context("a"))
        second = chat_context("b")
        await answer(pipeline, second)
        return bench, second

    bench, second = run(scenario)
    assert len(bench.encode.requests) == 1 and len(bench.prefill.requests) == 2
    assert "encode" not in second.timings and second.ec_handles == {"h0": b'{"n": 1}'}


def test_text_only_skips_encode():
    async def scenario(bench, pipeline):
        bench.render.num_images = 0
        ctx = chat_context()
        await answer(pipeline, ctx)
        return bench, ctx

    bench, ctx = run(scenario)
    assert bench.encode.requests == [] and "encode" not in ctx.instances
    assert bench.prefill.requests[0].ec_transfer_params_json == b""


def test_decode_fails_over_from_a_dead_instance_before_the_first_token():
    async def scenario(bench, pipeline):
        ctx = chat_context()
        body = await answer(pipeline, ctx)
        return bench, ctx, body

    bench, ctx, body = run(scenario, dead_decode_first=True, decode_routing_policy="round_robin")
    assert body["choices"][0]["message"]["content"] == "abc" and len(bench.decode.requests) == 1
    dead, alive = bench.cluster.decode.pool.instances
    assert ctx.failovers == 1 and not dead.healthy and ctx.instances["decode"] == alive.address


def test_a_decode_instance_dying_mid_stream_is_resumed_on_another_with_nothing_repeated_or_lost():
    """The client's deltas are exactly an undisturbed run's; the second call names the tokens it has, and the
    prompt is prefilled again with every token sent but the last."""
    async def scenario(bench, pipeline):
        bench.decode.script = ["die_mid_stream"]
        ctx = chat_context()
        await pipeline.prepare(ctx)
        deltas = [(list(d.token_ids), d.text, d.finish_reason) async for d in pipeline.stream(ctx)]
        return bench, ctx, deltas

    bench, ctx, deltas = run(scenario, decode_instances=2, decode_routing_policy="round_robin")
    assert deltas == [([5], "a", None), ([6], "b", None), ([7], "c", "length")]
    first, resumed = bench.decode.requests
    assert (list(first.resumed_token_ids), list(resumed.resumed_token_ids)) == ([], [5, 6])
    assert list(bench.prefill.requests[1].token_ids) == [1, 2, 3, 4, 5, 6, 7, 8, 5]
    assert resumed.prompt_tokens == 8 and ctx.resumed == [5, 6]
    dead, alive = bench.cluster.decode.pool.instances
    assert not dead.healthy and alive.healthy and (dead.inflight, alive.inflight) == (0, 0)
    assert bench.cluster.metrics.resumed._value.get() == 1


def test_a_mid_stream_failure_with_no_decode_instance_left_ends_the_stream_in_band():
    async def scenario(bench, pipeline):
        bench.decode.script = ["die_mid_stream"]
        ctx = chat_context()
        await pipeline.prepare(ctx)
        seen = []
        with pytest.raises(Unavailable) as caught:
            async for delta in pipeline.stream(ctx):
                seen.append(delta.text)
        return bench, seen, caught.value

    bench, seen, err = run(scenario)
    assert seen == ["a", "b"] and err.code == "decode_unavailable"
    [instance] = bench.cluster.decode.pool.instances
    assert not instance.healthy and instance.inflight == 0


def test_the_decode_stream_frees_its_instance_and_closes_once():
    async def scenario(bench, pipeline):
        ctx = chat_context()
        await pipeline.prepare(ctx)
        [instance] = bench.cluster.decode.pool.instances
        during = instance.inflight
        deltas = [d async for d in pipeline.stream(ctx)]
        ctx.decode_stream.close()  # again: the request's cleanup also calls it
        return during, instance.inflight, deltas

    during, after, deltas = run(scenario)
    assert (during, after) == (1, 0)
    assert [(list(d.token_ids), d.text, d.finish_reason) for d in deltas] == \
        [([5], "a", None), ([6], "b", None), ([7], "c", "length")]


# ---- each step on its own: it does its one thing, and returns at once when it does not apply ----------

def test_render_step_sets_rendered_and_typed_sampling_then_skips():
    async def scenario(bench, pipeline):
        ctx = chat_context()
        step = pipeline.step(RenderStep)
        await step.execute(ctx)
        await step.execute(ctx)
        return bench, ctx

    bench, ctx = run(scenario)
    assert bench.render.calls == 1 and list(ctx.rendered.token_ids) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert ctx.sampling.max_tokens == 3 and ctx.sampling.skip_special_tokens


def test_generate_input_step_applies_to_generate_requests_only():
    async def scenario(bench, pipeline):
        ctx = chat_context()
        await pipeline.step(GenerateInputStep).execute(ctx)
        return ctx

    assert run(scenario).rendered is None


def test_encode_step_encodes_each_distinct_missing_item_once():
    async def scenario(bench, pipeline):
        bench.render.num_images = 3
        ctx = chat_context()
        await pipeline.step(RenderStep).execute(ctx)
        ctx.ec_handles["h1"] = b'{"given": 1}'  # e.g. from the caller's ec_transfer_params
        await pipeline.step(EncodeStep).execute(ctx)
        return bench, ctx

    bench, ctx = run(scenario)
    assert sorted(r.items[0].mm_hash for r in bench.encode.requests) == ["h0", "h2"]
    assert all(r.items[0].kwargs_data for r in bench.encode.requests)
    assert set(ctx.ec_handles) == {"h0", "h1", "h2"}


def test_prefill_and_decode_steps_keep_their_answer():
    async def scenario(bench, pipeline):
        bench.render.num_images = 0
        ctx = chat_context()
        await pipeline.step(RenderStep).execute(ctx)
        for _ in range(2):
            await pipeline.step(PrefillStep).execute(ctx)
            await pipeline.step(DecodeStep).execute(ctx)
        ctx.decode_stream.close()
        return bench

    bench = run(scenario)
    assert len(bench.prefill.requests) == 1 and len(bench.decode.requests) == 1


def test_decode_request_carries_prompt_ids_only_for_penalties():
    async def scenario(bench, pipeline):
        bench.render.num_images = 0
        ctx = chat_context()
        await pipeline.step(RenderStep).execute(ctx)
        await pipeline.step(PrefillStep).execute(ctx)
        plain = DecodeStep.request(ctx)
        ctx.sampling.repetition_penalty = 1.2
        return plain, DecodeStep.request(ctx)

    plain, penalised = run(scenario)
    assert list(plain.prompt_token_ids) == [] and list(penalised.prompt_token_ids) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (plain.first_token_id, plain.prompt_tokens) == (5, 8)
