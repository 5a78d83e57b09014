"""A weight update under load (issue 40): POST /update_weights on the medium model while 8 clients keep asking.

    python -m benchmarks.weight_update            # medium demo, c=8, one 224x224 image per request, 64 tokens
    python -m benchmarks.weight_update --quick    # tiny demo, c=4, 16 tokens
    python -m benchmarks.weight_update --baseline REF   # the same scenario on epd at REF first; ratios per role

One `epd serve` on the demo checkpoint.  A greedy n=1 request (with an image) is answered before anything else;
then 8 clients post chat requests back to back (an image each, 64 greedy tokens, ignore_eos) and, once the
load has run for `--warm-s`, the admin API gets POST /update_weights with the same checkpoint folder (the
same weights under a new version).  The load goes on for `--after-s` more.  Figures:

- requests failed (any status but 200, or an error body): target 0;
- requests that ran stages on two versions: answers whose `weight_versions` hold more than one span, or whose
  version is neither the old nor the new one, plus the coordinator's `epd_coordinator_weight_version_mixed`
  (a stage answering with other weights fails the request instead): target 0;
- seconds from the POST until every instance of each role served the new version (the update's own report:
  stage = load, check and build beside the served weights; then the old version drains and all commit);
- the greedy n=1 answer after the update, token for token the one before: target identical.

Writes benchmarks/results/weight_update.json and the `weight-update` block of docs/benchmarks.md (unless --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any, cast

import aiohttp
import httpx

from benchmarks.common import ROOT, Figure, machine, print_figures, results_dir, write_doc_block, write_json
from benchmarks.procs import exit_on_sigterm, metric_sum, start_epd


def body(index: int, tokens: int, image: bool = True) -> dict[str, Any]:
    import numpy as np

    from services.bench.images import encode_data_url
    from tests.support.images import noise_image

    content: list[dict[str, Any]] = [{"type": "text", "text": f"Request {index}: what is in the picture?"}]
    if image:
        url = encode_data_url(np.asarray(noise_image(224, 224, 5000 + index % 16)), "png")
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


async def load(url: str, tokens: int, stop: asyncio.Event, out: list[dict[str, Any]], worker: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        index = worker * 100000
        while not stop.is_set():
            index += 1
            started = time.monotonic()
            try:
                async with session.post(url + "/v1/chat/completions", json=body(index, tokens)) as reply:
                    answer = await reply.json(content_type=None)
                    status = reply.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                answer, status = {"error": str(exc)}, 0
            out.append({"started": started, "ended": time.monotonic(), "status": status, "answer": answer})


def spans(answer: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return [choice.get("weight_versions") or [] for choice in answer.get("choices") or []]


async def scenario(url: str, admin: str, folder: str, tokens: int, clients: int, warm_s: float,
                   after_s: float) -> dict[str, Any]:
    stop, results = asyncio.Event(), cast(list[dict[str, Any]], [])
    workers = [asyncio.create_task(load(url, tokens, stop, results, w)) for w in range(clients)]
    await asyncio.sleep(warm_s)
    posted = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session, \
            session.post(admin + "/update_weights", json={"path": folder}) as reply:
        report = await reply.json()
        if reply.status != 200:
            raise RuntimeError(f"update failed: {reply.status} {report}")
    switched = time.monotonic()
    await asyncio.sleep(after_s)
    stop.set()
    await asyncio.gather(*workers)
    return {"posted": posted, "switched": switched, "report": report, "results": results}


def judge(run: dict[str, Any]) -> dict[str, Any]:
    report, results = run["report"], run["results"]
    versions = {report["previous"], report["weight_version"]}
    failed = [r for r in results if r["status"] != 200 or "error" in r["answer"]]
    mixed = [r for r in results if r["status"] == 200 and any(
        len(s) != 1 or s[0]["version"] not in versions for s in spans(r["answer"]))]
    after = [r for r in results if r["started"] > run["switched"] and r["status"] == 200]
    stale = [r for r in after if any(s and s[0]["version"] != report["weight_version"] for s in spans(r["answer"]))]
    return {"requests": len(results), "failed": len(failed), "failures": [
                {"status": r["status"], "answer": str(r["answer"])[:300]} for r in failed[:5]],
            "mixed_answers": len(mixed),
            "started_after_switch": len(after), "old_version_after_switch": len(stale),
            "during_update": sum(1 for r in results if r["started"] < run["switched"] and r["ended"] > run["posted"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clients", type=int, default=None)
    parser.add_argument("--warm-s", type=float, default=20.0)
    parser.add_argument("--after-s", type=float, default=20.0)
    parser.add_argument("--baseline", default="", help="a git ref of epd to run the same scenario on first: each "
                                                       "role's seconds to the new version, this tree / that one")
    args = parser.parse_args()
    exit_on_sigterm()
    from services.models.demo import demo_model_path

    model = "tiny" if args.quick else "medium"
    clients = args.clients or (4 if args.quick else 8)
    tokens = 16 if args.quick else 64
    folder = str(demo_model_path(model))
    where = machine()
    other = None
    if args.baseline:
        from benchmarks.open_loop import _tree_with_kernels

        other = side(folder, tokens, clients, args.warm_s, args.after_s, _tree_with_kernels(args.baseline))
    run = side(folder, tokens, clients, args.warm_s, args.after_s)
    verdict, report = run["verdict"], run["report"]
    before_ids, after_ids = greedy_ids(run["before"]), greedy_ids(run["after"])
    same = before_ids is not None and before_ids == after_ids
    mixed_metric = run["mixed_metric"]
    figures = [
        Figure(f"requests failed, weight update on the {model} model under c={clients} load", verdict["failed"], 0,
               "eq", "count", note=f"{verdict['requests']} requests, {verdict['during_update']} in flight during "
                                   "the update"),
        Figure("requests that ran stages on two versions", verdict["mixed_answers"] + mixed_metric, 0, "eq", "count",
               note=f"answers with other than one span: {verdict['mixed_answers']}; coordinator's "
                    f"weight_version_mixed: {mixed_metric:g}; old version after the switch: "
                    f"{verdict['old_version_after_switch']} of {verdict['started_after_switch']}"),
        *[Figure(f"seconds from POST /update_weights to every {role} instance serving the new version", seconds,
                 unit="s", note=f"stage {report['stage_s'][role]:.1f} s; drain {report['drain_s']:.2f} s")
          for role, seconds in sorted(report["serving_after_s"].items())],
        Figure("greedy n=1 answer after an update to the same weights: identical", 1.0 if same else 0.0, 1.0, "eq",
               "count", note=f"{len(before_ids or [])} tokens" if after_ids is not None else f"after: {run['after']}"),
    ]
    if other is not None:
        base = other["report"]
        figures += [Figure(f"{role} stage, this tree / epd@{args.baseline}", seconds / base["stage_s"][role],
                           unit="x", note=f"{seconds:.1f} vs {base['stage_s'][role]:.1f} s")
                    for role, seconds in sorted(report["stage_s"].items()) if base["stage_s"].get(role)]
        figures.append(Figure(f"seconds to every instance on the new version, this tree / epd@{args.baseline}",
                              max(report["serving_after_s"].values()) / max(base["serving_after_s"].values()),
                              unit="x", note=f"{max(report['serving_after_s'].values()):.1f} vs "
                                             f"{max(base['serving_after_s'].values()):.1f} s; baseline failed "
                                             f"{other['verdict']['failed']} of {other['verdict']['requests']}"))
    for figure in figures:
        figure.detail["measured"] = {"time": where["time"], "loadavg": where["loadavg_at_start"]}
    print_figures(figures, "weight update under load")
    slim = {k: v for k, v in run.items() if k != "results"}
    baseline = {"ref": args.baseline, **{k: v for k, v in other.items() if k != "results"}} if other else None
    path = write_json({"machine": where, "model": model, "clients": clients, "tokens": tokens, "figures": figures,
                       **slim, "baseline": baseline}, results_dir(args.quick) / "weight_update.json")
    print(f"wrote {path}")
    if not args.quick:
        command = "python -m benchmarks.weight_update" + (f" --baseline {args.baseline}" if args.baseline else "")
        write_doc_block("weight-update", command, figures,
                        "Machine shared with other agents' jobs (load average above).")


def side(folder: str, tokens: int, clients: int, warm_s: float, after_s: float, root: Path = ROOT) -> dict[str, Any]:
    """One `epd serve` from the tree at `root`: the greedy answer, the update under load, the greedy answer again."""
    server = start_epd(folder, "--decode-slots", "16", timeout_s=1800, root=root)
    try:
        admin = _admin_url(server.log_tail(400))
        before = httpx.post(server.url + "/v1/chat/completions", json=body(-1, 32), timeout=1800).json()
        run = asyncio.run(scenario(server.url, admin, folder, tokens, clients, warm_s, after_s))
        after = httpx.post(server.url + "/v1/chat/completions", json=body(-1, 32), timeout=1800).json()
        mixed_metric = metric_sum(server.metrics(), "epd_coordinator_weight_version_mixed_total")
    finally:
        server.stop()
    return {**run, "verdict": judge(run), "before": before, "after": after, "mixed_metric": mixed_metric}


def greedy_ids(answer: dict[str, Any]) -> list[int] | None:
    choices = answer.get("choices")
    return choices[0]["token_ids"] if choices else None


def _admin_url(log: str) -> str:
    import re

    match = re.search(r"; admin (http://[0-9.:]+)", log)   # the ready line (services/runtime/launch.py print_ready)
    if match is None:
        raise RuntimeError("no admin URL in epd serve's output")
    return match.group(1)


if __name__ == "__main__":
    main()
