"""One request's path through the five processes, segment by segment: where the overhead's milliseconds are.

`benchmarks/overhead.py` says how much of the TTFT is not the stages' compute; this says where it is.
Every process of a fresh cluster writes its marks and compute spans (services/observability/activity.py,
`EPD_ACTIVITY_DIR`): the coordinator's HTTP arrival, each pipeline step's start and end, each role
handler's entry and exit, the engines' thread hand-offs, the store operations, the compute spans.
One-image requests are sent one at a time (the overhead benchmark's workload); the client notes when it
sent each one and when its first token came.  The events between the two, in time order on the machine's
one monotonic clock, are that request's path; the script takes the path most requests followed and prints
the median of each segment between consecutive events, each marked compute (inside a compute span) or
not.  The sum of the medians is not the median TTFT (medians do not add), but each row is that segment's
own typical cost.

Every hop is one whole call on the one path (coordinator -> role -> coordinator), so the path is every
request's: render, encode, prefill and decode in turn, each role's handler between the coordinator's step
start and end.

    python -m benchmarks.request_trace            # 40 requests, tiny model; docs block refreshed
    python -m benchmarks.request_trace --quick    # 6 requests, docs untouched
    python -m benchmarks.request_trace --model demo-medium --requests 20 --no-docs
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import ROOT, machine, replace_block, results_dir, scratch_dir, write_json
from benchmarks.overhead import _bodies, _first_token_s
from benchmarks.procs import Server, running, start_epd

COMPUTE = ("render", "encode", "prefill")
CLIENT_SEND, CLIENT_FIRST = "client.send", "client.first_token"


async def _send(url: str, bodies: list[bytes]) -> list[tuple[int, int]]:
    """(sent, first token) monotonic ns of each request, one at a time."""
    windows = []
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            sent = time.monotonic_ns()
            took = await _first_token_s(session, url, body)
            windows.append((sent, sent + int(took * 1e9)))
    return windows


def events_in(folder: Path) -> list[tuple[int, str]]:
    """Every mark, and each compute span as `<stage>.compute.start` / `.end`, in time order."""
    from services.observability.activity import read_marks, read_spans

    events = [(at, name) for at, name, _ in read_marks(folder)]
    for stage, spans in read_spans(folder).items():
        for start, end in spans:
            events += [(start, f"{stage}.compute.start"), (end, f"{stage}.compute.end")]
    return sorted(events)


def paths(events: list[tuple[int, str]], windows: list[tuple[int, int]]) -> list[list[tuple[int, str]]]:
    """Each request's events between its send and its first token, the two ends included."""
    out = []
    for sent, first in windows:
        inside = [(at, name) for at, name in events if sent <= at <= first]
        out.append([(sent, CLIENT_SEND), *inside, (first, CLIENT_FIRST)])
    return out


def segments(requests: list[list[tuple[int, str]]]) -> dict[str, Any]:
    """The most common path and the median of each of its segments (us); compute rows flagged."""
    shapes = Counter(tuple(name for _, name in path) for path in requests)
    shape, count = shapes.most_common(1)[0]
    chosen = [path for path in requests if tuple(name for _, name in path) == shape]
    rows, open_compute = [], None
    for i in range(1, len(shape)):
        gap = statistics.median((path[i][0] - path[i - 1][0]) / 1e3 for path in chosen)
        start, end = shape[i - 1], shape[i]
        if start.endswith(".compute.start"):
            open_compute = start
        compute = open_compute is not None and end == open_compute.replace(".start", ".end")
        if end.endswith(".compute.end"):
            open_compute = None
        rows.append({"from": start, "to": end, "median_us": gap, "compute": compute})
    ttft = statistics.median((path[-1][0] - path[0][0]) / 1e3 for path in chosen)
    return {"rows": rows, "requests": len(requests), "on_path": count, "ttft_us": ttft,
            "compute_us": sum(r["median_us"] for r in rows if r["compute"]),
            "other_us": sum(r["median_us"] for r in rows if not r["compute"])}


def markdown(result: dict[str, Any], command: str, where: dict[str, Any]) -> str:
    lines = [f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load average at "
             f"start {where['loadavg_at_start']}).", "",
             f"{result['on_path']} of {result['requests']} requests followed the path below; TTFT p50 "
             f"{result['ttft_us'] / 1e3:.2f} ms. Sum of the segments' medians: compute "
             f"{result['compute_us'] / 1e3:.2f} ms, the rest {result['other_us'] / 1e3:.2f} ms.", "",
             "| from | to | median (us) | |", "|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['from']} | {row['to']} | {row['median_us']:,.0f} | "
                     f"{'compute' if row['compute'] else ''} |")
    return "\n".join(lines)


def run(model: str, count: int, warmup: int = 3) -> dict[str, Any]:
    folder = scratch_dir("epd-request-trace-")
    from services.observability.activity import ENV

    with running(start_epd(model, env={ENV: str(folder)})) as (epd,):
        return trace(epd, folder, count, warmup)


def trace(epd: Server, folder: Path, count: int, warmup: int = 3) -> dict[str, Any]:
    """`count` requests (after `warmup`) to a running epd whose activity log goes to `folder`: their segments."""
    bodies = _bodies(epd.model_id(), count + warmup, random.randrange(1 << 30))
    windows = asyncio.run(_send(epd.url, bodies))[warmup:]
    time.sleep(0.2)  # the last marks' lines are on disk (line-buffered) once written; give the writes time
    return segments(paths(events_in(folder), windows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    count = args.requests or (6 if args.quick else 40)
    where = machine()
    result = run(args.model, count)
    command = "python -m benchmarks.request_trace" + ("" if args.model == "demo" else f" --model {args.model}") + (
        f" --requests {args.requests}" if args.requests else "")
    text = markdown(result, command, where)
    print(text)
    name = "request_trace_quick.json" if args.quick else "request_trace.json"
    write_json({**result, "machine": where}, results_dir(args.quick) / name)
    if not (args.quick or args.no_docs) and args.model == "demo" and not args.requests:
        replace_block(ROOT / "docs" / "benchmarks.md", "request-trace", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
