"""One configuration schema for every epd process: `EpdConfig`, frozen sections of frozen settings.

    config.server.port, config.checkpoint.model, config.stores.ec_connector, config.cluster.urls("encode"),
    config.engines.decode_slots, config.cpu.role_nice, config.limits.ttft_timeout_s, config.security.api_keys()

Each setting is a field of one section (services/config/sections.py); the command-line flag (`--ec-connector`)
and the environment variable (`EPD_EC_CONNECTOR`) are derived from the field name, so the names are the same
everywhere and the configuration reference in docs/ is generated from these classes.  Precedence: flag >
environment > default.  Each section validates its own fields when it is made.  `EpdConfig.of(**settings)`
builds one from flat setting names (what flags and variables give); `with_(**settings)` changes some.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from typing import Any

from .checks import ConfigError, cpu_only_on_cuda, flag_name, is_loopback
from .sections import (
    CPU_DECODE_SLOTS,
    CUDA_DECODE_SLOTS,
    DEMO_ALIASES,
    EVENT_LOOPS,
    LINEAR_KERNELS,
    ROLES,
    ROUTING_POLICIES,
    SWITCHES,
    CheckpointConfig,
    ClusterConfig,
    CpuConfig,
    EnginesConfig,
    LimitsConfig,
    SecurityConfig,
    ServerConfig,
    StoresConfig,
)

__all__ = ["DEMO_ALIASES", "EVENT_LOOPS", "LINEAR_KERNELS", "ROLES",
           "ROUTING_POLICIES", "SWITCHES", "ConfigError", "EpdConfig", "add_flags", "env_name", "flag_name",
           "from_args", "is_loopback", "schema", "setting_fields"]


@dataclass(frozen=True)
class EpdConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stores: StoresConfig = field(default_factory=StoresConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        """What spans sections: the "auto" settings the device decides (dtype; decode_slots, which the coordinator's
        admission counts too: resolved here, every process of a cluster sees the same values), and CPU-only kernels
        refused on CUDA."""
        cuda = self.checkpoint.device.split(":")[0] == "cuda"
        if self.checkpoint.dtype == "auto":
            object.__setattr__(self, "checkpoint", replace(self.checkpoint, dtype="bfloat16" if cuda else "float32"))
        if self.engines.decode_slots == 0:
            slots = CUDA_DECODE_SLOTS if cuda else CPU_DECODE_SLOTS
            object.__setattr__(self, "engines", replace(self.engines, decode_slots=slots))
        refused = cpu_only_on_cuda(self.checkpoint.device, self.engines)
        if refused:
            raise ConfigError(refused)

    @classmethod
    def of(cls, **settings: Any) -> EpdConfig:
        """A config from flat setting names (`decode_slots=4`); the rest take their defaults, and the "auto" ones
        are resolved for the device given here."""
        grouped = _grouped(settings)
        return cls(**{f.name: f.default_factory(**grouped.get(f.name, {}))  # type: ignore[misc,operator]
                      for f in fields(cls)})

    def with_(self, **settings: Any) -> EpdConfig:
        """This config with some settings changed (flat names); TypeError for a name no section has.  Settings
        already resolved for the device stay as they are (give dtype and decode_slots with a new device)."""
        return replace(self, **{section: replace(getattr(self, section), **values)
                                for section, values in _grouped(settings).items()})

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        return {name: value for section in _SECTIONS for name, value in asdict(getattr(self, section)).items()}

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces this config in a child process."""
        return {env_name(k): _render(v) for k, v in self.settings().items()}


_SECTIONS = tuple(f.name for f in fields(EpdConfig))
_SECTION_OF = {setting.name: section.name for section in fields(EpdConfig)
               for setting in fields(section.default_factory)}  # type: ignore[arg-type]


def _grouped(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat settings by section; TypeError for a name no section has."""
    unknown = sorted(set(settings) - _SECTION_OF.keys())
    if unknown:
        raise TypeError(f"unknown settings: {', '.join(unknown)}")
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        grouped.setdefault(_SECTION_OF[name], {})[name] = value
    return grouped


def setting_fields() -> list[tuple[str, Field[Any]]]:
    """(section, field) of every setting, in the sections' order."""
    return [(section.name, setting) for section in fields(EpdConfig)
            for setting in fields(section.default_factory)]  # type: ignore[arg-type]


def env_name(field_name: str) -> str:
    return "EPD_" + field_name.upper()


def _render(value: Any) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"not a boolean: {raw!r}")


def _convert(kind: type, raw: str) -> Any:
    return _parse_bool(raw) if kind is bool else kind(raw)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; defaults are None so we can tell 'not given' from 'given'."""
    for _, f in setting_fields():
        kind = type(f.default)
        if kind is bool:
            parser.add_argument(flag_name(f.name), dest=f.name, nargs="?", const="1", default=None,
                                type=str, help=f"{f.metadata['help']} (env {env_name(f.name)})")
        else:
            # A help text that explains its own default ("default: random") is not given the raw one too.
            default = "" if "(default" in f.metadata["help"] else f"default {f.default!r}; "
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, type=str,
                                help=f"{f.metadata['help']} ({default}env {env_name(f.name)})")


def from_args(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> EpdConfig:
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for _, f in setting_fields():
        raw = getattr(ns, f.name, None)
        raw = environ.get(env_name(f.name)) if raw is None else raw
        if raw is not None:
            try:
                values[f.name] = _convert(type(f.default), raw)
            except ValueError as exc:
                raise ConfigError(f"{flag_name(f.name)}: {exc}") from None
    return EpdConfig.of(**values)


def schema() -> list[dict[str, Any]]:
    """The settings table, for docs and `epd config`."""
    return [{"flag": flag_name(f.name), "env": env_name(f.name), "type": type(f.default).__name__,
             "default": f.default if f.default is not MISSING else None, "roles": f.metadata["roles"],
             "section": section, "help": f.metadata["help"]} for section, f in setting_fields()]
