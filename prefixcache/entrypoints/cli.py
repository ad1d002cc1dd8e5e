"""The ``prefixcache`` command: one entry point, one subcommand per module.

Each module named in ``SUBCOMMAND_MODULES`` exposes ``register(subparsers)``, which adds its
parser and sets ``func`` (called with the parsed namespace, returning an exit code).
Modules keep heavy imports (torch, fastapi, ...) inside their ``func`` so that
``prefixcache --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

SUBCOMMAND_MODULES = [
    "prefixcache.entrypoints.demo_cmd",
    "prefixcache.entrypoints.events_cmd",
    "prefixcache.entrypoints.generate_cmd",
    "prefixcache.entrypoints.openai.serve_cmd",
    "prefixcache.entrypoints.replay_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixcache",
        description="An LLM inference engine built around automatic prefix caching.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before any subcommand imports torch: OpenMP threads that spin while waiting for work
    # made model steps ~5x slower whenever another process shared the cores. Passive
    # waiting costs little on an idle machine. An explicit setting is respected.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
