"""Host faults across real hosts, as clients see them: links cut, Redis restarted, a partition (root only).

    python -m benchmarks.multihost_faults            # docs/faults.md's host-faults block
    python -m benchmarks.multihost_faults --quick    # the same, results under a scratch folder, docs untouched

The cluster of tests/e2e/multihost: coordinator, render, two encode, prefill, two decode and Redis, each on its
own host (a network namespace), gRPC with mutual TLS, the redis connectors (tests/support/multihost.py).  Under
`--workers` greedy streams (each with one never-seen image, so every request is encoded), the scenarios of
tests/support/host_faults.py:

1. one decode host's and one encode host's links cut at once for `--cut-s`: requests lost, when the coordinator
   saw each host down, when each was healthy again after its link returned (it was forgotten meanwhile and
   announced itself again) and when it had served a call again;
2. Redis killed and started again (empty) `--redis-away-s` later: requests lost, when the roles and the
   coordinator turned not ready and ready again;
3. prefill partitioned from a decode host: requests lost, calls that decode served meanwhile.

Each scenario runs `--rounds` times (the figures are the worst round).
"""

from __future__ import annotations

import argparse
import asyncio
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
from tests.support import host_faults
from tests.support.multihost import start_multihost


async def measure(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    cuts, restarts, partitions = [], [], []
    for _ in range(args.rounds):
        cuts.append(await host_faults.cut_and_restore(cluster, workers=args.workers, cut_for_s=args.cut_s))
        restarts.append(await host_faults.redis_restart(cluster, away_s=args.redis_away_s, workers=args.workers))
        partitions.append(await host_faults.partition(cluster))
    return {"workers": args.workers, "rounds": args.rounds, "cut": cuts, "redis_restart": restarts,
            "partition": partitions}


def figures(result: dict[str, Any]) -> list[Figure]:
    cuts, restarts, parts = result["cut"], result["redis_restart"], result["partition"]

    def worst(rounds: list[dict[str, Any]], key: str, host: str | None = None) -> float:
        return max(r[key][host] if host else max(r[key].values()) for r in rounds)

    return [
        Figure("requests lost, decode + encode links cut under load", sum(r["lost"] for r in cuts), 0, "eq",
               "count", note=f"{sum(r['requests'] for r in cuts)} requests"),
        Figure("decode streams resumed on the other decode instance", sum(r["resumed_streams"] for r in cuts),
               unit="count", note=f"encode calls failed over: {sum(r['encode_failovers'] for r in cuts):g}"),
        Figure("decode host seen down after its link was cut", 1000 * worst(cuts, "seen_down_s", "decode0"), 1000,
               "le", "ms"),
        Figure("encode host seen down after its link was cut", 1000 * worst(cuts, "seen_down_s", "encode0"), 1000,
               "le", "ms"),
        Figure("decode instance serving again after its link returned", 1000 * worst(cuts, "serving_again_s",
                                                                                       "decode0"), 5000, "le",
               "ms", note="announced itself again, nothing restarted"),
        Figure("encode instance serving again after its link returned", 1000 * worst(cuts, "serving_again_s",
                                                                                       "encode0"), 5000, "le",
               "ms", note="announced itself again, nothing restarted"),
        Figure("requests lost, Redis restarted under load", sum(r["lost"] for r in restarts), 0, "eq", "count",
               note=f"{sum(r['requests'] for r in restarts)} requests, Redis away "
                    f"{restarts[0]['away_s']:g} s"),
        Figure("roles and coordinator not ready after Redis went away", 1000 * worst(restarts, "not_ready_after_s"),
               unit="ms"),
        Figure("ready again after Redis was back", 1000 * worst(restarts, "ready_again_after_s"), unit="ms"),
        Figure("requests lost, prefill partitioned from a decode host", sum(r["lost"] for r in parts), 0, "eq",
               "count", note=f"calls that decode served meanwhile: {sum(r['served_by_decode0'] for r in parts):g}"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=6, help="greedy streams running at once")
    parser.add_argument("--cut-s", type=float, default=4.0, help="how long the links stay cut")
    parser.add_argument("--redis-away-s", type=float, default=3.5, help="how long Redis stays down")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    cluster = start_multihost()
    try:
        result = asyncio.run(measure(cluster, args))
    finally:
        cluster.stop()
    shown = figures(result)
    print_figures(shown, "host faults across network namespaces")
    path = write_json({"result": result, "figures": shown, "machine": machine()},
                      results_dir(args.quick) / "multihost_faults.json")
    print(f"wrote {path}")
    if not args.quick:
        where = machine()
        command = f"python -m benchmarks.multihost_faults --workers {args.workers} --rounds {args.rounds}"
        replace_block(ROOT / "docs" / "faults.md", "host-faults",
                      f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load "
                      f"average {where['loadavg_at_start']}).\n\n{markdown_table(shown)}")


if __name__ == "__main__":
    main()
