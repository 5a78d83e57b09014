"""One Redis vs a 3-node Redis Cluster under the redis connectors, side by side on this machine.

    python -m benchmarks.redis_cluster            # docs/benchmarks.md's redis-cluster block
    python -m benchmarks.redis_cluster --quick    # fewer rounds, results under a scratch folder, docs untouched

1. EC put + get bandwidth: an encoder-sized entry (`--mib` MiB, one embedding tensor) put by a producer store
   and read back by a consumer store, `--threads` producer/consumer pairs at once (distinct keys: on the cluster
   they spread over the nodes), each figure the median of rounds alternating one Redis and the cluster;
2. TTFT of one-image chat requests (a never-seen image each, so each is encoded, prefilled, decoded through
   the store) against two `epd serve` clusters of the demo model, one per backend, started side by side and asked
   in turn;
3. one of the cluster's three nodes killed under load: requests that failed (the target is none: its entries
   become typed misses, encoded or prefilled again).

The machine has 2 cores shared with other jobs: the three nodes, both clusters and the client share them, so the
cluster cannot show more bandwidth than one server here; what it shows is what spreading costs and that it
holds up when a node goes.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from typing import Any

from benchmarks.common import Figure, median, print_figures, results_dir, write_doc_block, write_json
from tests.support.cluster import start_cluster
from tests.support.faults import LoadRun
from tests.support.images import chat, noise_image
from tests.support.redis_cluster import RedisClusterNodes
from tests.support.redis_server import RedisServer

MIB = 1 << 20


def _pairs(url: str, threads: int, nbytes: int) -> list[tuple[Any, Any]]:
    from services.connectors import StoreConfig, create_store

    def store(tag: str, producer: bool) -> Any:
        return create_store(StoreConfig("redis", "ec", tag, capacity_bytes=16 * nbytes + 64 * MIB, redis_url=url,
                                        preallocate=producer))

    return [(store(f"bp{uuid.uuid4().hex[:8]}", True), store(f"bc{uuid.uuid4().hex[:8]}", False))
            for _ in range(threads)]


def put_get_seconds(pairs: list[tuple[Any, Any]], tensor: Any, entries: int) -> float:
    """Wall time for every pair to put and get back `entries` entries, all pairs at once."""
    def run(producer: Any, consumer: Any) -> None:
        for i in range(entries):
            handle = producer.put(f"emb-{uuid.uuid4().hex}-{i}", {"embedding": tensor})
            consumer.get(handle)
            producer.delete(handle["key"])

    workers = [threading.Thread(target=run, args=pair) for pair in pairs]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - started


def bandwidth(urls: dict[str, str], mib: int, threads: int, entries: int, rounds: int) -> dict[str, float]:
    """MB/s of put + get (bytes moved both ways over the time) per backend, median of alternating rounds."""
    import torch

    tensor = torch.randn(mib * MIB // 4)
    pairs = {name: _pairs(url, threads, mib * MIB) for name, url in urls.items()}
    samples: dict[str, list[float]] = {name: [] for name in urls}
    try:
        for name in urls:   # warm-up: connections, allocator
            put_get_seconds(pairs[name], tensor, 2)
        for _ in range(rounds):
            for name in urls:
                seconds = put_get_seconds(pairs[name], tensor, entries)
                samples[name].append(2 * threads * entries * mib * MIB / seconds / 1e6)
    finally:
        for producer, consumer in (p for ps in pairs.values() for p in ps):
            producer.close()
            consumer.close()
    return {name: median(values) for name, values in samples.items()}


async def ttfts(urls: dict[str, str], count: int) -> dict[str, list[float]]:
    import aiohttp

    got: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for i in range(count):
            for name, url in urls.items():   # alternating: the same moment of the machine for both
                body = {**chat("What is in it?", [noise_image(64, 64, 5000 + 2 * i + (name == "cluster"))],
                               max_tokens=4, temperature=0), "stream": True}
                started = time.perf_counter()
                first: list[float] = []

                async with session.post(url + "/v1/chat/completions", json=body) as reply:
                    async for raw in reply.content:
                        if raw.startswith(b"data: {") and not first:
                            first.append(time.perf_counter() - started)
                got[name] += first
    return got


def node_loss(nodes: RedisClusterNodes, url: str, requests: int) -> dict[str, Any]:
    bodies = [chat(f"Picture {i}?", [noise_image(48, 48, 6000 + i % 10)], max_tokens=3) for i in range(requests)]

    async def kill() -> None:
        await asyncio.to_thread(nodes.kill, nodes.ports[0])

    results = asyncio.run(LoadRun(url, bodies, concurrency=4, hooks={requests // 3: kill}).run())
    return {"requests": len(results), "failed": sum(r.status != 200 for r in results),
            "statuses": sorted({r.status for r in results})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=4, help="size of one embedding entry")
    parser.add_argument("--threads", type=int, default=3, help="producer/consumer pairs at once")
    parser.add_argument("--entries", type=int, default=8, help="entries per pair per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=24, help="TTFT requests per backend")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.entries = 2, 4, 2
    single, nodes = RedisServer().start(), RedisClusterNodes(3).start()
    urls = {"one Redis": single.url, "cluster": nodes.url}
    servers: dict[str, Any] = {}
    try:
        rates = bandwidth(urls, args.mib, args.threads, args.entries, args.rounds)
        for name, url in urls.items():
            servers[name] = start_cluster("--ec-connector", "redis", "--kv-connector", "redis", "--redis-url", url,
                                          "--max-model-len", "1024", "--ec-capacity-mb", "64",
                                          "--kv-capacity-mb", "64")
        times = asyncio.run(ttfts({n: s.url for n, s in servers.items()}, args.requests))
        loss = node_loss(nodes, servers["cluster"].url, 30 if args.quick else 90)
    finally:
        for server in servers.values():
            server.stop()
        single.cleanup()
        nodes.cleanup()
    ttft = {name: 1000 * median(values) for name, values in times.items()}
    shown = [
        Figure(f"EC put + get, one Redis ({args.mib} MiB entries, {args.threads} at once)", rates["one Redis"],
               unit="MB/s"),
        Figure(f"EC put + get, 3-node Redis Cluster ({args.mib} MiB entries, {args.threads} at once)",
               rates["cluster"], unit="MB/s"),
        Figure("EC bandwidth, cluster / one Redis", rates["cluster"] / rates["one Redis"], unit="x"),
        Figure("TTFT, one image, one Redis (median)", ttft["one Redis"], unit="ms"),
        Figure("TTFT, one image, 3-node Redis Cluster (median)", ttft["cluster"], unit="ms"),
        Figure("requests failed when a cluster node was killed under load", loss["failed"], 0, "eq", "count",
               note=f"{loss['requests']} requests"),
    ]
    print_figures(shown, "one Redis vs a 3-node Redis Cluster")
    path = write_json({"args": vars(args), "bandwidth_mb_s": rates, "ttft_ms": times, "node_loss": loss,
                       "figures": shown}, results_dir(args.quick) / "redis_cluster.json")
    print(f"wrote {path}")
    if not args.quick:
        command = (f"python -m benchmarks.redis_cluster --mib {args.mib} --threads {args.threads} "
                   f"--rounds {args.rounds} --requests {args.requests}")
        write_doc_block("redis-cluster", command, shown)


if __name__ == "__main__":
    main()
