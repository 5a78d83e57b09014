"""Incremental server-sent-events decoder: bytes in, `data` payloads out.

Follows the SSE rules that matter for OpenAI streams: lines end in \\n, \\r\\n
or \\r; an event ends at a blank line; several `data:` lines of one event join
with \\n; lines starting with ':' are comments; other fields are ignored.
Bytes may split anywhere, including inside a UTF-8 character.
"""

from __future__ import annotations


class SseDecoder:
    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Add bytes; return the data of every event completed by them."""
        self._buffer += chunk
        events: list[str] = []
        while True:
            line, found = self._next_line()
            if not found:
                return events
            self._take_line(line, events)

    def close(self) -> list[str]:
        """End of stream: a last event without its closing blank line still counts."""
        events: list[str] = []
        if self._buffer:
            self._take_line(self._buffer.rstrip(b"\r"), events)
            self._buffer = b""
        self._take_line(b"", events)
        return events

    def _next_line(self) -> tuple[bytes, bool]:
        buf = self._buffer
        cut = buf.find(b"\n")
        cr = buf.find(b"\r", 0, cut if cut >= 0 else len(buf))
        if cr >= 0:
            if cr == len(buf) - 1:  # maybe the first half of \r\n: wait for the next byte
                return b"", False
            end = cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
            self._buffer = buf[end:]
            return buf[:cr], True
        if cut < 0:
            return b"", False
        self._buffer = buf[cut + 1 :]
        return buf[:cut], True

    def _take_line(self, line: bytes, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(b":"):
            return
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value[1:].decode() if value.startswith(b" ") else value.decode())
