"""Base64 on render's and the coordinator's request path: pybase64 (services/protocol/b64.py) vs binascii.

A 1024x768 JPEG as a data URL (render decodes it) and a 1024x768 image's 4.7 MB of uint8 patches (render's
HTTP answer and features requests carry them base64-encoded), each coded both ways in one run, rounds
alternating.

    python -m benchmarks.b64_codec           # 30 rounds
    python -m benchmarks.b64_codec --quick   # 3
"""

from __future__ import annotations

import argparse
import base64
import binascii
import io
import time

import numpy as np

from benchmarks.common import Figure, percentile, print_figures
from services.protocol.b64 import b64decode_strict, b64encode_text


def _jpeg(width: int = 1024, height: int = 768) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(0).random((height, width, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _ms(fn, arg) -> float:
    started = time.perf_counter()
    fn(arg)
    return (time.perf_counter() - started) * 1e3


def run(rounds: int) -> list[Figure]:
    jpeg = _jpeg()
    text = base64.b64encode(jpeg).decode()
    patches = np.random.default_rng(1).integers(0, 255, (3996, 1176), dtype=np.uint8).tobytes()
    assert b64decode_strict(text) == jpeg and b64encode_text(patches) == base64.b64encode(patches).decode()
    cases = {
        "decode": (b64decode_strict, lambda t: binascii.a2b_base64(t.encode("ascii"), strict_mode=True), text,
                   f"a 1024x768 JPEG's data URL ({len(text) / 1e6:.2f} MB of base64)"),
        "encode": (b64encode_text, lambda d: binascii.b2a_base64(d, newline=False).decode("ascii"), patches,
                   f"a 1024x768 image's uint8 patches ({len(patches) / 1e6:.1f} MB)"),
    }
    figures = []
    for name, (ours, theirs, arg, what) in cases.items():
        a, b = [], []
        for index in range(rounds):
            pair = ((a, ours), (b, theirs)) if index % 2 == 0 else ((b, theirs), (a, ours))
            for times, fn in pair:
                times.append(_ms(fn, arg))
        pa, pb = percentile(a, 50), percentile(b, 50)
        figures.append(Figure(f"base64 {name} of {what}, pybase64 / binascii", pa / pb, None, unit="x",
                              note=f"{pa:.3f} vs {pb:.3f} ms p50; {rounds} rounds alternating",
                              detail={"pybase64_ms": pa, "binascii_ms": pb}))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print_figures(run(3 if args.quick else 30), "base64 codec")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
