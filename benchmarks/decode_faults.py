"""Decode faults under streaming load, as clients see them: a decode instance killed with SIGKILL mid-stream, and
one poisoned request among many.

    python -m benchmarks.decode_faults            # 16 greedy streams of 64 tokens (docs/faults.md's block)
    python -m benchmarks.decode_faults --quick    # the same, results under a scratch folder, docs untouched

One `epd serve` on the demo model with two decode instances (16 slots each), started with
EPD_FAKE_DECODE_POISON=poison (FAKE: a decode step holding a request whose id names it raises, as a per-request
fault in a step would; services/decode/engine.py).  Three runs of `--streams` concurrent greedy chat streams
(distinct prompts, `--max-tokens` each, ignore_eos):

1. undisturbed: each stream's text;
2. killed: once every stream has `--kill-after` tokens, decode instance 0 gets SIGKILL; each stream must go on
   (resumed on the other instance: coordinator/pipeline.py) with no error event, finish "length", and the text
   of run 1;
3. poisoned: one stream's X-Request-Id names the poison; it alone may fail.

Figures: streams cut, streams whose text differs from run 1, streams resumed (the coordinator's counter), the
longest wait between two events of a resumed stream, and streams failed in the poisoned run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import (
    ROOT,
    Figure,
    machine,
    markdown_table,
    print_figures,
    replace_block,
    results_dir,
    write_json,
)
from tests.support.cluster import RunningCluster, metric_value, start_cluster
from tests.support.faults import StreamLog, coordinator_metrics, kill9, stream_chat
from tests.support.images import chat

POISON = "poison"


@dataclass
class StreamRun:
    logs: list[StreamLog]
    killed_at: float | None = None

    def texts(self) -> list[str]:
        return [text_of(log) for log in self.logs]

    def cut(self) -> int:
        """Streams that did not end as asked: an error event, no finish, or a finish other than length."""
        return sum(1 for log in self.logs if log.error_event() is not None or log.finish_reason() != "length")


def text_of(log: StreamLog) -> str:
    return "".join(e["choices"][0].get("delta", {}).get("content") or "" for _, e in log.events
                   if isinstance(e, dict) and e.get("choices"))


def bodies(count: int, max_tokens: int) -> list[dict[str, Any]]:
    return [chat(f"Story {i}: tell me about a city by the sea, and its {i} bridges.", max_tokens=max_tokens,
                 temperature=0, ignore_eos=True) for i in range(count)]


async def run_streams(url: str, count: int, max_tokens: int, kill: Any = None, kill_after: int = 3,
                      poisoned: int | None = None) -> StreamRun:
    """`count` streams at once; `kill()` once every stream has `kill_after` tokens; stream `poisoned` carries the
    poison in its X-Request-Id."""
    logs = [StreamLog() for _ in range(count)]
    tasks = [asyncio.create_task(stream_chat(url, body, log, timeout_s=120.0,
                                             headers={"X-Request-Id": f"{POISON}-{i}"} if i == poisoned else None))
             for i, (body, log) in enumerate(zip(bodies(count, max_tokens), logs, strict=True))]
    run = StreamRun(logs)
    if kill is not None:
        deadline = time.monotonic() + 60
        while any(log.tokens() < kill_after for log in logs) and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        run.killed_at = time.monotonic()
        await asyncio.to_thread(kill)
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    return run


def longest_gap_ms(run: StreamRun) -> float:
    """The longest wait between two events of any stream that was running when the kill came."""
    gaps = []
    for log in run.logs:
        times = [t for t, _ in log.events]
        if run.killed_at is not None and times and times[-1] > run.killed_at:
            gaps.append(max(b - a for a, b in zip(times, times[1:], strict=False)) if len(times) > 1 else 0.0)
    return 1000 * max(gaps, default=0.0)


def resumed(cluster: RunningCluster) -> float:
    return metric_value(coordinator_metrics(cluster), "epd_coordinator_resumed_streams_total")


def start(streams: int) -> RunningCluster:
    return start_cluster("--decode-instances", "2", "--decode-slots", str(max(16, streams)),
                         "--max-model-len", "1024", "--decode-routing-policy", "round_robin",
                         env={"EPD_FAKE_DECODE_POISON": POISON})


async def measure(cluster: RunningCluster, streams: int, max_tokens: int, kill_after: int) -> dict[str, Any]:
    undisturbed = await run_streams(cluster.url, streams, max_tokens)
    poisoned = await run_streams(cluster.url, streams, max_tokens, poisoned=streams // 2)
    before = resumed(cluster)
    killed = await run_streams(cluster.url, streams, max_tokens, kill=lambda: kill9(cluster, "decode", 0),
                               kill_after=kill_after)
    reference = undisturbed.texts()
    return {"streams": streams, "max_tokens": max_tokens, "kill_after_tokens": kill_after,
            "undisturbed_cut": undisturbed.cut(),
            "killed_cut": killed.cut(),
            "killed_differ": sum(a != b for a, b in zip(killed.texts(), reference, strict=True)),
            "resumed": resumed(cluster) - before,
            "killed_longest_gap_ms": round(longest_gap_ms(killed), 1),
            "poisoned_failed": poisoned.cut(),
            "poisoned_others_differ": sum(a != b for i, (a, b) in enumerate(zip(poisoned.texts(), reference,
                                                                               strict=True)) if i != streams // 2)}


def figures(result: dict[str, Any]) -> list[Figure]:
    return [Figure("streams cut by a decode killed with SIGKILL", result["killed_cut"], 0, "eq", "count"),
            Figure("of those streams, text not the undisturbed run's", result["killed_differ"], 0, "eq", "count"),
            Figure("streams resumed on the other decode instance", result["resumed"], unit="count"),
            Figure("longest gap between two events of a stream live at the kill", result["killed_longest_gap_ms"],
                   unit="ms"),
            Figure("streams failed by one poisoned request", result["poisoned_failed"], 1, "eq", "count"),
            Figure("other streams of the poisoned run whose text changed", result["poisoned_others_differ"], 0, "eq",
                   "count")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kill-after", type=int, default=8, help="tokens every stream has when the kill comes")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cluster = start(args.streams)
    try:
        result = asyncio.run(measure(cluster, args.streams, args.max_tokens, args.kill_after))
    finally:
        cluster.stop()
    shown = figures(result)
    print_figures(shown, "decode faults under streaming load")
    path = write_json({"result": result, "figures": shown}, results_dir(args.quick) / "decode_faults.json")
    print(f"wrote {path}")
    if not args.quick:
        where = machine()
        command = f"python -m benchmarks.decode_faults --streams {args.streams} --max-tokens {args.max_tokens}"
        replace_block(ROOT / "docs" / "faults.md", "decode-faults",
                      f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs).\n\n{markdown_table(shown)}")


if __name__ == "__main__":
    main()
