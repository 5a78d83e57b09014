from __future__ import annotations

from PIL import Image

from services.bench.plots import Panel, Series, cdf, nice_ticks, save_figure


def test_nice_ticks_cover_the_range_with_round_steps():
    ticks = nice_ticks(3.2, 47.0)
    assert ticks[0] <= 3.2 and ticks[-1] >= 47.0 and ticks[1] - ticks[0] == 10
    assert nice_ticks(5.0, 5.0)  # a flat range still gets an axis


def test_cdf_and_empty_panels_render(tmp_path):
    series = cdf([float(v) for v in range(1000)], "A")
    assert len(series.xs) == 400 and series.ys[0] == 0.0 and series.ys[-1] == 1.0
    path = tmp_path / "f.png"
    save_figure(str(path), [Panel("t", "x", "y", (series, Series("B", (), ()))), Panel("empty", "x", "y", ())])
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (1040, 380)
