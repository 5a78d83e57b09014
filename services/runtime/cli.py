"""`epd` command line: `epd serve` runs the whole cluster; `epd <role>` runs one role alone.

Every subcommand takes the same flags (services.config); each flag also reads
its EPD_* environment variable.
"""

from __future__ import annotations

import argparse
import json
import sys

from services.config import ROLES, ConfigError, EpdConfig, add_flags, from_args, schema

COMMANDS = {
    "serve": "start coordinator, render, encode, prefill and decode as separate processes",
    "coordinator": "run the coordinator alone (needs --render-urls, --encode-urls, ...)",
    "render": "run one render instance",
    "encode": "run one encode instance",
    "prefill": "run one prefill instance",
    "decode": "run one decode instance",
    "config": "print the effective settings (the same flags and EPD_* variables as the other commands) with "
              "where each value comes from: flag, env or default; --json for JSON, --schema for the table of "
              "every setting",
    "bench": "load-test an OpenAI-compatible endpoint (own flags: epd bench --help)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated Encode/Prefill/Decode serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        add_flags(command)
        if name == "config":
            command.add_argument("--json", dest="as_json", action="store_true", help="print JSON instead of text")
            command.add_argument("--schema", action="store_true", help="print every setting's flag, variable, "
                                 "type, default and help as JSON (what docs/configuration.md is made of)")
    return parser


def show_config(args: argparse.Namespace) -> int:
    from services.config.report import effective, render

    if args.schema:
        print(json.dumps(schema(), indent=2, default=str))
        return 0
    rows = effective(args)
    print(json.dumps(rows, indent=2, default=str) if args.as_json else render(rows))
    return 0


def run_role(role: str, config: EpdConfig) -> int:
    from services.runtime.role_main import run

    return run(role, config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its flags are not the server flags: its own parser takes the rest
        from services.bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "config":
            return show_config(args)
        config = from_args(args)
    except ConfigError as exc:
        print(f"epd: configuration error: {exc}", file=sys.stderr)
        return 2
    from services.models.loading import ModelLoadError
    from services.models.registry import UnsupportedModel
    from services.runtime.preflight import StartupError, check_role, check_serve

    try:  # before any model loads, cheapest first: one line naming the problem and the fix
        check_serve(config) if args.command == "serve" else check_role(args.command, config)
        if args.command == "serve":
            from services.runtime.launch import serve

            return serve(config)
        assert args.command in ROLES
        return run_role(args.command, config)
    except (StartupError, ModelLoadError, UnsupportedModel) as exc:
        print(f"epd {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
