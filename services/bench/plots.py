"""PNG figures drawn with Pillow (already a dependency; no matplotlib needed).

latency_cdfs: TTFT, TPOT, ITL and E2E latency CDFs (empirical, drawn as steps), one line per endpoint.
sweep: request and output throughput and p99 TTFT against concurrency, one line per endpoint,
concurrency levels evenly spaced on the x axis.

Every figure has a title saying what was measured (endpoint, model, load, number of requests); axis
labels and tick labels sit outside the plotting area, the legend below it (never over the data), and a
run against one endpoint has no legend at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .runner import LevelRun

_COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
_PANEL = (560, 400)
_MARGIN = (84, 34, 24, 78)  # left, top, right, bottom (ticks, axis label, legend)
_TITLE_LINE = 22
_BLACK, _GREY, _GRID = (0, 0, 0), (90, 90, 90), (228, 228, 228)


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
    step: bool = False          # an empirical CDF: horizontal then vertical segments, no interpolation


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


def _tick_text(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:g}"


def _vertical_text(image: Image.Image, center: tuple[float, float], text: str, fill: tuple[int, int, int]) -> None:
    font = _font()
    width = int(ImageDraw.Draw(image).textlength(text, font=font)) + 4
    label = Image.new("RGBA", (width, 18), (255, 255, 255, 0))
    ImageDraw.Draw(label).text((2, 1), text, fill=fill, font=font)
    rotated = label.rotate(90, expand=True)
    image.paste(rotated, (int(center[0] - rotated.width / 2), int(center[1] - rotated.height / 2)), rotated)


def _step_points(xs: tuple[float, ...], ys: tuple[float, ...]) -> list[tuple[float, float]]:
    points = [(xs[0], 0.0)] if xs else []
    previous = 0.0
    for x, y in zip(xs, ys, strict=True):
        points += [(x, previous), (x, y)]
        previous = y
    return points


def draw_panel(image: Image.Image, origin: tuple[int, int], panel: Panel, legend: bool = True) -> None:
    draw = ImageDraw.Draw(image)
    ox, oy = origin
    left, top = ox + _MARGIN[0], oy + _MARGIN[1]
    right, bottom = ox + _PANEL[0] - _MARGIN[2], oy + _PANEL[1] - _MARGIN[3]
    x0, x1, y0, y1 = _bounds(panel)

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    font = _font()
    draw.text((left, oy + 8), panel.title, fill=_BLACK, font=_font(15))
    xticks = panel.xticks or tuple((t, _tick_text(t)) for t in nice_ticks(x0, x1) if x0 <= t <= x1)
    for pos, text in xticks:
        px = at(pos, y0)[0]
        draw.line((px, bottom, px, bottom + 4), fill=_BLACK)
        draw.text((px - draw.textlength(text, font=font) / 2, bottom + 6), text, fill=_BLACK, font=font)
    for tick in (t for t in nice_ticks(y0, y1) if y0 <= t <= y1):
        py, text = at(x0, tick)[1], _tick_text(tick)
        draw.line((left, py, right, py), fill=_GRID)
        draw.line((left - 4, py, left, py), fill=_BLACK)
        draw.text((left - 7 - draw.textlength(text, font=font), py - 7), text, fill=_BLACK, font=font)
    draw.text(((left + right - draw.textlength(panel.xlabel, font=font)) / 2, bottom + 24), panel.xlabel,
              fill=_BLACK, font=font)
    _vertical_text(image, (ox + 30, (top + bottom) / 2), panel.ylabel, _BLACK)
    draw.rectangle((left, top, right, bottom), outline=_BLACK)
    for i, series in enumerate(panel.series):
        color = _COLORS[i % len(_COLORS)]
        points = [at(x, y) for x, y in (_step_points(series.xs, series.ys) if panel.step
                                        else zip(series.xs, series.ys, strict=True))]
        if len(points) > 1:
            draw.line(points, fill=color, width=2)
        for px, py in points if not panel.step and len(points) <= 20 else ():
            draw.ellipse((px - 3, py - 3, px + 3, py + 3), fill=color)
    if legend and len(panel.series) > 1:
        _legend(draw, (left, bottom + 46), panel.series, font)


def _legend(draw: ImageDraw.ImageDraw, at: tuple[float, float], series: tuple[Series, ...], font: Any) -> None:
    x, y = at
    for i, s in enumerate(series):
        color = _COLORS[i % len(_COLORS)]
        draw.line((x, y + 7, x + 18, y + 7), fill=color, width=3)
        draw.text((x + 24, y), s.label, fill=color, font=font)
        x += 24 + draw.textlength(s.label, font=font) + 22


def save_figure(path: str, panels: list[Panel], columns: int = 2, title: tuple[str, ...] = ()) -> None:
    rows = math.ceil(len(panels) / columns)
    head = _TITLE_LINE * len(title) + (12 if title else 0)
    image = Image.new("RGB", (_PANEL[0] * min(columns, len(panels)), _PANEL[1] * rows + head), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(title):
        font = _font(16 if i == 0 else 14)
        draw.text(((image.width - draw.textlength(line, font=font)) / 2, 8 + _TITLE_LINE * i), line,
                  fill=_BLACK if i == 0 else _GREY, font=font)
    for i, panel in enumerate(panels):
        draw_panel(image, ((i % columns) * _PANEL[0], head + (i // columns) * _PANEL[1]), panel)
    image.save(path, format="PNG")


def cdf(values_ms: list[float], label: str) -> Series:
    """The empirical CDF: every sorted value with the fraction of values at or below it."""
    ordered = np.sort(np.asarray(values_ms, dtype=float))
    n = len(ordered)
    return Series(label, tuple(float(v) for v in ordered), tuple(float(i / n) for i in range(1, n + 1)))


def latency_cdfs(level: LevelRun, path: str, title: tuple[str, ...] = (),
                 names: dict[str, str] | None = None) -> None:
    """One figure of four CDF panels; `names` turns the endpoint labels (A, B) into legend text."""
    pick = {"TTFT": lambda r: [r.ttft_s], "TPOT": lambda r: [r.tpot_s], "ITL": lambda r: r.itl_s,
            "E2E latency": lambda r: [r.e2el_s]}
    panels = []
    for name, values in pick.items():
        series = tuple(cdf([v * 1000.0 for r in side.results if r.ok for v in values(r) if v is not None],
                           (names or {}).get(label, label)) for label, side in level.sides.items())
        panels.append(Panel(f"{name} CDF", f"{name} (ms)", "fraction of requests" if name != "ITL"
                            else "fraction of token gaps", series, step=True))
    save_figure(path, panels, title=title)


def sweep(doc: dict[str, Any], path: str, title: tuple[str, ...] = (), names: dict[str, str] | None = None) -> None:
    levels = doc["levels"]
    ticks = tuple((float(i), str(level["concurrency"])) for i, level in enumerate(levels))
    figures = (("Request throughput", "requests/s", ("request_throughput",)),
               ("Output token throughput", "output tokens/s", ("output_throughput",)),
               ("p99 TTFT", "p99 TTFT (ms)", ("ttft_ms", "p99")))
    panels = []
    for heading, unit, keys in figures:
        series = []
        for label in levels[0]["results"]:
            ys = [_dig(level["results"][label], keys) for level in levels]
            pts = [(float(i), y) for i, y in enumerate(ys) if y is not None]
            series.append(Series((names or {}).get(label, label), tuple(p[0] for p in pts),
                                 tuple(p[1] for p in pts)))
        panels.append(Panel(f"{heading} vs concurrency", "concurrency", unit, tuple(series), ticks))
    save_figure(path, panels, columns=3, title=title)


def _dig(node: Any, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return float(node) if isinstance(node, int | float) else None


def describe(doc: dict[str, Any], level: dict[str, Any] | None = None) -> tuple[tuple[str, ...], dict[str, str]]:
    """(title lines, legend names) for a figure of `doc`: endpoints, models, load and requests."""
    endpoints = doc["endpoints"]
    names = {label: f"{label} ({ep.get('model') or '?'})" for label, ep in endpoints.items()}
    levels = [level] if level is not None else doc["levels"]
    load = "; ".join(_load_text(lv) for lv in levels) if level is not None else \
        "concurrency " + ", ".join(str(lv["concurrency"]) for lv in levels)
    requests = sorted({s["completed"] + s["failed"] for lv in levels for s in lv["results"].values()})
    n = "/".join(str(r) for r in requests)
    how = f"{load}; n = {n} requests" + (" per endpoint" if len(endpoints) > 1 else "") \
        + (" per level" if level is None and len(levels) > 1 else "")
    if len(endpoints) == 1:
        ep = endpoints["A"]
        return (f"epd bench: {ep['url']} (model {ep.get('model') or '?'})", how), names
    return (f"epd bench, A vs B: {how}", *(f"{label}: {ep['url']} (model {ep.get('model') or '?'})"
                                           for label, ep in endpoints.items())), names


def _load_text(level: dict[str, Any]) -> str:
    if level.get("request_rate"):
        cap = f", at most {level['concurrency']} in flight" if level.get("concurrency") else ""
        return f"rate {level['request_rate']:g}/s (burstiness {level['burstiness']:g}){cap}"
    return f"concurrency {level['concurrency']}"
