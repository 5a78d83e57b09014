"""Base64 in pieces, so coding MBs in a worker thread never holds the GIL for long.

binascii codes a whole buffer in one C call that holds the GIL (a 20 MB item: tens to hundreds of ms on
a busy machine), so running it in a thread would still stall the event loop for all of it.  Coding
PIECE characters at a time lets the interpreter switch threads between pieces: the loop waits at most
one piece.  `b64decode_strict(text)` is exactly `base64.b64decode(text, validate=True)` (standard
alphabet, padding only at the very end, anything else a binascii.Error; non-ASCII text a ValueError);
`b64encode_text(data)` is exactly `base64.b64encode(data).decode("ascii")`.
"""

from __future__ import annotations

import binascii

PIECE = 256 * 1024  # characters per call (a multiple of 4; 3/4 of it in bytes): ~0.2 ms each when idle


def b64decode_strict(text: str | bytes | bytearray) -> bytes | bytearray:
    """The decoded bytes: `bytes` for a short text, a `bytearray` written in place for a long one (never
    copied whole: no reallocation, no final conversion)."""
    if len(text) <= PIECE:
        return binascii.a2b_base64(_ascii(text), strict_mode=True)
    out = bytearray(len(text) // 4 * 3)
    filled = 0
    for start in range(0, len(text), PIECE):
        piece = _ascii(text[start:start + PIECE])
        if start + PIECE < len(text) and b"=" in piece:
            raise binascii.Error("Discontinuous padding not allowed")  # padding before the end
        decoded = binascii.a2b_base64(piece, strict_mode=True)
        out[filled:filled + len(decoded)] = decoded
        filled += len(decoded)
    del out[filled:]  # the padding's bytes (at most 2)
    return out


def b64encode_text(data: bytes | bytearray | memoryview) -> str:
    step = PIECE // 4 * 3
    view = memoryview(data).cast("B")
    return "".join(binascii.b2a_base64(view[at:at + step], newline=False).decode("ascii")
                   for at in range(0, len(view), step))


def _ascii(text: str | bytes | bytearray) -> bytes | bytearray:
    return text.encode("ascii") if isinstance(text, str) else text
