"""`epd` command line: `epd serve` runs the whole cluster; `epd <role>` runs one role alone.

Every subcommand takes the same flags (services.config); each flag also reads
its EPD_* environment variable.
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import ROLES, ConfigError, EpdConfig, add_flags, from_args, schema

COMMANDS = {
    "serve": "start coordinator, render, encode, prefill and decode as separate processes",
    "coordinator": "run the coordinator alone (needs --render-urls, --encode-urls, ...)",
    "render": "run one render instance",
    "encode": "run one encode instance",
    "prefill": "run one prefill instance",
    "decode": "run one decode instance",
    "config": "print the settings table (flags, environment variables, defaults) as JSON",
    "bench": "load-test an OpenAI-compatible endpoint (own flags: epd bench --help)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated Encode/Prefill/Decode serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        add_flags(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def run_role(role: str, config: EpdConfig) -> int:
    from .role_main import run

    return run(role, config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its flags are not the server flags: its own parser takes the rest
        from .bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "config":
        print(json.dumps(schema(), indent=2, default=str))
        return 0
    try:
        config = from_args(args)
    except ConfigError as exc:
        print(f"epd: configuration error: {exc}", file=sys.stderr)
        return 2
    from .models.loading import ModelLoadError
    from .models.registry import UnsupportedModel
    from .preflight import StartupError, check_role, check_serve

    try:  # before any model loads, cheapest first: one line naming the problem and the fix
        check_serve(config) if args.command == "serve" else check_role(args.command, config)
        if args.command == "serve":
            from .launch import serve

            return serve(config)
        assert args.command in ROLES
        return run_role(args.command, config)
    except (StartupError, ModelLoadError, UnsupportedModel) as exc:
        print(f"epd {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
