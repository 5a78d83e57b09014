"""JSON parsing of large bodies that lets other threads run: long strings are lifted out before the parse.

`json.loads` is one C call that holds the GIL from the first byte to the last (a 20 MB features request:
~0.1 s idle, 0.4 s on a loaded machine), so running it in a worker thread still stops the event loop for
all of it.  A multi-MB body is nearly always a few long strings (base64 kwargs_data, data URLs) in a small
skeleton, so `parse_json_large`:

1. finds the body's string literals (windowed `bytes.find`, never one long scan), and lifts out each one
   of at least LONG_STRING bytes whose text is plain ASCII (printable, no backslash: no escapes to
   decode) in favour of a short placeholder naming it;
2. parses the small skeleton with `parse_json` (the same rules, errors and surrogate check);
3. puts each string back as the same `str` json would have built, decoded PIECE bytes at a time.

Every step is short C calls between Python bytecodes, so the interpreter hands the GIL to the loop
between them.  The result equals `parse_json(body)` exactly; any body the scan is unsure of (another
encoding, a BOM, an unterminated string, too many strings, a malformed skeleton) is parsed by
`parse_json` itself, so its error is the usual one.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from services.protocol.errors import InvalidRequest
from services.protocol.parsing import parse_json

LONG_STRING = 64 * 1024      # strings this long (bytes) are lifted out of the parse
PIECE = 256 * 1024           # bytes per C call while scanning, checking and decoding
MAX_STRINGS = 4096           # a body of many strings is parsed as it is (the scan is per string)


def parse_json_large(body: bytes | bytearray) -> Any:
    """`parse_json(body)`, holding the GIL only for short stretches on bodies made of long strings."""
    spans = _long_plain_strings(body)
    if not spans:
        return parse_json(body)
    tag = f"\x00epd-{secrets.token_hex(8)}-"  # in the skeleton as the JSON escape \u0000: no body has it
    skeleton, names = bytearray(), {}
    last = 0
    for n, (start, end) in enumerate(spans):
        name = f"{tag}{n}"
        skeleton += body[last:start]
        skeleton += f'"\\u0000{name[1:]}"'.encode("ascii")
        names[name] = (start + 1, end)
        last = end + 1
    skeleton += body[last:]
    try:
        obj = parse_json(skeleton)
    except InvalidRequest:  # the original body's own error (its positions, its message)
        return parse_json(body)
    return _put_back(obj, {name: _text(body, a, b) for name, (a, b) in names.items()})


def _long_plain_strings(body: bytes | bytearray) -> list[tuple[int, int]]:
    """(opening quote, closing quote) of each long plain string literal; [] when the scan is unsure."""
    if len(body) < LONG_STRING or body[:1] not in b' \t\r\n{["' or body[:3] == b"\xef\xbb\xbf":
        return []  # short, or not UTF-8 JSON text starting as a document (json.loads decides those)
    spans: list[tuple[int, int]] = []
    pos, strings = 0, 0
    while True:
        start = _find_quote(body, pos)
        if start < 0:
            return spans
        end = _closing_quote(body, start + 1)
        strings += 1
        if end < 0 or strings > MAX_STRINGS:
            return []
        if end - start - 1 >= LONG_STRING and _is_plain(body, start + 1, end):
            spans.append((start, end))
        pos = end + 1


def _find_quote(body: bytes | bytearray, pos: int) -> int:
    while pos < len(body):
        found = body.find(b'"', pos, pos + PIECE)
        if found >= 0:
            return found
        pos += PIECE
    return -1


def _closing_quote(body: bytes | bytearray, pos: int) -> int:
    """The quote ending the string whose text starts at `pos` (one not escaped by a backslash)."""
    while True:
        found = _find_quote(body, pos)
        if found < 0:
            return -1
        slashes = 0
        while body[found - 1 - slashes] == 0x5C:
            slashes += 1
        if slashes % 2 == 0:
            return found
        pos = found + 1


def _is_plain(body: bytes | bytearray, start: int, end: int) -> bool:
    """Every byte in [start, end) is printable ASCII (0x20-0x7E) but the backslash: a vectorised min and max
    per PIECE (no copy of the span, unlike a `bytes.translate`), the backslash by `find`."""
    for at in range(start, end, PIECE):
        stop = min(at + PIECE, end)
        piece = np.frombuffer(body, np.uint8, stop - at, at)
        if piece.min() < 0x20 or piece.max() > 0x7E or body.find(b"\\", at, stop) >= 0:
            return False
    return True


def _text(body: bytes | bytearray, start: int, end: int) -> str:
    return "".join(body[at:min(at + PIECE, end)].decode("ascii") for at in range(start, end, PIECE))


def _put_back(obj: Any, texts: dict[str, str]) -> Any:
    """`obj` with every placeholder string (a value or a key) replaced by its text; iterative."""
    if isinstance(obj, str):
        return texts.get(obj, obj)
    todo = [obj]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            for i, value in enumerate(node):
                if isinstance(value, str):
                    if value in texts:
                        node[i] = texts[value]
                elif isinstance(value, (list, dict)):
                    todo.append(value)
        elif isinstance(node, dict):
            if any(key in texts for key in node):
                items = [(texts.get(k, k), v) for k, v in node.items()]
                node.clear()
                node.update(items)
            for key, value in node.items():
                if isinstance(value, str):
                    if value in texts:
                        node[key] = texts[value]
                elif isinstance(value, (list, dict)):
                    todo.append(value)
    return obj
