"""``prefixcache synth``: write a synthetic request trace of one workload family."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import stat
import sys
import tempfile

from prefixcache.arg_types import int_in_range, non_negative_int
from prefixcache.entrypoints.cli import discard_stdout

DESCRIPTION = """\
Write a synthetic request trace in one of the shapes serving traffic takes, to replay
(`prefixcache replay`) or to judge eviction policies on. The same family, seed and
parameters always give the same trace.

Families (parameters and defaults: docs/workloads.md, or --list-params FAMILY):
  chat      multi-turn conversations: each turn's prompt extends the previous one by its
            answer and a new message; users think between turns
  rag       questions about documents of Zipf popularity, some with follow-ups
  agent     agent sessions: a long shared tool context, extended step by step by actions
            and tool observations
  tenants   many tenants of Zipf popularity, each with its own system prompt; mostly
            one-off inputs, some follow-ups
  mixture   all of the above, with the families' shares and popularities drifting

Formats:
  mooncake   {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}
             one hash id per 512-token block; equal ids mean equal content
  token-ids  {"timestamp": ms, "prompt_token_ids": [...], "output_length": m}
             (large: every prompt token is written)

Example:
  prefixcache synth chat --seed 1 --num-requests 2000 -o chat.jsonl
  prefixcache synth rag --seed 1 --num-requests 2000 --param zipf_s=1.2 -o rag.jsonl
  prefixcache replay chat.jsonl --block-size 512 --sweep 200,400,800 --policy online
