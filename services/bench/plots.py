"""PNG figures drawn with Pillow (already a dependency; no matplotlib needed).

latency_cdfs: TTFT, TPOT, ITL and E2E latency CDFs, one line per endpoint.
sweep: request and output throughput and p99 TTFT against concurrency, one
line per endpoint, concurrency levels evenly spaced on the x axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .runner import LevelRun

_COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
_PANEL = (520, 380)
_MARGIN = (70, 40, 20, 50)  # left, top, right, bottom
_CDF_POINTS = 400


@dataclass(frozen=True)
class Series:
    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]


@dataclass(frozen=True)
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    xticks: tuple[tuple[float, str], ...] = ()


def _font(size: int = 13) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        return ImageFont.load_default()


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    if not high > low:
        high = low + 1.0
    raw = (high - low) / count
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    first = math.floor(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 2) if first + i * step <= high + step]


def _bounds(panel: Panel) -> tuple[float, float, float, float]:
    xs = [x for s in panel.series for x in s.xs] or [0.0, 1.0]
    ys = [y for s in panel.series for y in s.ys] or [0.0, 1.0]
    xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(min(0.0, min(ys)), max(ys))
    if panel.xticks:
        return min(p for p, _ in panel.xticks) - 0.5, max(p for p, _ in panel.xticks) + 0.5, yt[0], yt[-1]
    return xt[0], xt[-1], yt[0], yt[-1]


def draw_panel(draw: ImageDraw.ImageDraw, origin: tuple[int, int], panel: Panel) -> None:
    ox, oy = origin
    left, top = ox + _MARGIN[0], oy + _MARGIN[1]
    right, bottom = ox + _PANEL[0] - _MARGIN[2], oy + _PANEL[1] - _MARGIN[3]
    x0, x1, y0, y1 = _bounds(panel)

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    font = _font()
    draw.text((left, oy + 10), panel.title, fill=(0, 0, 0), font=_font(15))
    xticks = panel.xticks or tuple((t, f"{t:g}") for t in nice_ticks(x0, x1) if x0 <= t <= x1)
    for pos, text in xticks:
        px = at(pos, y0)[0]
        draw.line((px, bottom, px, bottom + 4), fill=(0, 0, 0))
        draw.text((px - 3 * len(text), bottom + 6), text, fill=(0, 0, 0), font=font)
    for tick in (t for t in nice_ticks(y0, y1) if y0 <= t <= y1):
        py = at(x0, tick)[1]
        draw.line((left - 4, py, right, py), fill=(225, 225, 225))
        draw.text((ox + 4, py - 7), f"{tick:g}", fill=(0, 0, 0), font=font)
    draw.text(((left + right) / 2 - 3 * len(panel.xlabel), bottom + 24), panel.xlabel, fill=(0, 0, 0), font=font)
    draw.text((left + 4, top + 4), panel.ylabel, fill=(90, 90, 90), font=font)
    draw.rectangle((left, top, right, bottom), outline=(0, 0, 0))
    if panel.series:
        draw.rectangle((right - 136, top + 3, right - 4, top + 20 + 16 * (len(panel.series) - 1)), fill="white")
    for i, series in enumerate(panel.series):
        color = _COLORS[i % len(_COLORS)]
        points = [at(x, y) for x, y in zip(series.xs, series.ys, strict=True)]
        if len(points) > 1:
            draw.line(points, fill=color, width=2)
        for px, py in points if len(points) <= 20 else ():
            draw.ellipse((px - 3, py - 3, px + 3, py + 3), fill=color)
        key_y = top + 12 + 16 * i
        draw.line((right - 130, key_y, right - 112, key_y), fill=color, width=3)
        draw.text((right - 106, key_y - 7), series.label, fill=color, font=font)


def save_figure(path: str, panels: list[Panel], columns: int = 2) -> None:
    rows = math.ceil(len(panels) / columns)
    image = Image.new("RGB", (_PANEL[0] * min(columns, len(panels)), _PANEL[1] * rows), "white")
    draw = ImageDraw.Draw(image)
    for i, panel in enumerate(panels):
        draw_panel(draw, ((i % columns) * _PANEL[0], (i // columns) * _PANEL[1]), panel)
    image.save(path, format="PNG")


def cdf(values_ms: list[float], label: str) -> Series:
    if not values_ms:
        return Series(label, (), ())
    qs = np.linspace(0.0, 100.0, min(_CDF_POINTS, len(values_ms)))
    return Series(label, tuple(float(v) for v in np.percentile(values_ms, qs)), tuple(float(q / 100) for q in qs))


def latency_cdfs(level: LevelRun, path: str) -> None:
    pick = {"TTFT": lambda r: [r.ttft_s], "TPOT": lambda r: [r.tpot_s], "ITL": lambda r: r.itl_s,
            "E2E latency": lambda r: [r.e2el_s]}
    panels = []
    for name, values in pick.items():
        series = tuple(cdf([v * 1000.0 for r in side.results if r.ok for v in values(r) if v is not None], label)
                       for label, side in level.sides.items())
        panels.append(Panel(f"{name} CDF", f"{name} (ms)", "fraction", series))
    save_figure(path, panels)


def sweep(doc: dict[str, Any], path: str) -> None:
    levels = doc["levels"]
    ticks = tuple((float(i), str(level["concurrency"])) for i, level in enumerate(levels))
    figures = (("Request throughput", "req/s", ("request_throughput",)),
               ("Output token throughput", "tok/s", ("output_throughput",)),
               ("p99 TTFT", "ms", ("ttft_ms", "p99")))
    panels = []
    for title, unit, keys in figures:
        series = []
        for label in levels[0]["results"]:
            ys = [_dig(level["results"][label], keys) for level in levels]
            pts = [(float(i), y) for i, y in enumerate(ys) if y is not None]
            series.append(Series(label, tuple(p[0] for p in pts), tuple(p[1] for p in pts)))
        panels.append(Panel(f"{title} vs concurrency", "concurrency", unit, tuple(series), ticks))
    save_figure(path, panels, columns=3)


def _dig(node: Any, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return float(node) if isinstance(node, int | float) else None
