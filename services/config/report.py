"""`epd config`: the effective configuration, each value with where it came from (flag, env or default).

It takes the same flags as every other subcommand and reads the same EPD_* variables, so it shows exactly
what `epd serve` (or a role) would run with.  Secret settings (metadata `secret`) are printed as `***`,
and a Redis URL without its password.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from services.config import env_name, flag_name, from_args, setting_fields

HIDDEN = "***"


def sources(ns: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
    """For every setting: "flag" (given on the command line), "env" (EPD_* variable) or "default"."""
    found = {}
    for _, f in setting_fields():
        if getattr(ns, f.name, None) is not None:
            found[f.name] = "flag"
        elif environ.get(env_name(f.name)) is not None:
            found[f.name] = "env"
        else:
            found[f.name] = "default"
    return found


def _shown(name: str, value: Any, secret: bool) -> Any:
    if secret and value:
        return HIDDEN
    if name.endswith("redis_url") and isinstance(value, str) and "@" in value:
        scheme, _, rest = value.partition("://")
        return f"{scheme}://{HIDDEN}@{rest.rsplit('@', 1)[-1]}"
    return value


def effective(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> list[dict[str, Any]]:
    environ = dict(os.environ) if environ is None else environ
    config, where = from_args(ns, environ), sources(ns, environ)
    rows, settings = [], config.settings()
    for _, f in setting_fields():
        secret = bool(f.metadata.get("secret"))
        source = where[f.name]
        if f.name == "instance_id" and source == "default":
            source = "default (random per process)"
        rows.append({"flag": flag_name(f.name), "env": env_name(f.name),
                     "value": _shown(f.name, settings[f.name], secret), "source": source,
                     "default": _shown(f.name, f.default, secret)})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """One line per setting: flag, value, source; a value that is not the default says so."""
    width = max(len(r["flag"]) for r in rows)
    lines = [f"{'setting':<{width}}  {'value':<32}  source", f"{'-' * width}  {'-' * 32}  ------"]
    for r in rows:
        value = json.dumps(r["value"]) if isinstance(r["value"], str) else str(r["value"]).lower() \
            if isinstance(r["value"], bool) else str(r["value"])
        source = r["source"] if r["source"] != "env" else f"env {r['env']}"
        lines.append(f"{r['flag']:<{width}}  {value:<32}  {source}")
    return "\n".join(lines)
