"""``prefixcache replay``: replay a request trace through the KV cache manager."""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
import sys

from prefixcache.arg_types import (
    file_path,
    float_at_least,
    int_in_range,
    name_list,
    positive_float,
    positive_int,
)

# Llama-3-8B in fp16: 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 131_072
DEFAULT_BLOCK_SIZE = 16
STDOUT_PATH = "-"  # as --json's value
# Bounds far past any real cache or model, so that no figure derived from them (GiB of
# KV, a share of the working set in blocks) overflows a float. (--block-size is bounded
# by a request's token limit: a larger block could never fill.)
MAX_NUM_BLOCKS = 10**30
MAX_WORKING_SET_PERCENT = 10_000
MAX_KV_BYTES_PER_TOKEN = 1 << 30
num_blocks_arg = int_in_range(1, MAX_NUM_BLOCKS)

DESCRIPTION = """\
Replay a request trace through prefixcache's real KV cache manager and report the prefix
cache hit rate: how big must the KV cache be for this traffic, and which eviction policy
wins?

Trace formats (JSON lines, chosen per line):
  Mooncake   {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}
             each hash id is a 512-token block (--trace-block-size for another size),
             expanded into deterministic pseudo-random tokens; a smaller --block-size (a
             divisor of 512) subdivides it, a larger one (a multiple) joins ids. The
             trailing input_length % block-size tokens are unique to the request.
  Bailian    {"chat_id": c, "timestamp": s, "input_length": n, "output_length": m,
             "hash_ids": [...], ...}   Alibaba's public Qwen traces: as Mooncake, but
             each hash id is a 16-token block and the timestamp is in seconds;
             --block-size must divide 16 or be a multiple of it.
  token ids  [1, 2, 3, ...]  or  {"prompt_token_ids": [...], "timestamp": ms,
             "output_length": m}   (timestamp and output_length optional)
A request's prompt and its output are each at most 16,777,216 tokens (docs/trace-formats.md).

Each request is looked up, allocated its prompt plus output_length decode slots, held
while live, then freed. Modes:
  --concurrency C   requests in file order, at most C live (default 1); if one does not
                    fit beside the live ones, the oldest finish early (it is "delayed").
  --timeline        requests arrive at their timestamps and stay live for
                    output_length / --decode-tokens-per-s seconds; one that does not fit
                    waits in a FIFO queue ("delayed").
A request whose block table exceeds the whole cache is rejected ("not admitted") and
counts as all misses: hit rates are over the prompt tokens of every request.

--sweep adds two reference curves: the infinite cache (never evicts; the ceiling) and
Belady's offline optimum (same manager and admission, evicting the free block whose hash
is next needed furthest in the future, deepest first on ties).
Its capacities are block counts or shares of the trace's working set (its distinct full
blocks): --sweep 2%,5%,10%,20%,35%,50%,75%,100% compares traces of any size. Each online
policy is also compared with lru: the share of the widest lru->Belady gap it closes
there, and its least margin over lru anywhere on the sweep. Its replays are independent:
--jobs N runs up to N at once, each in a process of its own, with the same figures.

Offline diagnostics (--policy): dead-first evicts first the content that is never looked
up again, otherwise LRU; dead-once-first only such content used by one request so far,
dead-repeat-first only such content already reused. They show how much of the gap to
Belady a perfect predictor of dead content (of each kind) would close; they are never
counted as the best online policy.
"""


def _capacity_list(text: str) -> list[int | float]:
    """Comma-separated capacities: block counts, or shares of the working set written
    ``P%`` (returned as fractions); resolved once the trace is read."""
    capacities: list[int | float] = []
    for part in (part.strip() for part in text.split(",")):
        if part.endswith("%"):
            share = positive_float(part[:-1].strip())
            if share > MAX_WORKING_SET_PERCENT:
                raise argparse.ArgumentTypeError(
                    f"a share of the working set must be at most "
                    f"{MAX_WORKING_SET_PERCENT:,}%, got {part}")
            capacities.append(share / 100)
        elif part:
            capacities.append(num_blocks_arg(part))
    if not capacities:
        raise argparse.ArgumentTypeError(
            "give at least one capacity, e.g. 1000,2000,4000 or 2%,10%,50%")
    return capacities


def _plot_path(text: str) -> str:
    """A --plot path whose extension names a format matplotlib can write (checked when
    the options are read, not after the sweep)."""
    from prefixcache.sim.report import plot_format

    if text == STDOUT_PATH:
        raise argparse.ArgumentTypeError("give a file name: an image is not written to "
                                         "standard output")
    text = file_path(text)
    try:
        plot_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


