"""Role CPU policy: threads, OpenMP wait policy and niceness, applied in a real child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.config import ConfigError, EpdConfig
from services.hostcpu import role_cpu
from services.hostcpu.role_cpu import role_values

PROBE = """
import json, os, sys
from services.config import EpdConfig
from services.hostcpu.role_cpu import apply
config = EpdConfig.of(role_threads=sys.argv[1], role_nice=sys.argv[3], single_omp_team=sys.argv[5])
before = os.nice(0)
summary = apply(config, sys.argv[4])
import threading
import torch
from services.hostcpu import compute_threads
compute_threads.single()   # as role_main does for the main thread
engine = []
thread = threading.Thread(target=lambda: engine.append(compute_threads.enter()))
thread.start(); thread.join()
helper = compute_threads.helper_executor(1) if os.environ.get("EPD_COMPUTE_THREADS") else None
helper_threads = helper.submit(torch.get_num_threads).result() if helper else None   # after enter() set 2
# "/autogroup-N nice K"; empty where the process is in the kernel's default group (no setsid since boot)
group = (open("/proc/self/autogroup").read().split() or [None])[-1] if os.path.exists("/proc/self/autogroup") else None
print(json.dumps({"threads": engine[0], "main": torch.get_num_threads(), "helper": helper_threads,
                  "long": compute_threads.count(long=True),
                  "nice": os.nice(0) - before, "autogroup": group,
                  "summary": summary, "wait": os.environ.get("OMP_WAIT_POLICY"),
                  "spin": os.environ.get("GOMP_SPINCOUNT")}))
