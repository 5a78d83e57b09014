"""One hop between two processes on one host, by transport: gRPC over TCP, gRPC over a Unix socket, the fast lane.

Why it matters: a one-at-a-time request crosses four coordinator <-> role hops, each meeting a role that idled
since the last request.  This measures one such hop with a real epd method (DecodeService.Abort behind the real
`rpc_method` wrapper, served by one process on a TCP port, on a Unix socket by grpcio's `unix:` address, and on
the fast lane, services/rpc/fastlane.py), called by the coordinator's own stubs: hot (calls back to back) and
after `--idle-ms` of idling before every call.  The transports alternate round by round, so the machine's
changing speed falls on all three alike.  The fast lane stays beside gRPC only while it beats gRPC over a Unix
socket by >= 1.3x per hop (docs/architecture.md, "The same-host fast lane").

    python -m benchmarks.hop_latency            # 5 rounds x 100 calls per transport and case; docs block
    python -m benchmarks.hop_latency --quick    # 2 x 20, results in a scratch folder, docs untouched
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Figure, percentile, print_figures, results_dir, write_doc_block, write_json
from services.server import free_port

INSTANCE = "hop"
KINDS = ("grpc-tcp", "grpc-unix", "fast-lane")


async def _serve(port: int, unix_path: str) -> None:
    import grpc

    from services.rpc.fastlane_server import FastLaneServer
    from services.rpc.handlers import rpc_method
    from services.rpc.v1 import epd_pb2 as pb
    from services.rpc.v1 import epd_pb2_grpc as rpc

    class Servicer(rpc.DecodeServiceServicer):
        @rpc_method
        async def Abort(self, request: pb.AbortRequest, context: object) -> pb.AbortResponse:
            return pb.AbortResponse(aborted=len(request.request_ids))

    servicer = Servicer()
    server = grpc.aio.server()
    rpc.add_DecodeServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.add_insecure_port(f"unix:{unix_path}")
    await server.start()
    lane = FastLaneServer.from_registration(lambda s: rpc.add_DecodeServiceServicer_to_server(servicer, s), port,
                                            INSTANCE)
    await lane.start()
    await server.wait_for_termination()


async def _calls(port: int, unix_path: str, rounds: int, count: int, idle_s: float) -> dict[str, list[float]]:
    import grpc

    from services.rpc.fastlane_client import with_fast_lane
    from services.rpc.v1 import epd_pb2 as pb
    from services.rpc.v1 import epd_pb2_grpc as rpc

    tcp, unix = grpc.aio.insecure_channel(f"127.0.0.1:{port}"), grpc.aio.insecure_channel(f"unix:{unix_path}")
    stubs = {"grpc-tcp": rpc.DecodeServiceStub(tcp), "grpc-unix": rpc.DecodeServiceStub(unix),
             "fast-lane": with_fast_lane(rpc.DecodeServiceStub(tcp), f"127.0.0.1:{port}", secure=False)}
    request, metadata = pb.AbortRequest(request_ids=["bench-request-0123456789"]), [("x-request-id", "bench")]
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    try:
        for stub in stubs.values():
            for _ in range(30):   # connections open, code paths warm
                await stub.Abort(request, timeout=10, metadata=metadata)
        for _ in range(rounds):
            for kind, stub in stubs.items():
                for _ in range(count):
                    await asyncio.sleep(idle_s)
                    started = time.perf_counter()
                    await stub.Abort(request, timeout=10, metadata=metadata)
                    times[kind].append(time.perf_counter() - started)
        assert stubs["fast-lane"].up(), "the fast lane was not used"
    finally:
        await stubs["fast-lane"].close()
        await tcp.close()
        await unix.close()
    return times


def run(rounds: int, count: int, idle_ms: float) -> tuple[list[Figure], dict[str, dict[str, float]]]:
    folder = Path(tempfile.mkdtemp(prefix="epd-hop-"))
    port, unix_path = free_port(), str(folder / "grpc.sock")
    env = {**os.environ, "EPD_FAST_LANE_DIR": str(folder / "lane")}
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.hop_latency", "--serve", str(port), unix_path],
                              env=env)
    os.environ["EPD_FAST_LANE_DIR"] = env["EPD_FAST_LANE_DIR"]
    try:
        deadline = time.monotonic() + 30
        while not Path(unix_path).exists() or not list((folder / "lane").glob("*.sock")):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the hop server did not start")
            time.sleep(0.1)
        from services import event_loop  # the coordinator's loop

        p50 = {case: {kind: percentile(values, 50) * 1e3 for kind, values in
                      event_loop.run(_calls(port, unix_path, rounds, count, idle)).items()}
               for case, idle in (("hot", 0.0), ("idle", idle_ms / 1e3))}
    finally:
        server.kill()
        server.wait(10)
    figures = []
    for case, label in (("idle", f"after {idle_ms:g} ms idle"), ("hot", "hot")):
        lane, unix, tcp = (p50[case][kind] for kind in ("fast-lane", "grpc-unix", "grpc-tcp"))
        figures.append(Figure(f"hop p50 {label}: gRPC over a Unix socket / the fast lane", unix / lane, 1.3,
                              note=f"{unix:.3f} vs {lane:.3f} ms", detail=p50[case]))
        figures.append(Figure(f"hop p50 {label}: gRPC over TCP / the fast lane", tcp / lane,
                              note=f"{tcp:.3f} vs {lane:.3f} ms", detail=p50[case]))
    return figures, p50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--calls", type=int)
    parser.add_argument("--idle-ms", type=float, default=20.0)
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "UNIX_PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        from services import event_loop

        event_loop.run(_serve(int(args.serve[0]), args.serve[1]), "uvloop")
        return 0
    rounds, count = args.rounds or (2 if args.quick else 5), args.calls or (20 if args.quick else 100)
    figures, p50 = run(rounds, count, args.idle_ms)
    print_figures(figures, "one hop, by transport (p50, ms)")
    write_json({"figures": figures, "p50_ms": p50, "rounds": rounds, "calls": count, "idle_ms": args.idle_ms},
               results_dir(args.quick) / "hop_latency.json")
    if not args.quick:
        write_doc_block("hop-latency", f"python -m benchmarks.hop_latency --rounds {rounds} --calls {count}",
                        figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
