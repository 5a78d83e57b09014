"""Deadlines that fit serving and size limits before work, on a real (secured) cluster.

- A 3000-token answer completes, streaming and not (no fixed total deadline
  cuts a healthy answer; the tiny demo model with ignore_eos keeps it cheap).
- A client's own total deadline (X-Request-Timeout) cuts its answer; a bad
  value is a 400.
- A body over --max-request-bytes is answered 413 before it is read, whether
  Content-Length says so or the bytes run past the limit; a body trickled at
  one byte per second is answered 408 after --body-read-timeout-s.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests.e2e.conftest import BODY_LIMIT, BODY_READ_S, PUBLIC_KEYS

KEY = PUBLIC_KEYS[0]
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = 3000


def _long_answer(cluster, stream: bool) -> tuple[int, str]:
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": LONG, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    reply = httpx.post(cluster.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=600)
    if not stream:
        return reply.json()["usage"]["completion_tokens"], reply.json()["choices"][0]["finish_reason"]
    events = [json.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: {")]
    assert not any("error" in e for e in events), events[-1]
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    return events[-1]["usage"]["completion_tokens"], finish[-1]


def test_a_3000_token_answer_completes_streaming_and_not(secure_cluster):
    results: dict[bool, tuple[int, str]] = {}
    threads = [threading.Thread(target=lambda s=s: results.__setitem__(s, _long_answer(secure_cluster, s)))
               for s in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert results == {False: (LONG, "length"), True: (LONG, "length")}


def test_a_client_deadline_cuts_its_answer_and_a_bad_one_is_refused(secure_cluster):
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": LONG, "ignore_eos": True,
            "stream": True}
    started = time.monotonic()
    reply = httpx.post(secure_cluster.url + "/v1/chat/completions", json=body, timeout=60,
                       headers={**AUTH, "X-Request-Timeout": "2"})
    elapsed = time.monotonic() - started
    assert elapsed < 20
    if reply.status_code == 200:  # cut mid-stream: an error event, then [DONE]
        # each event parsed: a token's text can hold `"error` too (the random model's, JSON-escaped in a delta)
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        errors = [event["error"] for event in events if "error" in event]
        assert errors and errors[0]["code"] == "deadline_exceeded", reply.text[-500:]
    else:  # no first token within the 2 s (a loaded machine)
        assert reply.status_code == 504 and reply.json()["error"]["code"] == "ttft_timeout", reply.text
    for bad in ("0", "-1", "soon", "nan", "inf"):
        refused = httpx.post(secure_cluster.url + "/v1/chat/completions", json=body, timeout=30,
                             headers={**AUTH, "X-Request-Timeout": bad})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_timeout", bad


def _raw(cluster) -> socket.socket:
    host, port = cluster.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _head(length: int | None) -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: epd\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{size}\r\n").encode()


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the one response on the socket (read until the server closes)."""
    return _answer_after(sock, b"")


def _complete(data: bytes) -> bool:
    """Head and the whole body (per its content-length) are in `data`."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return body.rstrip().endswith(b"}")


def _answer_after(sock: socket.socket, data: bytes) -> tuple[int, dict]:
    """The same, when the first `data` of the answer was read already."""
    while not _complete(data):   # the first read may hold all of it: never wait on a socket for nothing
        try:
            piece = sock.recv(65536)
        except ConnectionResetError:
            break
        if not piece:
            break
        data += piece
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def test_a_declared_oversized_body_is_413_before_it_is_sent(secure_cluster):
    with _raw(secure_cluster) as sock:
        sock.sendall(_head(200 * 1024 * 1024) + b'{"messages": [')  # 200 MB announced, 14 bytes sent
        started = time.monotonic()
        status, body = _answer(sock)
    assert status == 413 and body["error"]["code"] == "body_too_large"
    assert f"over {BODY_LIMIT} bytes" in body["error"]["message"]
    assert time.monotonic() - started < 5


def test_an_undeclared_body_is_cut_at_the_limit(secure_cluster):
    """Chunked, no length: the server stops reading past the limit and answers 413 (or, if the client is
    still sending when it closes, the connection is cut long before the body is all sent)."""
    piece = b"x" * (1024 * 1024)
    sent, cut = 0, False
    with _raw(secure_cluster) as sock:
        sock.sendall(_head(None))
        try:
            while sent < 4 * BODY_LIMIT:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
                if sent > BODY_LIMIT + 2 * len(piece):
                    break  # well past the limit: now listen
        except OSError:
            cut = True
        try:
            status, body = _answer(sock)
        except (OSError, ValueError):
            assert cut and sent < 4 * BODY_LIMIT
            return
    assert status == 413 and body["error"]["code"] == "body_too_large"


def test_a_client_sending_one_byte_per_second_is_dropped(secure_cluster):
    with _raw(secure_cluster) as sock:
        sock.sendall(_head(1000))
        started = time.monotonic()
        sock.settimeout(0.05)
        answer = b""
        while time.monotonic() - started < BODY_READ_S + 10 and not answer:
            try:
                sock.send(b" ")
            except OSError:
                break
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                time.sleep(0.95)
        elapsed = time.monotonic() - started
        if answer:  # the head and the body may come in two segments: read the rest of the one answer
            sock.settimeout(10)
            status, body = _answer_after(sock, answer)
            closed = _closed_within(sock, 3.0)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert status == 408 and body["error"]["code"] == "body_timeout", body
    assert BODY_READ_S - 0.5 <= elapsed < BODY_READ_S + 5
    assert closed, "the server kept the trickling client's connection open after its 408"


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closed the connection (EOF or reset) within `seconds`, sending nothing more."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_the_cluster_still_serves_after_the_limits(secure_cluster):
    reply = httpx.post(secure_cluster.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
