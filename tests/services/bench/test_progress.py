from __future__ import annotations

from services.bench.progress import LineProgress, NoProgress, TqdmProgress, make_progress


def test_progress_kinds(capsys):
    assert isinstance(make_progress(False, 3, "x"), NoProgress)
    assert isinstance(make_progress(True, 3, "x"), TqdmProgress)  # tqdm is installed here
    line = LineProgress(3, "bench")
    for ok in (True, False, True):
        line.update(ok)
    line.close()
    assert "bench: 3/3 done, 1 failed" in capsys.readouterr().err
