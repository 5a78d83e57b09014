"""Idle keep-alive connections outlive the idle time of client pools (services/edge/http_api.py KEEP_ALIVE_S).

uvicorn closes an idle connection after 5 s by default; a client pool (vllm bench serve keeps them 60 s) that
sends its next request on one just as the server closes it gets "server disconnected".  Each server here keeps a
connection open after an idle time past uvicorn's default and answers the next request on it."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

IDLE_S = 6.5   # past uvicorn's default 5 s


def _get(sock: socket.socket, host: str) -> bytes:
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        piece = sock.recv(65536)
        if not piece:
            return answer   # the server closed the connection
        answer += piece
    return answer


def test_an_idle_connection_stays_open_past_uvicorns_default(shm_cluster):
    urls = [shm_cluster.url, shm_cluster.http_urls("render")[0], shm_cluster.http_urls("decode")[0]]
    sockets = []
    for url in urls:
        parts = urlsplit(url)
        sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        sockets.append((sock, parts.netloc))
        assert _get(sock, parts.netloc).startswith(b"HTTP/1.1 200"), url
    time.sleep(IDLE_S)
    for (sock, host), url in zip(sockets, urls, strict=True):
        with sock:
            assert _get(sock, host).startswith(b"HTTP/1.1 200"), url   # the same connection, still open
