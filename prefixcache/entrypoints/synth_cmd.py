"""``prefixcache synth``: write a synthetic request trace of one workload family."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from prefixcache.arg_types import file_path, int_in_range, non_negative_int

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
    """``--param`` pairs as typed values of the family's fields; ValueError if unknown,
    given twice or of the wrong type (a value out of range is the workload's to refuse)."""
    from prefixcache.sim.workloads import WORKLOAD_FAMILIES
    from prefixcache.sim.workloads.parameter_ranges import shortened

    fields = {f.name: f for f in dataclasses.fields(WORKLOAD_FAMILIES[family])}
    params = {}
    for name, text in pairs:
        if name not in fields:
            raise ValueError(f"{family} has no parameter {shortened(name)}; its parameters: "
                             f"{', '.join(sorted(fields))}")
        if name in params:  # which one was meant? Neither is dropped silently.
            raise ValueError(f"--param {name} is given twice")
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
    from prefixcache.entrypoints.trace_output import write_to_file, write_to_stdout
    from prefixcache.sim.workloads import WORKLOAD_FAMILIES, stream_requests, write_trace

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
            def write(handle):
                write_trace(requests, handle, args.format, args.seed)

            if args.output == "-":
                return write_to_stdout(write, "synth")
            try:
                write_to_file(args.output, write)
            except OSError as exc:
                print(f"prefixcache synth: error: cannot write {args.output}: "
                      f"{exc.strerror}", file=sys.stderr)
                return 1
    # Bad parameters; or, found while drawing, no room for a prompt or a request too long
    # to replay: write_to_file has then removed its temporary file, leaving -o as it was.
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
    parser.add_argument("-o", "--output", default="-", type=file_path, metavar="FILE",
                        help="output file (default: standard output)")
    parser.add_argument("--format", choices=TRACE_FORMATS, default="mooncake",
                        help="trace format (default %(default)s)")
    parser.add_argument("--param", type=_param, action="append", default=[],
                        metavar="NAME=VALUE",
                        help="override one of the family's numeric parameters; repeatable, once "
                             "per parameter")
    parser.add_argument("--list-params", action="store_true",
                        help="print the family's parameters and defaults as JSON, and exit")
    parser.set_defaults(func=_run)
