"""What one round trip between two processes costs here, hot and after the processes idled.

Why it matters: the orchestration overhead (benchmarks/overhead.py) is mostly four gRPC round trips of a
one-at-a-time request, and each meets roles that sat idle since the last request.  This measures the
floor under those hops, outside epd: a bare grpc.aio unary call (one bytes field, 200 bytes, the
x-request-id metadata epd sends) and, for scale, a plain asyncio TCP echo, each with no pause between
calls ("hot") and after `--idle-ms` of idling before every call (what a request's hop meets).

    python -m benchmarks.hop_latency            # 300 calls per case
    python -m benchmarks.hop_latency --quick    # 40
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

from benchmarks.common import Figure, percentile, print_figures
from services.server import free_port

PAYLOAD = b"x" * 200


async def _grpc_server(port: int) -> None:
    import grpc

    async def echo(request: bytes, context: object) -> bytes:
        return request

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler("bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _tcp_server(port: int) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)

    server = await asyncio.start_server(echo, "127.0.0.1", port)
    await server.serve_forever()


async def _grpc_calls(port: int, count: int, idle_s: float) -> list[float]:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/bench.Echo/Echo")
        for _ in range(50):
            await call(PAYLOAD, timeout=10)
        times = []
        for _ in range(count):
            await asyncio.sleep(idle_s)
            started = time.perf_counter()
            await call(PAYLOAD, timeout=10, metadata=[("x-request-id", "bench")])
            times.append(time.perf_counter() - started)
        return times


async def _tcp_calls(port: int, count: int, idle_s: float) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        times = []
        for index in range(count + 50):
            await asyncio.sleep(idle_s if index >= 50 else 0)
            started = time.perf_counter()
            writer.write(PAYLOAD)
            got = 0
            while got < len(PAYLOAD):
                got += len(await reader.read(65536))
            if index >= 50:
                times.append(time.perf_counter() - started)
        return times
    finally:
        writer.close()


def _measure(kind: str, count: int, idle_s: float) -> float:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.hop_latency", "--serve", kind, str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                calls = _grpc_calls if kind == "grpc" else _tcp_calls
                return percentile(asyncio.run(calls(port, count, idle_s)), 50) * 1e3
            except Exception:  # noqa: BLE001 - refused while the server is still starting (OSError, gRPC UNAVAILABLE)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        server.kill()
        server.wait(10)


def run(count: int, idle_ms: float) -> list[Figure]:
    figures = []
    for kind, label in (("grpc", "grpc.aio unary call"), ("tcp", "asyncio TCP echo")):
        hot, idle = _measure(kind, count, 0.0), _measure(kind, count, idle_ms / 1e3)
        figures.append(Figure(f"{label} round trip p50 after {idle_ms:g} ms idle / hot", idle / hot, None,
                              unit="x", note=f"{idle:.3f} vs {hot:.3f} ms; {count} calls each",
                              detail={"idle_ms": idle, "hot_ms": hot}))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int)
    parser.add_argument("--idle-ms", type=float, default=20.0)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        kind, port = args.serve
        asyncio.run(_grpc_server(int(port)) if kind == "grpc" else _tcp_server(int(port)))
        return 0
    print_figures(run(args.calls or (40 if args.quick else 300), args.idle_ms), "round trip between two processes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
