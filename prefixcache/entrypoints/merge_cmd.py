"""``prefixcache merge``: several request traces merged into one, in order of arrival."""

from __future__ import annotations

import argparse
import sys

from prefixcache.arg_types import file_path, positive_int

DESCRIPTION = """\
Merge request traces into one, in order of arrival: the traffic of several workloads
arriving at one server, to replay (`prefixcache replay`) or to judge eviction policies on.
Requests are ordered by timestamp (every request needs one); equal timestamps keep the
order of the traces as given, then of their lines.

Mooncake hash ids name content only within their own trace, so each trace's ids are moved
past the ids of the traces before it (the first trace's stay as they are): no block is
shared across traces. --shared-hash-ids keeps them as they are, for traces that name
content alike (pieces of one trace, or traces hashed by one tool). Token-id requests name
content by its tokens and are kept as they are. Bailian traces (Alibaba's, 16-token hash
ids) are merged the same way, their chat ids moved alike so that sessions stay apart;
each line is written in its own format, and any of the three may be merged.

Example:
  prefixcache synth chat --seed 1 --num-requests 12000 -o chat.jsonl
  prefixcache synth rag --seed 2 --num-requests 12000 -o rag.jsonl
  prefixcache merge chat.jsonl rag.jsonl --max-requests 12000 -o chat-rag.jsonl
  prefixcache replay chat-rag.jsonl --block-size 512 --sweep 2%,5%,10% --policy online
"""


def register(subparsers) -> None:
    from prefixcache.entrypoints.trace_options import add_trace_block_size

    parser = subparsers.add_parser(
        "merge", help="merge request traces into one, in order of arrival",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=file_path, metavar="TRACE",
                        help="trace files (JSON lines: Mooncake, Bailian or token-id format); "
                             "- reads one from standard input")
    parser.add_argument("-o", "--output", default="-", type=file_path, metavar="FILE",
                        help="output file (default: standard output); it may be one of "
                             "the traces, which are read whole first")
    parser.add_argument("--max-requests", type=positive_int, metavar="N",
                        help="write only the first N requests of the merged trace")
    parser.add_argument("--align-starts", action="store_true",
                        help="shift each trace's timestamps so that its earliest request "
                             "arrives at 0, for traces logged at different times")
    parser.add_argument("--shared-hash-ids", action="store_true",
                        help="keep hash ids (and Bailian chat ids) as they are: equal "
                             "ids in different traces then name the same content")
    add_trace_block_size(parser)
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip (and count) malformed trace lines instead of failing")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run, parser=parser)


def _error(message: str) -> int:
    print(f"prefixcache merge: error: {message}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prefixcache.entrypoints.trace_output import write_to_file, write_to_stdout
    from prefixcache.sim.merge import merge_traces
    from prefixcache.sim.trace import (
        STDIN_PATH,
        TraceFormatError,
        format_line,
        load_trace,
        trace_file_size,
    )

    if args.traces.count(STDIN_PATH) > 1:
        args.parser.error("standard input (-) can be read as one trace only")
    show_progress = not args.quiet and sys.stderr.isatty()
    traces = []
    sizes = [trace_file_size(path) for path in args.traces]
    try:
        with tqdm(total=None if None in sizes else sum(sizes), desc="reading", unit="B",
                  unit_scale=True, disable=not show_progress) as bar:
            for path in args.traces:
                traces.append(load_trace(path, skip_bad_lines=args.skip_bad_lines,
                                         progress=bar.update,
                                         mooncake_block_size=args.trace_block_size))
    except TraceFormatError as exc:
        return _error(str(exc))
    for trace in traces:
        if note := trace.skipped_lines_note():
            print(note, file=sys.stderr)
    try:
        requests = merge_traces(traces, shared_ids=args.shared_hash_ids,
                                align_starts=args.align_starts,
                                max_requests=args.max_requests)
    except ValueError as exc:
        return _error(str(exc))
    del traces  # the merged requests are all that is written
    # No bar over a trace that is itself going to the terminal.
    to_terminal = args.output == "-" and sys.stdout is not None and sys.stdout.isatty()

    def write(handle) -> None:
        with tqdm(requests, desc="writing", unit="req", file=sys.stderr,
                  disable=not show_progress or to_terminal) as lines:
            for request in lines:
                handle.write(format_line(request) + "\n")

    if args.output == "-":
        exit_code = write_to_stdout(write, "merge")
        if exit_code:
            return exit_code
    else:
        try:
            write_to_file(args.output, write)
        except OSError as exc:
            return _error(f"cannot write {args.output}: {exc.strerror or exc}")
    traces_named = "1 trace" if len(args.traces) == 1 else f"{len(args.traces)} traces"
    print(f"merged {len(requests)} requests from {traces_named} into {args.output}",
          file=sys.stderr)
    return 0