"""


def _param(text: str) -> tuple[str, str]:
    from prefixcache.sim.workloads.parameter_ranges import shortened

    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {shortened(text)}")
    return name.strip(), value.strip()


def _convert_params(family: str, pairs: list[tuple[str, str]]) -> dict:
    """``--param`` pairs as typed values of the family's fields; ValueError if unknown
    or of the wrong type (a value out of range is the workload's to refuse)."""
    from prefixcache.sim.workloads import WORKLOAD_FAMILIES
    from prefixcache.sim.workloads.parameter_ranges import shortened

    fields = {f.name: f for f in dataclasses.fields(WORKLOAD_FAMILIES[family])}
    params = {}
    for name, text in pairs:
        if name not in fields:
            raise ValueError(f"{family} has no parameter {shortened(name)}; its parameters: "
                             f"{', '.join(sorted(fields))}")
        default = getattr(WORKLOAD_FAMILIES[family](), name)
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            raise ValueError(f"{name} cannot be set from the command line")
        try:
            value = type(default)(text)
        except ValueError:
            raise ValueError(f"{name} must be {type(default).__name__}, "
                             f"got {shortened(text)}") from None
        params[name] = value  # its range is checked with the others' by make_workload
    return params


def _run(args: argparse.Namespace) -> int:
    from prefixcache.sim.workloads import WORKLOAD_FAMILIES, stream_requests

    if args.list_params:
        workload = WORKLOAD_FAMILIES[args.family]()
        print(json.dumps({f.name: getattr(workload, f.name)
                          for f in dataclasses.fields(workload)
                          if not dataclasses.is_dataclass(getattr(workload, f.name))},
                         indent=1))
        return 0
    if args.num_requests is None:
        print("prefixcache synth: error: --num-requests is required", file=sys.stderr)
        return 2
    try:
        params = _convert_params(args.family, args.param)
        # Each request is written as soon as it is drawn: `synth ... | head -1` returns
        # at once, and the trace is never held in memory whole.
        requests = stream_requests(args.family, args.seed, args.num_requests, **params)
        with _progress_bar(requests, args) as requests:
            if args.output == "-":
                return _write_stdout(requests, args)
            try:
                _write_file(requests, args)
            except OSError as exc:
                print(f"prefixcache synth: error: cannot write {args.output}: "
                      f"{exc.strerror}", file=sys.stderr)
                return 1
    # Bad parameters; or, found while drawing, no room for a prompt or a request too long
    # to replay: _write_file has then removed its temporary file, leaving -o as it was.
    except ValueError as exc:
        print(f"prefixcache synth: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.num_requests} {args.family} requests to {args.output}", file=sys.stderr)
    return 0


#: A generation draws a progress bar (tqdm's, like `prefixcache replay`) once it has run
#: this long: a shorter one would only flash a bar on the terminal.
PROGRESS_DELAY_S = 2.0


def _progress_bar(requests, args: argparse.Namespace):
    """``requests`` wrapped in a tqdm bar on stderr, drawn only if stderr is a terminal
    and the trace is not going to that terminal too, and only after
    :data:`PROGRESS_DELAY_S`; a context manager that closes the bar."""
    from tqdm import tqdm

    to_terminal = args.output == "-" and sys.stdout is not None and sys.stdout.isatty()
    return tqdm(requests, total=args.num_requests, desc="generating", unit="req",
                file=sys.stderr, delay=PROGRESS_DELAY_S,
                disable=not sys.stderr.isatty() or to_terminal)


def _write_stdout(requests, args: argparse.Namespace) -> int:
    """Write the trace to standard output: 0, or 1 with a one-line error if it cannot be
    written (closed, or a write fails). A reader that went away (BrokenPipeError) is left
    to the ``prefixcache`` entry point, which exits 141 quietly."""
    from prefixcache.sim.workloads import write_trace

    if sys.stdout is None:  # started with stdout closed (``>&-``)
        return _stdout_error("it is closed")
    try:
        write_trace(requests, sys.stdout, args.format, args.seed)
        sys.stdout.flush()  # so that a failing final write is reported here
    except BrokenPipeError:
        raise
    except OSError as exc:
        discard_stdout()
        return _stdout_error(exc.strerror or str(exc))
    return 0


def _write_file(requests, args: argparse.Namespace) -> None:
    """Write the trace to ``args.output``. OSError if it cannot be written.

    An output that exists and is not a regular file (a device, a FIFO, ``/dev/stdout``,
    a process substitution's ``/dev/fd/N``) is opened by its name and written directly:
    there is nothing to replace. A regular file (or a new one) is replaced only once the
    trace is complete: the trace is written to a temporary file in the same directory,
    which is renamed over the output at the end and removed on any error or interrupt.
    A file that existed keeps its permission bits; a new one gets the mode ``open()``
    would give it. If the directory does not let the temporary file be created but the
    existing file is writable, the trace is written into that file directly: it is then
    not replaced atomically, and an error or interrupt leaves it partly written."""
    from prefixcache.sim.workloads import write_trace

    try:
        status = os.stat(args.output)  # of what a symbolic link names
    except FileNotFoundError:
        status = None
    if status is not None and not stat.S_ISREG(status.st_mode):
        # By the name as given: resolving /dev/stdout when it is a pipe gives
        # /proc/<pid>/fd/pipe:[N], which cannot be opened.
        with open(args.output, "w", encoding="utf-8") as handle:
            write_trace(requests, handle, args.format, args.seed)
        return
    # Through a symbolic link to the file it names: renaming over the link itself would
    # replace the link with a regular file.
    path = os.path.realpath(args.output)
    directory, name = os.path.split(path)
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial",
                                         dir=directory)
    except OSError as exc:
        if not (status is not None and _refused_by_directory(exc)
                and os.access(path, os.W_OK)):
            raise
        with open(path, "w", encoding="utf-8") as handle:
            write_trace(requests, handle, args.format, args.seed)
        return
    try:
        with open(fd, "w", encoding="utf-8") as handle:
            if status is not None:
                mode = stat.S_IMODE(status.st_mode)
            else:  # mkstemp's file is private (0600); open() would have applied the umask
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
            with contextlib.suppress(OSError):  # a file system without modes
                os.fchmod(handle.fileno(), mode)
            write_trace(requests, handle, args.format, args.seed)
        os.replace(temporary, path)
    except BaseException:  # a Ctrl-C too: never leave a partial trace behind
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _refused_by_directory(exc: OSError) -> bool:
    """Whether creating a file failed because the directory does not allow it."""
    return isinstance(exc, PermissionError) or exc.errno == errno.EROFS


def _stdout_error(reason: str) -> int:
    print(f"prefixcache synth: error: cannot write standard output: {reason}",
          file=sys.stderr)
    return 1


def register(subparsers) -> None:
    from prefixcache.sim.workloads import MAX_NUM_REQUESTS, TRACE_FORMATS, WORKLOAD_FAMILIES

    parser = subparsers.add_parser(
        "synth", help="write a synthetic request trace (chat, rag, agent, tenants, mixture)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=list(WORKLOAD_FAMILIES), help="workload family")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="random seed (default %(default)s)")
    parser.add_argument("--num-requests", type=int_in_range(1, MAX_NUM_REQUESTS),
                        metavar="N", help=f"number of requests to write, 1 to "
                                          f"{MAX_NUM_REQUESTS:,} (required)")
    parser.add_argument("-o", "--output", default="-", metavar="FILE",
                        help="output file (default: standard output)")
    parser.add_argument("--format", choices=TRACE_FORMATS, default="mooncake",
                        help="trace format (default %(default)s)")
    parser.add_argument("--param", type=_param, action="append", default=[],
                        metavar="NAME=VALUE",
                        help="override one of the family's numeric parameters; repeatable")
    parser.add_argument("--list-params", action="store_true",
                        help="print the family's parameters and defaults as JSON, and exit")
    parser.set_defaults(func=_run)
