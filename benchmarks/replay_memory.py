"""Memory of a replay's trace data: prefixcache's layout against plain lists and dicts.

A sweep holds, for its whole run, the parsed trace and every request's block hashes, and
while Belady's optimum is replayed, each hash's future uses. For each trace and block
size, two child processes build the same data and report their peak resident memory from
the end of their imports (Linux resets the peak then), above what the imports left in use:

- ``prefixcache``: ``load_trace``, ``prepare_trace`` and ``FutureUses`` as a sweep uses
  them (token ids in arrays, chains as 4-byte slots into each distinct hash stored once,
  future uses in flat arrays);
- ``plain`` (the comparison point): token ids as tuples, each request's hashes as a list,
  and each hash's future uses as a list in a dict — the same expander, so the same hashes.

Each child also reports answers its data give (the working set, and the future uses of a
sample of hashes); ``same_answers`` says whether the two agree, and the script exits 1 if
they do not anywhere.

    python benchmarks/replay_memory.py [--requests N] [--skip-token-ids]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prefixcache.sim.belady import FutureUses
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.trace import Trace, TraceRequest, load_trace, parse_line

SHARED_TRACE = (Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake"
                / "synthetic_trace.jsonl")
SAMPLE_EVERY = 13  # a block of every so many-th request is checked in both layouts


def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak() -> float:
    """Forget the peak so far (Linux: the imports' transients), and return the memory in
    use now: the base the measured peaks are taken above."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")  # resets VmHWM, the peak resident set size
    except OSError:
        pass
    now = _status_mib("VmRSS")
    return _peak_mib() if now is None else now


def _peak_mib() -> float:
    peak = _status_mib("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if peak is None else peak


class _PlainFuture:
    """Each hash's useful accesses and recomputations as lists in dicts."""

    def __init__(self, chains, max_hit_blocks) -> None:
        self.uses: dict = {}
        self.recomputes: dict = {}
        self.depths: dict = {}
        for index, (hashes, num_hit_able) in enumerate(zip(chains, max_hit_blocks, strict=True)):
            for depth, block_hash in enumerate(hashes):
                where = self.uses if depth < num_hit_able else self.recomputes
                where.setdefault(block_hash, []).append(index)
                self.depths.setdefault(block_hash, depth)

    def num_uses_until(self, block_hash, now: int) -> int:
        return sum(1 for index in self.uses.get(block_hash, ()) if index <= now)


def _plain_trace(path: Path) -> Trace:
    """The trace with token ids as tuples."""
    requests = []
    with open(path, encoding="utf-8") as lines:
        for line_no, text in enumerate(lines, start=1):
            request = parse_line(text, line_no)
            if request.token_ids is not None:
                request = TraceRequest(request.line_no, request.input_length,
                                       request.output_length, request.timestamp_ms,
                                       token_ids=tuple(request.token_ids))
            requests.append(request)
    return Trace(str(path), requests)


def child(layout: str, path: Path, block_size: int) -> dict:
    """Build one layout's data for ``path`` and report its memory (run in a child)."""
    base = _reset_peak()
    started = time.perf_counter()
    expander = TraceExpander(block_size)
    if layout == "prefixcache":
        trace = load_trace(path)
        loaded_mib, loaded = _peak_mib(), time.perf_counter()
        prepared = prepare_trace(trace, expander)
        chains, max_hit_blocks = prepared.block_hashes, prepared.max_hit_blocks
        prepared_mib, prepared_at = _peak_mib(), time.perf_counter()
        future = FutureUses(iter(chains), max_hit_blocks)
        working_set, num_references = chains.num_distinct, chains.num_references
    else:
        trace = _plain_trace(path)
        loaded_mib, loaded = _peak_mib(), time.perf_counter()
        chains = [expander.block_hashes(request) for request in trace.requests]
        max_hit_blocks = [(r.input_length - 1) // block_size for r in trace.requests]
        prepared_mib, prepared_at = _peak_mib(), time.perf_counter()
        future = _PlainFuture(chains, max_hit_blocks)
    done_mib, done = _peak_mib(), time.perf_counter()
    if layout != "prefixcache":
        # Counted after the peak is read: this set is the check's, not the layout's.
        working_set = len({block_hash for chain in chains for block_hash in chain})
        num_references = sum(map(len, chains))
    middle = len(trace.requests) // 2
    # The middle block of every so many-th request's chain: the same hashes in both layouts.
    sample = [chain[len(chain) // 2] for chain in
              (chains[i] for i in range(0, len(chains), SAMPLE_EVERY)) if chain]
    return {
        "layout": layout,
        "num_requests": len(trace.requests),
        "working_set_blocks": working_set,
        "num_block_references": num_references,
        "trace_mib": round(loaded_mib - base, 1),
        "with_hashes_mib": round(prepared_mib - base, 1),
        "with_future_uses_mib": round(done_mib - base, 1),
        "bytes_per_block_reference": round((done_mib - base) * 2**20 / max(1, num_references),
                                           1),
        "read_s": round(loaded - started, 2),
        "hash_s": round(prepared_at - loaded, 2),
        "future_uses_s": round(done - prepared_at, 2),
        # The same answers from both layouts (hashes in first-seen order in both).
        "sample_uses_until_middle": [future.num_uses_until(h, middle) for h in sample],
    }


def measure(path: Path, block_size: int) -> dict:
    runs = {}
    for layout in ("plain", "prefixcache"):
        output = subprocess.run(
            [sys.executable, __file__, "--child", layout, str(path), str(block_size)],
            check=True, capture_output=True, text=True).stdout
        runs[layout] = json.loads(output)
    plain, ours = runs["plain"], runs["prefixcache"]
    same = all(plain[key] == ours[key] for key in
               ("num_requests", "working_set_blocks", "num_block_references",
                "sample_uses_until_middle"))
    for run in runs.values():
        del run["sample_uses_until_middle"]
    return {
        "trace": path.name,
        "block_size": block_size,
        "same_answers": same,
        "memory_ratio_plain_over_prefixcache": round(
            plain["with_future_uses_mib"] / max(0.1, ours["with_future_uses_mib"]), 2),
        "runs": runs,
    }


def synth(directory: Path, family: str, num_requests: int, fmt: str) -> Path:
    path = directory / f"{family}-{fmt}-{num_requests}.jsonl"
    subprocess.run([sys.executable, "-m", "prefixcache", "synth", family, "--seed", "1",
                    "--num-requests", str(num_requests), "--format", fmt, "-o", str(path)],
                   check=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000,
                        help="requests of the generated mixture trace (default 20,000)")
    parser.add_argument("--skip-token-ids", action="store_true",
                        help="leave out the token-id trace (2,000 chat requests)")
    parser.add_argument("--child", nargs=3, metavar=("LAYOUT", "TRACE", "BLOCK_SIZE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        layout, path, block_size = args.child
        print(json.dumps(child(layout, Path(path), int(block_size))))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as directory:
        cases = [(SHARED_TRACE, 512), (SHARED_TRACE, 16),
                 (synth(Path(directory), "mixture", args.requests, "mooncake"), 16)]
        if not args.skip_token_ids:
            cases.append((synth(Path(directory), "chat", 2000, "token-ids"), 16))
        for path, block_size in cases:
            results.append(measure(path, block_size))
            print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"python": platform.python_version(), "results": results}, indent=2))
    return 0 if all(result["same_answers"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
