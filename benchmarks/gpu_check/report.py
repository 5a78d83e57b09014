"""The GPU check's one JSON (from the sections' parts) and its docs/benchmarks.md block (from that JSON).

Figures and their targets (issue 41): greedy tokens identical to `generate` (every case), CUDA IPC read
bandwidth / device-to-device copy >= 0.8x, decode tok/s at 16 streams / `generate` at batch 16 >= 5x, host
synchronisations per decode step beyond the sampled tokens' read-back = 0.  A section that failed or ran out of
time has its error in "errors" and its figures n/a: the JSON says what did not run, never a number it lacks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common import Figure, markdown_table, replace_block
from benchmarks.gpu_check.common import Run

SECTIONS = ("env", "ipc", "exactness", "decode", "cluster")
BLOCK = "gpu-check"


def _part(run: Run, name: str) -> tuple[dict[str, Any] | None, str | None]:
    path, log = run.out / f"{name}.json", run.out / f"{name}.log"
    if not path.exists() and not log.exists():
        return None, "not run"
    if not path.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-12:]
        return None, "did not finish (time limit or crash): " + " | ".join(tail)[-1500:]
    data = json.loads(path.read_text())
    return data, data.get("error")


def _get(data: dict[str, Any] | None, *keys: Any) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key) if key in data else data.get(str(key))
    return data


def figures(sections: dict[str, Any]) -> list[Figure]:
    ex, ipc, dec, cl = (sections.get(name) for name in ("exactness", "ipc", "decode", "cluster"))
    syncs = _get(dec, "syncs")
    found = [
        Figure("greedy tokens identical to generate: CUDA decode step (families x dtypes x prompts)",
               _get(ex, "identical"), _get(ex, "total"), "ge", "count"),
        Figure("greedy tokens identical to generate: every role, CUDA IPC connectors", _get(cl, "identical"),
               _get(cl, "total"), "ge", "count"),
        Figure("CUDA IPC read / device-to-device copy", _get(ipc, "ratio"), 0.8, "ge",
               note=f"{_get(ipc, 'size_mb')} MiB, {_get(ipc, 'path')}"),
        Figure("decode tok/s at 16 streams / generate batch 16 (medium)", _get(dec, "ratio", 16), 5.0, "ge"),
        Figure("decode tok/s at 1 stream / generate batch 1 (medium)", _get(dec, "ratio", 1)),
        Figure("decode tok/s at 64 streams / generate batch 64 (medium)", _get(dec, "ratio", 64)),
        Figure("host syncs per decode step beyond the tokens' read-back", _get(syncs, "beyond_readback"), 0.0, "le",
               "count", note=f"{_get(syncs, 'calls')} over {_get(syncs, 'steps')} steps"),
        Figure("TTFT at c=1, text (ms)", _get(cl, "ttft_text_ms"), unit="ms"),
        Figure("TTFT at c=1, one image (ms)", _get(cl, "ttft_image_ms"), unit="ms"),
    ]
    return found


def merge(run: Run, json_path: Path) -> dict[str, Any]:
    sections: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name in SECTIONS:
        data, error = _part(run, name)
        if data is not None:
            sections[name] = data
        if error:
            errors[name] = error
    env = sections.get("env", {})
    doc = {"device": env.get("name"), "dry_run": run.dry_run, "env": env,
           "figures": [f.as_dict() for f in figures(sections)], "sections": sections, "errors": errors}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    return doc


def doc_block(json_path: Path, doc_path: Path) -> str:
    """Write the JSON's block into `doc_path` (docs/benchmarks.md); the block's text."""
    doc = json.loads(json_path.read_text())
    env = doc.get("env", {})
    found = [Figure(**{k: v for k, v in f.items() if k != "passed"}) for f in doc["figures"]]
    head = (f"{'DRY RUN on CPU, not a GPU result: ' if doc['dry_run'] else ''}`scripts/gpu_check.sh` on "
            f"{doc.get('device')} ({env.get('time')}; torch {env.get('torch')}, transformers "
            f"{env.get('transformers')}, CUDA {env.get('cuda')}, {env.get('cpus')} CPUs); JSON: "
            f"`benchmarks/results/{json_path.name}`.")
    errors = "".join(f"\n- {name} did not complete: {text[:300]}" for name, text in doc.get("errors", {}).items())
    body = f"{head}\n\n{markdown_table(found)}" + (f"\n\nSections with errors:{errors}" if errors else "")
    replace_block(doc_path, BLOCK, body)
    return body
