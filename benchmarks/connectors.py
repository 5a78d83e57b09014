"""Connector bandwidth: 16 MiB put + get through the shm and redis stores against their baselines.

- shm: `put` (one copy into the producer's reused, pre-faulted pool) + `get` (one verified copy
  out, by handle, in a consumer store) against an in-process `copy_` into a preallocated
  buffer.  `put` + `view` (the zero-copy read) is reported next to it.
- redis: the same put + get against `redis-benchmark` SET + GET of the same value size on the
  same server, one client, no pipelining (`-c 1 -P 1`); without redis-benchmark on PATH, against
  the same SET + GET sent from a raw socket (benchmarks/resp_baseline.py; the figure says which).

Each figure is the median of `repeats` timed rounds after warm-up rounds.  Bandwidth ratio =
baseline time / our time (higher is better), so 0.5 means half the baseline's bandwidth.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.common import Figure, median, print_figures
from benchmarks.procs import start_redis, stop_process
from benchmarks.resp_baseline import baseline_seconds

MIB = 1 << 20


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds of each function, timed in turn within every round: on a shared, noisy machine
    this puts the same conditions under the figure and its baseline."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - started)
    return {name: median(values) for name, values in samples.items()}


def _payload(nbytes: int) -> Any:
    import torch

    return torch.randn(nbytes // 4, dtype=torch.float32)


def _stores(backend: str, nbytes: int, redis_url: str | None) -> tuple[Any, Any]:
    from services.connectors import StoreConfig, create_store

    tag = uuid.uuid4().hex[:8]
    capacity = 8 * nbytes + 64 * MIB
    producer = create_store(StoreConfig(backend, "kv", f"bench{tag}p", capacity, redis_url=redis_url))
    consumer = create_store(StoreConfig(backend, "kv", f"bench{tag}c", capacity, redis_url=redis_url,
                                        preallocate=False))
    return producer, consumer


def store_seconds(backend: str, nbytes: int, repeats: int, redis_url: str | None = None) -> dict[str, float]:
    """Median seconds of put, get, view and put+get of one `nbytes` entry (producer and consumer
    stores as in a cluster), and of the baseline in-process copy into a preallocated buffer."""
    tensor = _payload(nbytes)
    target = tensor.clone()
    producer, consumer = _stores(backend, nbytes, redis_url)
    try:
        handle = producer.put("bench", {"kv": tensor})

        def put() -> None:
            nonlocal handle
            handle = producer.put("bench", {"kv": tensor})

        def view() -> None:
            with consumer.view(handle) as views:
                views["kv"].view(-1)[0].item()

        return interleaved({"copy": lambda: target.copy_(tensor), "put": put, "get": lambda: consumer.get(handle),
                            "view": view, "put_get": lambda: (put(), consumer.get(handle))}, repeats)
    finally:
        consumer.close()
        producer.close()


def shm_figure(nbytes: int, repeats: int) -> Figure:
    shm = store_seconds("shm", nbytes, repeats)
    copy_s = shm["copy"]
    detail = {"bytes": nbytes, **{f"{k}_ms": v * 1e3 for k, v in shm.items()},
              "copy_gbps": nbytes / copy_s / 1e9, "put_get_gbps": nbytes / shm["put_get"] / 1e9,
              "put_view_ratio": copy_s / (shm["put"] + shm["view"])}
    return Figure(f"shm connector {nbytes // MIB} MiB put+get vs in-process copy (bandwidth)",
                  copy_s / shm["put_get"], 0.5, "ge", detail=detail,
                  note=f"put {shm['put'] * 1e3:.2f} + get {shm['get'] * 1e3:.2f} ms vs copy "
                       f"{copy_s * 1e3:.2f} ms; put+view (zero-copy read) {detail['put_view_ratio']:.2f}x")


def redis_figure(nbytes: int, repeats: int) -> Figure:
    process, port = start_redis()
    try:
        which, baseline = baseline_seconds(port, nbytes, max(repeats, 5 if repeats < 10 else 30))
        ours = store_seconds("redis", nbytes, repeats, redis_url=f"redis://127.0.0.1:{port}/0")
    finally:
        stop_process(process)
    base_s = baseline["set_s"] + baseline["get_s"]
    detail = {"bytes": nbytes, "baseline": which, **{f"ours_{k}_ms": v * 1e3 for k, v in ours.items()},
              "baseline_set_ms": baseline["set_s"] * 1e3, "baseline_get_ms": baseline["get_s"] * 1e3}
    return Figure(f"redis connector {nbytes // MIB} MiB put+get vs {which} SET+GET", base_s / ours["put_get"], 0.5,
                  "ge", detail=detail,
                  note=f"put {ours['put'] * 1e3:.1f} + get {ours['get'] * 1e3:.1f} ms vs SET "
                       f"{baseline['set_s'] * 1e3:.1f} + GET {baseline['get_s'] * 1e3:.1f} ms")


def run(quick: bool = False) -> list[Figure]:
    nbytes = 16 * MIB
    repeats = 3 if quick else 30
    return [shm_figure(nbytes, repeats), redis_figure(nbytes, repeats)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv)
    print_figures(run(args.quick), "connectors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
