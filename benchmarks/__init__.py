"""Benchmarks that prove epd's performance claims with numbers anyone can rerun.

Scripts (run from the repository root):

- `python -m benchmarks.vs_transformers_serve`: epd against `transformers serve` on the same
  checkpoint folder, one interleaved run; writes docs/benchmarks.md's side-by-side table and plots.
- `python -m benchmarks.targets`: every target of issue 4, section 4, each printed as a ratio
  measured in one run (`--quick` for the tiny model and a few requests).
- `python -m benchmarks.capacity`: per-stage costs measured in process, the capacity model of
  docs/capacity.md, and its check against a measured cluster run.

Every script has a `--quick` mode that the smoke test (tests/benchmarks/) runs.
"""
