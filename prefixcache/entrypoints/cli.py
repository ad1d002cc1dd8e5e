"""The ``prefixcache`` command: one entry point, one subcommand per module.

Each module named in ``SUBCOMMAND_MODULES`` exposes ``register(subparsers)``, which adds its
parser and sets ``func`` (called with the parsed namespace, returning an exit code).
Modules keep heavy imports (torch, fastapi, ...) inside their ``func`` so that
``prefixcache --help`` stays instant.

When the reader of stdout goes away (``prefixcache replay ... | head -3``), the command
stops quietly with exit code 141 (128 + SIGPIPE), as a command killed by SIGPIPE would:
no traceback, nothing on stderr. Running out of memory is one line on stderr and exit
code 1, not a traceback. Started with stderr closed (``2>&-``), its messages go nowhere
rather than into the data on stdout (``print(file=None)`` prints to stdout).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Callable

SUBCOMMAND_MODULES = [
    "prefixcache.entrypoints.demo_cmd",
    "prefixcache.entrypoints.events_cmd",
    "prefixcache.entrypoints.fleet",
    "prefixcache.entrypoints.generate_cmd",
    "prefixcache.entrypoints.merge_cmd",
    "prefixcache.entrypoints.openai.serve_cmd",
    "prefixcache.entrypoints.replay_cmd",
    "prefixcache.entrypoints.synth_cmd",
]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as the shell reports a Ctrl-C
EXIT_BROKEN_PIPE = 128 + getattr(signal, "SIGPIPE", 13)


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
    stderr_to_null_if_closed()
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return run_with_exit_codes(lambda: args.func(args))
    except MemoryError:
        # The failed allocation's objects are gone by now, so there is room to say so.
        print(f"prefixcache {args.command}: error: out of memory (the inputs need more "
              "memory than this machine has)", file=sys.stderr)
        return 1


def stderr_to_null_if_closed() -> None:
    """Point ``sys.stderr`` at the null device if the process was started with file
    descriptor 2 closed (it is then None): ``print(..., file=sys.stderr)`` would otherwise
    print to stdout, in the middle of a trace or of JSON written there."""
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (for the process)


def run_with_exit_codes(func: Callable[[], int | None]) -> int:
    """``func()``'s exit code (None is 0), ended as this command ends (module docstring):
    on Ctrl-C, "interrupted" on stderr and exit code 130; when the reader of stdout went
    away, 141 with nothing on stderr. Other exceptions propagate."""
    try:
        exit_code = int(func() or 0)
        # Output still buffered meets a closed pipe here, where it is handled, rather
        # than in the interpreter's final flush, which can only print a traceback.
        if sys.stdout is not None:  # None when started with file descriptor 1 closed
            sys.stdout.flush()
        return exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        discard_stdout()
        return EXIT_BROKEN_PIPE


def discard_stdout() -> None:
    """Send stdout to the null device: whatever is still buffered for the closed pipe
    would otherwise fail again, with a second error, when the interpreter flushes it on
    exit. A stdout without a file descriptor (tests' capture) is left alone."""
    if sys.stdout is None:  # started with file descriptor 1 closed: nothing is buffered
        return
    try:
        null_fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null_fd, sys.stdout.fileno())
        finally:
            os.close(null_fd)
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        pass


if __name__ == "__main__":
    sys.exit(main())
