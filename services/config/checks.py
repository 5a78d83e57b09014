"""The checks a configuration section runs on its own fields, each failure a ConfigError naming the setting."""

from __future__ import annotations

import ipaddress
from typing import Any


class ConfigError(ValueError):
    pass


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(section: Any, names: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    for name in names:
        _check(getattr(section, name) in allowed, f"{name} must be one of {', '.join(allowed)}")


def _at_least(section: Any, names: tuple[str, ...], low: float, strict: bool = False) -> None:
    for name in names:
        value = getattr(section, name)
        _check(value > low if strict else value >= low, f"{name} must be {'>' if strict else '>='} {low:g}")


def _role_map_ok(raw: str, keys: tuple[str, ...]) -> bool:
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if len(parts) == 1 and "=" not in parts[0]:
        return parts[0].lstrip("-").isdigit()
    return all(p.partition("=")[0].strip() in keys and p.partition("=")[2].strip().lstrip("-").isdigit()
               for p in parts)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def cpu_only_on_cuda(device: str, engines: Any) -> str:
    """Why the engines' settings ask a CPU-only kernel on a CUDA device ("" when they do not): an explicit choice
    is refused, never silently ignored (services/models/device_plan.py: on CUDA "auto" means off)."""
    if device.split(":")[0] != "cuda":
        return ""
    asked = [f"--linear-kernel {engines.linear_kernel}" if engines.linear_kernel in ("panel", "prepacked") else "",
             "--decode-fused on" if engines.decode_fused == "on" else "",
             "--lm-head-screen on" if engines.lm_head_screen == "on" else ""]
    asked = [a for a in asked if a]
    if not asked:
        return ""
    return (f"{', '.join(asked)}: CPU-only, not available with --device {device} (leave them at auto: CUDA runs "
            "transformers' layers and its own paged flex attention)")