ALL_ONLINE_POLICIES = "online"


def _policy_list(text: str) -> list[str]:
    """Comma-separated policy names, in order, without repeats; ``online`` stands for every
    online policy (the engine's eviction policies)."""
    from prefixcache.core import EVICTION_POLICIES
    from prefixcache.sim.replay import policy_names

    known = policy_names()
    policies = []
    for name in name_list(text):
        if name == ALL_ONLINE_POLICIES:
            policies.extend(EVICTION_POLICIES)
        elif name in known:
            policies.append(name)
        else:
            raise argparse.ArgumentTypeError(
                f"unknown policy {name!r}; choose from {', '.join(known)}, "
                f"or {ALL_ONLINE_POLICIES} for every online one")
    if not policies:
        raise argparse.ArgumentTypeError("give at least one policy")
    return list(dict.fromkeys(policies))


def register(subparsers) -> None:
    from prefixcache.core import EVICTION_POLICIES
    from prefixcache.entrypoints.trace_options import add_trace_block_size
    from prefixcache.sim.replay import MIN_DECODE_TOKENS_PER_S
    from prefixcache.sim.trace import MAX_REQUEST_TOKENS
    parser = subparsers.add_parser(
        "replay", help="replay a request trace: prefix-cache hit rate vs cache size and policy",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=file_path,
                        help="trace file (JSON lines: Mooncake, Bailian or token-id format); "
                             "- reads it from standard input")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--num-blocks", type=num_blocks_arg, metavar="N",
                      help="replay once with a cache of N blocks (at least 1)")
    size.add_argument("--sweep", type=_capacity_list, metavar="N1,N2,...",
                      help="replay at each capacity and print the hit-rate curve, with the "
                           "infinite-cache and Belady references; a capacity is a number "
                           "of blocks, or a share of the trace's working set (its distinct "
                           "full blocks) written like 5%% (at most "
                           f"{MAX_WORKING_SET_PERCENT:,}%%)")
    parser.add_argument("--block-size", type=int_in_range(1, MAX_REQUEST_TOKENS),
                        default=DEFAULT_BLOCK_SIZE, metavar="B",
                        help="tokens per block (default %(default)s, at most "
                             f"{MAX_REQUEST_TOKENS:,}); for a trace of hash ids, a divisor "
                             "or a multiple of its blocks' size (512 tokens for Mooncake, "
                             "16 for Bailian)")
    parser.add_argument("--policy", type=_policy_list, default=["lru"], metavar="P[,P...]",
                        help=f"eviction policies: {', '.join(EVICTION_POLICIES)} (lru "
                             "is the default), or 'online' for all of these; offline: belady, "
                             "and the diagnostics dead-first, dead-once-first, "
                             "dead-repeat-first (see above)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=positive_int, default=1, metavar="C",
                      help="sequential mode: live requests at a time (default 1)")
    mode.add_argument("--timeline", action="store_true",
                      help="admit requests at their timestamps, hold them while decoding")
    parser.add_argument("--decode-tokens-per-s", type=float_at_least(MIN_DECODE_TOKENS_PER_S),
                        default=None, metavar="R",
                        help="timeline mode: decode speed per request (default 50 tokens/s, "
                             f"at least {MIN_DECODE_TOKENS_PER_S:g})")
    parser.add_argument("--no-decode-slots", action="store_true",
                        help="allocate prompt slots only, not output_length decode slots")
    parser.add_argument("--no-belady", action="store_true",
                        help="--sweep without the (slower) Belady reference")
    parser.add_argument("--max-requests", type=positive_int, metavar="N",
                        help="replay only the first N requests")
    parser.add_argument("--json", type=file_path, metavar="OUT",
                        help="also write the figures as JSON to OUT; - writes them to "
                             "standard output, and the table then goes to standard error")
    parser.add_argument("--plot", type=_plot_path, metavar="OUT",
                        help="with --sweep: draw the hit-rate curves to OUT; the format "
                             "follows the extension (png, pdf, svg, ...; png without one)")
    parser.add_argument("--kv-bytes-per-token", type=int_in_range(1, MAX_KV_BYTES_PER_TOKEN),
                        default=DEFAULT_KV_BYTES_PER_TOKEN, metavar="X",
                        help="KV bytes per token, for GiB figures (default %(default)s: "
                             "Llama-3-8B in fp16; at most 1 GiB)")
    add_trace_block_size(parser)
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip (and count) malformed trace lines instead of failing")
    parser.add_argument("--jobs", "-j", type=positive_int, default=1, metavar="N",
                        help="run up to N replays at once, each in its own process "
                             "(default 1); the figures are the same, each process holds "
                             "up to a copy of the trace's block hashes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run, parser=parser)


def _error(message: str) -> int:
    print(f"prefixcache replay: error: {message}", file=sys.stderr)
    return 1


def _why_not_writable(path: str) -> str | None:
    """Why ``path`` cannot be written, or None. Checked before a replay that may take
    minutes, so that a mistyped output path fails at once; leaves no file behind.

    Only a regular file or a path that does not exist yet is opened to find out. Opening
    and closing anything else can have effects of its own (a FIFO's reader would see the
    end of its input, or the open would wait for one), so it is only checked for
    permission."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None  # nothing there (yet), or unreachable: the probe below says why
    if mode is not None and stat.S_ISDIR(mode):
        return f"cannot write {path}: {os.strerror(errno.EISDIR)}"
    if mode is not None and not stat.S_ISREG(mode):
        if not os.access(path, os.W_OK):
            return f"cannot write {path}: {os.strerror(errno.EACCES)}"
        return None
    # A dangling symbolic link counts as nothing there: the probe creates the file it
    # names, and that file is what is removed again.
    existed = mode is not None
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    if not existed:
        os.unlink(os.path.realpath(path))
    return None


def _write_figures(text: str, stream) -> str | None:
    """Write ``text`` (the table, or the JSON of ``--json -``) to ``stream``, standard
    output or error; why it could not be written (a full disk, an I/O error), or None. A
    reader that went away is left to the ``prefixcache`` entry point, which exits 141
    quietly."""
    from prefixcache.entrypoints.cli import discard_stdout

    try:
        stream.write(text)
        stream.flush()  # a failing write of buffered output is reported here
    except BrokenPipeError:
        raise
    except OSError as exc:
        if stream is sys.stdout:
            discard_stdout()  # what is still buffered would fail again at exit
        name = "standard output" if stream is sys.stdout else "standard error"
        return f"cannot write the figures to {name}: {exc.strerror or exc}"
    return None


def _is_stdout(flag: str, path: str) -> bool:
    return flag == "--json" and path == STDOUT_PATH


def _check_option_combinations(args: argparse.Namespace) -> None:
    """Usage errors (exit 2, with the usage line) for options that argparse accepts one
    by one but that make no sense together."""
    from prefixcache.sim.replay import BELADY

    parser = args.parser
    if args.plot and not args.sweep:
        parser.error("--plot needs --sweep (a curve over several capacities)")
    if args.decode_tokens_per_s is not None and not args.timeline:
        parser.error("--decode-tokens-per-s applies to --timeline only")
    if args.sweep and args.no_belady and all(p == BELADY for p in args.policy):
        parser.error("--no-belady leaves this sweep nothing to replay: name an online "
                     "--policy too")


def _is_same_file(path: str, other: str) -> bool:
    """Whether two paths name one file: equal once resolved (symlinks, ``..``), or, for
    files that exist, the same inode (hard links, case-insensitive file systems)."""
    if os.path.realpath(path) == os.path.realpath(other):
        return True
    try:
        return os.path.samefile(path, other)
    except OSError:  # one does not exist (yet): only the resolved paths could match
        return False


def _check_files_apart(args: argparse.Namespace) -> None:
    """A usage error if an output would overwrite the trace or the other output, before
    anything is written (or replayed)."""
    from prefixcache.sim.trace import STDIN_PATH

    files = [] if args.trace == STDIN_PATH else [("the trace", args.trace)]
    files += [(flag, path) for flag, path in (("--json", args.json), ("--plot", args.plot))
              if path and not _is_stdout(flag, path)]
    for i, (name, path) in enumerate(files):
        for earlier_name, earlier_path in files[:i]:
            if _is_same_file(path, earlier_path):
                args.parser.error(f"{name} {path} is the same file as {earlier_name}: "
                                  f"writing it would destroy {earlier_name}")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prefixcache.sim.expand import TraceExpander
    from prefixcache.sim.parallel_replays import ReplayWorkerDied, replay_all
    from prefixcache.sim.prepared import prepare_trace
    from prefixcache.sim.replay import BELADY, ReplayConfig
    from prefixcache.sim.report import format_replay, format_sweep, plot_sweep
    from prefixcache.sim.sweep import capacities_from_spec, sweep, working_set_blocks
    from prefixcache.sim.trace import TraceFormatError, load_trace, trace_file_size

    _check_option_combinations(args)
    _check_files_apart(args)
    if sys.stdout is None:  # started with file descriptor 1 closed: print() would drop all
        return _error("standard output is closed: nowhere to print the figures")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        reason = path and not _is_stdout(flag, path) and _why_not_writable(path)
        if reason:
            return _error(f"{flag}: {reason}")
    show_progress = not args.quiet and sys.stderr.isatty()
    try:
        with tqdm(total=trace_file_size(args.trace), desc="reading", unit="B", unit_scale=True,
                  disable=not show_progress) as bar:
            trace = load_trace(args.trace, skip_bad_lines=args.skip_bad_lines,
                               max_requests=args.max_requests, progress=bar.update,
                               mooncake_block_size=args.trace_block_size)
    except TraceFormatError as exc:
        return _error(str(exc))
    if note := trace.skipped_lines_note():
        print(note, file=sys.stderr)
    if args.timeline and not trace.has_timestamps:
        return _error("--timeline needs a 'timestamp' on every request of the trace")

    # stdout carries the JSON alone when --json is -, so that it can be piped on; the
    # table then goes to stderr (the null device if it was closed: cli.main).
    report = sys.stderr if args.json == STDOUT_PATH else sys.stdout
    num_requests = len(trace.requests)
    try:
        expander = TraceExpander(args.block_size)
        with tqdm(total=num_requests, desc="hashing", unit="req",
                  disable=not show_progress) as bar:
            prepared = prepare_trace(trace, expander,
                                     reserve_decode_slots=not args.no_decode_slots,
                                     progress=bar.update)
        common = {"concurrency": args.concurrency, "timeline": args.timeline}
        if args.decode_tokens_per_s is not None:
            common["decode_tokens_per_s"] = args.decode_tokens_per_s
        if args.sweep:
            policies = [p for p in args.policy if p != BELADY]
            with_belady = not args.no_belady
            capacities = capacities_from_spec(args.sweep, working_set_blocks(prepared))
            num_runs = len(capacities) * (len(policies) + with_belady)
            with tqdm(total=num_runs * num_requests, desc="replaying", unit="req",
                      disable=not show_progress) as bar:
                result = sweep(prepared, capacities, policies, with_belady=with_belady,
                               decode_tokens_per_s=args.decode_tokens_per_s,
                               concurrency=args.concurrency, timeline=args.timeline,
                               progress=bar.update, jobs=args.jobs)
            table = format_sweep(result, args.block_size, args.kv_bytes_per_token)
            payload = result.to_dict()
        else:
            configs = [ReplayConfig(args.num_blocks, policy, **common)
                       for policy in args.policy]
            with tqdm(total=len(args.policy) * num_requests, desc="replaying", unit="req",
                      disable=not show_progress) as bar:
                results = replay_all(prepared, configs, bar.update, args.jobs)
            table = "\n\n".join(format_replay(r, args.kv_bytes_per_token) for r in results)
            payload = {"runs": [r.to_dict() for r in results]}
    except (ValueError, ReplayWorkerDied) as exc:
        return _error(str(exc))
    if reason := _write_figures(table + "\n", report):
        return _error(reason)

    payload = {"trace": trace.path, "num_requests": num_requests,
               "num_bad_lines": trace.num_bad_lines, "block_size": args.block_size,
               "trace_block_size": args.trace_block_size,
               "kv_bytes_per_token": args.kv_bytes_per_token,
               "mode": "timeline" if args.timeline else "sequential", **payload}
    try:
        # Strict JSON (no NaN or Infinity, which JSON readers refuse), checked before
        # anything is written.
        json_text = args.json and json.dumps(payload, indent=1, allow_nan=False) + "\n"
    except ValueError as exc:
        return _error(f"--json: {exc}")
    if args.json == STDOUT_PATH and (reason := _write_figures(json_text, sys.stdout)):
        return _error(reason)
    try:
        if args.json and args.json != STDOUT_PATH:
            with open(args.json, "w", encoding="utf-8") as handle:
                handle.write(json_text)
        if args.plot:
            mode = "timeline" if args.timeline else f"concurrency {args.concurrency}"
            plot_sweep(result, args.plot, args.block_size, args.kv_bytes_per_token,
                       title=f"{os.path.basename(trace.path)}: {num_requests:,} requests, "
                             f"block size {args.block_size}, {mode}")
    except BrokenPipeError:
        raise  # the reader went away (--json /dev/stdout | head): cli.main exits quietly
    except OSError as exc:
        return _error(f"cannot write output: {exc}")
    return 0
