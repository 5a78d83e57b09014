from __future__ import annotations

from PIL import Image

from services.bench import plots
from services.bench.plots import Panel, cdf, describe, nice_ticks, save_figure

LEFT, TOP, RIGHT, BOTTOM = plots._MARGIN


def test_nice_ticks_cover_the_range_with_round_steps():
    ticks = nice_ticks(3.2, 47.0)
    assert ticks[0] <= 3.2 and ticks[-1] >= 47.0 and ticks[1] - ticks[0] == 10
    assert nice_ticks(5.0, 5.0)  # a flat range still gets an axis


def test_the_cdf_is_an_empirical_step_function():
    series = cdf([3.0, 1.0, 2.0], "A")
    assert series.xs == (1.0, 2.0, 3.0) and series.ys == (1 / 3, 2 / 3, 1.0)
    assert plots._step_points(series.xs, series.ys) == [(1.0, 0.0), (1.0, 0.0), (1.0, 1 / 3), (2.0, 1 / 3),
                                                        (2.0, 2 / 3), (3.0, 2 / 3), (3.0, 1.0)]


def _legend_strip(path, head: int) -> set:
    """The colours of the strip under the first panel's x-axis label, where a legend goes."""
    with Image.open(path) as image:
        box = (LEFT, head + plots._PANEL[1] - BOTTOM + 44, plots._PANEL[0] - RIGHT, head + plots._PANEL[1] - 14)
        return {color for _, color in image.convert("RGB").crop(box).getcolors(1 << 20)}


def test_legend_only_below_the_plot_and_only_for_two_endpoints(tmp_path):
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    a, b = cdf([1.0, 2.0, 5.0], "A (m)"), cdf([2.0, 4.0], "B (m)")
    save_figure(str(one), [Panel("t", "x", "y", (a,), step=True)], title=("title", "load"))
    save_figure(str(two), [Panel("t", "x", "y", (a, b), step=True), Panel("empty", "x", "y", ())],
                title=("title", "load"))
    head = 2 * plots._TITLE_LINE + 12
    assert _legend_strip(one, head) == {(255, 255, 255)}                   # one endpoint: no "A" anywhere
    assert set(plots._COLORS[:2]) <= _legend_strip(two, head)              # two: both keys, under the axis
    with Image.open(two) as image:
        assert image.size == (2 * plots._PANEL[0], plots._PANEL[1] + head)


def test_titles_name_endpoint_model_load_and_requests():
    doc = {"endpoints": {"A": {"url": "http://h:1", "model": "m"}},
           "levels": [{"concurrency": 4, "request_rate": None, "burstiness": 1.0,
                       "results": {"A": {"completed": 9, "failed": 1}}}]}
    assert describe(doc, doc["levels"][0]) == (("epd bench: http://h:1 (model m)", "concurrency 4; n = 10 requests"),
                                               {"A": "A (m)"})
    doc["endpoints"]["B"] = {"url": "http://h:2", "model": "n"}
    doc["levels"][0].update(request_rate=2.0, results={"A": {"completed": 5, "failed": 0},
                                                       "B": {"completed": 5, "failed": 0}})
    assert describe(doc, doc["levels"][0])[0] == (
        "epd bench, A vs B: rate 2/s (burstiness 1), at most 4 in flight; n = 5 requests per endpoint",
        "A: http://h:1 (model m)", "B: http://h:2 (model n)")