"""


def _probe(threads: str, wait: str, nice: str, role: str, serve_child: bool = False, team: str = "on",
           omp: str = "", session: bool = False) -> dict:
    skip = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "EPD_SERVE_CHILD",
            "EPD_COMPUTE_THREADS", "EPD_LONG_COMPUTE_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in skip} | ({"EPD_SERVE_CHILD": "1"} if serve_child else {})
    env |= {"OMP_NUM_THREADS": omp} if omp else {}
    env |= {"OMP_WAIT_POLICY": wait} if wait else {}   # the user's own libgomp setting
    out = subprocess.run([sys.executable, "-c", PROBE, threads, wait, nice, role, team], capture_output=True,
                         text=True, timeout=120, env=env, check=True, start_new_session=session)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _raised(by: int) -> int:
    """What `os.nice(by)` adds here: the kernel caps niceness at 19 (a suite run under `nice -n 15`)."""
    return min(by, 19 - os.nice(0))


def test_per_role_values_reach_torch_the_environment_and_the_scheduler():
    prefill = _probe("prefill=1,decode=2", "passive", "encode=5,prefill=3", "prefill")
    assert (prefill["threads"], prefill["nice"], prefill["wait"], prefill["spin"]) == (1, _raised(3), "passive", None)
    # under `epd serve` a model role spins 10000 times unless the environment says how libgomp waits
    assert _probe("", "", "", "decode", serve_child=True)["spin"] == "10000"
    assert _probe("", "passive", "", "decode", serve_child=True)["spin"] is None
    assert _probe("", "", "", "decode")["spin"] is None
    decode = _probe("prefill=1,decode=2", "", "encode=5,prefill=3", "decode")
    assert (decode["threads"], decode["main"], decode["helper"], decode["nice"], decode["wait"]) == (2, 1, 1, 0, None)
    assert decode["summary"] == "decode cpu policy: one OpenMP team: compute threads=2, other threads 1"
    old = _probe("prefill=1,decode=2", "", "", "decode", team="off")    # --single-omp-team off: every thread
    assert (old["threads"], old["main"], old["summary"]) == (2, 2, "decode cpu policy: threads=2")
    limited = _probe("", "", "", "encode", omp="3")    # a container's OMP_NUM_THREADS (its CPU limit) is kept
    assert (limited["threads"], limited["main"]) == (3, 1)
    render = _probe("2", "", "", "render")                               # no torch engine: left alone
    assert render["summary"] == "render cpu policy: threads=2" and render["main"] == 2
    # prefill-long: prefill's threads while it runs a chunked prompt (its own value elsewhere, decode untouched)
    long = _probe("prefill=2,prefill-long=1", "", "", "prefill")
    assert (long["threads"], long["long"]) == (2, 1)
    assert long["summary"].endswith("compute threads=1 while a chunked prompt prefills")
    assert _probe("prefill=2,prefill-long=1", "", "", "decode")["long"] == _probe("2", "", "", "prefill")["long"] == 2


def test_auto_niceness_applies_only_under_epd_serve():
    """auto under `epd serve`: decode=15,decode-long=5,prefill-long=19 (short prompts' prefill and encode ahead
    of decode, a chunked prompt's prefill behind it: docs/benchmarks.md, "Decode TPOT while a long prompt
    prefills")."""
    assert _probe("", "", "auto", "decode", serve_child=True)["nice"] == _raised(15)
    assert _probe("", "", "auto", "prefill", serve_child=True)["nice"] == 0
    assert _probe("", "", "auto", "encode", serve_child=True)["nice"] == 0
    assert _probe("", "", "auto", "decode")["nice"] == 0


def test_a_session_leading_role_nices_its_autogroup_too():
    """With session autogroups the scheduler shares the CPU between groups first: `epd serve` starts each role
    in its own session, where niceness alone did not weigh against decode at all.  A role leading its own
    session sets its group's niceness; one started from a shell leaves the shell's group alone."""
    if not os.path.exists("/proc/self/autogroup"):
        pytest.skip("this kernel has no session autogroups: niceness alone weighs between processes")
    own = _probe("", "", "prefill=7", "prefill", session=True)
    assert (own["nice"], own["autogroup"]) == (_raised(7), str(os.nice(0) + _raised(7)))
    assert own["summary"].endswith(f"nice={os.nice(0) + _raised(7)}, autogroup nice={os.nice(0) + _raised(7)}")
    mine = (open("/proc/self/autogroup").read().split() or [None])[-1]   # None in the default group (as under CI)
    shared = _probe("", "", "prefill=7", "prefill")  # in this process's session: its group is not touched
    assert shared["autogroup"] == mine and "autogroup" not in shared["summary"]
    assert _probe("", "", "", "decode", session=True)["autogroup"] == "0"


LONG_PROBE = """
import json, os, sys
from services.config import EpdConfig
from services.hostcpu import role_cpu
def group():
    return int(open("/proc/self/autogroup").read().split()[-1])
summary = role_cpu.apply(EpdConfig.of(role_nice=sys.argv[1]), "prefill")
seen = [group()]
for running in (True, True, False):
    role_cpu.long_prompt_running(running)
    seen.append(group())
print(json.dumps({"seen": seen, "summary": summary}))
"""


@pytest.mark.parametrize(("role_nice", "raised", "longer"), [("prefill=3,prefill-long=9", 3, 9),
                                                             ("decode=15,decode-long=5,prefill-long=19", 0, 19)])
def test_prefill_yields_more_while_a_long_prompt_runs(role_nice, raised, longer):
    """prefill-long: prefill's autogroup niceness while its forward carries a chunked prompt, its base after;
    also where prefill's own niceness is 0 (auto under `epd serve`)."""
    if not os.path.exists("/proc/self/autogroup"):
        pytest.skip("this kernel has no session autogroups: niceness alone weighs between processes")
    out = subprocess.run([sys.executable, "-c", LONG_PROBE, role_nice], capture_output=True, text=True,
                         timeout=120, check=True, start_new_session=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    base, long = os.nice(0) + _raised(raised), min(19, os.nice(0) + longer)
    assert got["seen"] == [base, long, long, base]
    assert got["summary"].endswith(f"autogroup nice={long} while a chunked prompt prefills")


FOLLOW_PROBE = """
import json, os, sys
from services.config import EpdConfig
from services.hostcpu import role_cpu
def group():
    return int(open("/proc/self/autogroup").read().split()[-1])
summary = role_cpu.apply(EpdConfig.of(role_nice=sys.argv[1]), "decode")
board = open(os.environ["EPD_LONG_PREFILL_BOARD"], "r+b")
seen = [group()]
for flags in (b"\\x00\\x00", b"\\x00\\x01", b"\\x00\\x01", b"\\x00\\x00"):   # prefill 1 starts, goes on, ends
    board.seek(0); board.write(flags); board.flush()
    role_cpu.follow_long_prefill()
    seen.append(group())
print(json.dumps({"seen": seen, "summary": summary}))
"""


def test_decode_follows_a_long_prompt_on_the_board(tmp_path):
    """decode-long: decode's autogroup niceness while any prefill of the cluster marks a chunked prompt on
    `epd serve`'s flag board (prefill writes its byte in long_prompt_running), its base after."""
    if not os.path.exists("/proc/self/autogroup"):
        pytest.skip("this kernel has no session autogroups: niceness alone weighs between processes")
    board = role_cpu.create_long_board(str(tmp_path / "board"))
    env = {**os.environ, role_cpu.LONG_BOARD_ENV: board}
    out = subprocess.run([sys.executable, "-c", FOLLOW_PROBE, "decode=15,decode-long=5,prefill-long=19"], env=env,
                         capture_output=True, text=True, timeout=120, check=True, start_new_session=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    base, long = os.nice(0) + _raised(15), max(0, min(19, os.nice(0) + 5))
    assert got["seen"] == [base, base, long, long, base]
    assert got["summary"].endswith(f"autogroup nice={long} while a chunked prompt prefills")


BOARD_PROBE = """
import json, os, sys
from services.config import EpdConfig
from services.hostcpu import role_cpu
role_cpu.apply(EpdConfig.of(role_nice=sys.argv[1]), "decode")
board = open(os.environ["EPD_LONG_PREFILL_BOARD"], "r+b")
seen = [role_cpu.long_prompt_prefilling()]
board.seek(0); board.write(b"\\x00\\x01"); board.flush()
seen.append(role_cpu.long_prompt_prefilling())
print(json.dumps({"opened": role_cpu.long_board() is not None, "seen": seen}))
"""


@pytest.mark.parametrize("role_nice", ["auto", "decode=5", ""])
def test_decode_reads_the_long_prompt_board_whatever_its_niceness(tmp_path, role_nice):
    """Decode's steps go first while a chunked prompt prefills (they do not yield to it), so decode opens
    `epd serve`'s board with or without a decode-long niceness (a user's `--role-nice decode=5` has none)."""
    board = role_cpu.create_long_board(str(tmp_path / "board"))
    env = {**os.environ, role_cpu.LONG_BOARD_ENV: board, "EPD_SERVE_CHILD": "1"}
    out = subprocess.run([sys.executable, "-c", BOARD_PROBE, role_nice], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"opened": True, "seen": [False, True]}


def test_prefill_marks_its_long_prompts_on_the_board(tmp_path, monkeypatch):
    board = role_cpu.create_long_board(str(tmp_path / "board"))
    monkeypatch.setenv(role_cpu.LONG_BOARD_ENV, board)
    monkeypatch.setenv(role_cpu.LONG_SLOT_ENV, "3")
    monkeypatch.setattr(role_cpu, "_LONG", {})
    monkeypatch.setattr(role_cpu, "_GROUP", {})
    role_cpu._open_long_board("prefill")
    role_cpu.long_prompt_running(True)
    assert open(board, "rb").read()[:5] == b"\x00\x00\x00\x01\x00"
    role_cpu.long_prompt_running(False)
    assert open(board, "rb").read() == bytes(role_cpu.LONG_BOARD_BYTES)


def test_role_maps_parse_and_bad_ones_are_refused():
    assert role_values("", "decode") is None and role_values("3", "decode") == 3
    assert role_values("decode=2,prefill=1", "prefill") == 1 and role_values("decode=2", "encode") is None
    EpdConfig.of(role_nice="encode=5,prefill=5,prefill-long=10,decode-long=2", role_threads="prefill=2,prefill-long=1")
    for bad in ({"role_threads": "decoder=2"}, {"role_nice": "prefill=high"},
                {"role_threads": "decode-long=2"}, {"role_nice": "encode-long=3"}):
        with pytest.raises(ConfigError):
            EpdConfig.of(**bad)


TEAMS = """
import os, sys, threading
from services.config import EpdConfig
from services.hostcpu.role_cpu import apply
apply(EpdConfig.of(single_omp_team=sys.argv[1]), "encode")
import torch
from services.hostcpu import compute_threads
compute_threads.single()   # as role_main does for the main thread

def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))

x = torch.randn(512, 4096)
base = os_threads()
for _ in range(3):   # the event loop's kind of work: big element-wise ops and copies
    (x * 2).sigmoid_()
    x.clone()
main = os_threads() - base
inside = []
def engine():
    compute_threads.enter()
    for _ in range(3):
        (x * 2).sigmoid_()
    inside.append(os_threads() - base)
thread = threading.Thread(target=engine)
thread.start(); thread.join()
print(main, inside[0])
"""


def test_only_the_compute_thread_starts_an_openmp_team():
    """A thread that runs a multi-threaded torch op gets OpenMP helper threads of its own (a team); with
    --single-omp-team on the main thread runs torch on one and starts none, the engine thread does."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one usable CPU: no thread starts a team")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "EPD_COMPUTE_THREADS")}
    counts = {}
    for team in ("on", "off"):
        out = subprocess.run([sys.executable, "-c", TEAMS, team], capture_output=True, text=True, timeout=120,
                             env=env, check=True)
        counts[team] = tuple(int(v) for v in out.stdout.split())
    helpers = len(os.sched_getaffinity(0)) - 1
    assert counts["on"][0] == 0 and counts["on"][1] >= 1 + helpers   # main: no helper; the engine thread: its own
    assert counts["off"][0] == helpers                               # negative control: the main thread's team


def test_decode_follows_the_compute_lease_prefill_takes(tmp_path, monkeypatch):
    from services.hostcpu import compute_lease

    path = compute_lease.create(str(tmp_path / "lease"))
    monkeypatch.setenv(compute_lease.LEASE_ENV, path)   # as `epd serve` gives decode (no slot) and prefill (slot 0)
    decode = _probe("", "", "", "decode")
    assert decode["summary"].endswith(f"decode steps yield to prompt-side forwards on {path} (at most 0.5 s a step)")
    assert _probe("", "", "", "prefill")["summary"].endswith(f"compute lease {path} (slot 0)")
    monkeypatch.delenv(compute_lease.LEASE_ENV)
    assert "yield" not in _probe("", "", "", "decode")["summary"]   # no lease given: nothing followed
