"""Profiles behind the missed targets: py-spy on every epd process, or on an in-process engine.

    python -m benchmarks.profiles overhead   # tiny cluster, one request at a time (the overhead target)
    python -m benchmarks.profiles decode     # the decode engine at 16 streams (the decode-scaling target)

py-spy (pip install py-spy) samples each process without stopping it (`--nonblocking`) and
writes collapsed stacks; `summarize` turns them into the share of samples per function
(inclusive) and per leaf frame (self), optionally only over stacks that pass through one frame
(`focus`, e.g. the decode step).  Raw stacks go to a fresh temporary folder
(printed; $EPD_BENCH_PROFILES_DIR to choose one), summaries to
benchmarks/results/profiles/ (they back docs/benchmarks.md's "why" sections).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, ROOT, scratch_dir

SUMMARIES = RESULTS_DIR / "profiles"


def out_dir() -> Path:
    """Where raw stacks go: $EPD_BENCH_PROFILES_DIR, else a private temporary folder of this run."""
    chosen = os.environ.get("EPD_BENCH_PROFILES_DIR")
    return Path(chosen) if chosen else scratch_dir("epd-bench-profiles-")


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.access(found, os.X_OK):
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    return found


def children(pid: int) -> dict[int, str]:
    """Direct children of `pid` with their command lines, read from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return found


def record(pid: int, seconds: int, out: Path, rate: int = 200) -> subprocess.Popen:
    cmd = [py_spy(), "record", "--nonblocking", "-r", str(rate), "-d", str(seconds), "-f", "raw", "-p", str(pid),
           "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def summarize(path: Path, top: int = 25, skip: tuple[str, ...] = ("select", "wait", "_bootstrap"),
              focus: str | None = None) -> str:
    """Inclusive and self shares of the busiest frames; with `focus`, only stacks through that frame."""
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if focus is not None and focus not in stack:
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        for frame in set(frames):
            inclusive[frame] += n
        leaf[frames[-1]] += n
    lines = [f"{path.name}: {total} samples" + (f" through {focus}" if focus else "")]
    lines += ["  self:"] + [f"    {n / total:6.1%}  {frame}" for frame, n in leaf.most_common(top)]
    busy = [(f, n) for f, n in inclusive.most_common(200) if not any(s in f for s in skip)]
    lines += ["  inclusive:"] + [f"    {n / total:6.1%}  {frame}" for frame, n in busy[:top]]
    return "\n".join(lines)


def profile_overhead(requests: int, seconds: int) -> list[Path]:
    from benchmarks import overhead
    from benchmarks.procs import running, start_epd

    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    with running(start_epd("demo")) as (epd,):
        roles = children(epd.process.pid)
        spies = {pid: record(pid, seconds, out / f"overhead_{cmd.split()[-1]}.txt") for pid, cmd in roles.items()}
        time.sleep(1.0)
        figure = overhead.run(server=epd, count=requests)[0]
        for spy in spies.values():
            spy.wait(timeout=seconds + 60)
    print(figure.name, figure.value, figure.note)
    return [out / f"overhead_{cmd.split()[-1]}.txt" for cmd in roles.values()]


def profile_decode(seconds: int) -> list[Path]:
    folder = out_dir()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "decode_16_streams.txt"
    script = ("from benchmarks.decode_scaling import DecodeSetup, load_engine, run_streams\n"
              "s = DecodeSetup(output_len=256); e = load_engine(s)\n"
              "[print(run_streams(e, s, 16, f'p{i}')) for i in range(3)]\ne.close()\n")
    cmd = [py_spy(), "record", "-r", "200", "-d", str(seconds), "-f", "raw", "-o", str(out), "--",
           sys.executable, "-c", script]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, timeout=seconds + 300)
    return [out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("overhead", "decode"))
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--seconds", type=int, default=45)
    args = parser.parse_args(argv)
    paths = profile_overhead(args.requests, args.seconds) if args.what == "overhead" else profile_decode(args.seconds)
    focus = "DecodeEngine._step" if args.what == "decode" else None
    SUMMARIES.mkdir(parents=True, exist_ok=True)
    for path in paths:
        if path.exists():
            text = summarize(path, focus=focus)
            (SUMMARIES / path.with_suffix(".summary.txt").name).write_text(text + "\n")
            print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
