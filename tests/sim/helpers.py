"""Shared pieces of the replay tests: the Mooncake trace (in data/), small traces, and an
independent LRU.

The independent LRU simulation knows nothing of the manager: it models the free queue as an
ordered dict of block keys (hashes for cached content, fresh tokens for blocks that hold
nothing reusable) and re-derives every hit from the design's rules.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import PreparedTrace, prepare_trace
from prefixcache.sim.trace import (
    BAILIAN_BLOCK_SIZE,
    MOONCAKE_BLOCK_SIZE,
    Trace,
    TraceRequest,
    load_trace,
)
from tests.data_paths import MOONCAKE_TRACE_PATH


def trace_prefix(num_requests: int) -> Trace:
    return load_trace(MOONCAKE_TRACE_PATH, max_requests=num_requests)


def prepared_prefix(num_requests: int, block_size: int = 512,
                    reserve_decode_slots: bool = True) -> PreparedTrace:
    return prepare_trace(trace_prefix(num_requests), TraceExpander(block_size),
                         reserve_decode_slots=reserve_decode_slots)


def write_trace_head(path: Path, num_requests: int) -> Path:
    """The first ``num_requests`` lines of the Mooncake trace in data/, written to
    ``path``."""
    with MOONCAKE_TRACE_PATH.open() as source:
        path.write_text("".join(next(source) for _ in range(num_requests)))
    return path


def write_lines(path: Path, objects) -> Path:
    path.write_text("".join(
        (obj if isinstance(obj, str) else json.dumps(obj)) + "\n" for obj in objects))
    return path


def random_mooncake_trace(seed: int, num_requests: int = 60, num_roots: int = 6) -> Trace:
    """Small trees of shared 512-token blocks: a few roots, branching continuations."""
    rng = random.Random(seed)
    next_id = 0
    chains: list[list[int]] = []
    requests = []
    for line_no in range(1, num_requests + 1):
        if chains and rng.random() < 0.7:
            base = rng.choice(chains)
            keep = rng.randint(1, len(base))
            ids = base[:keep]
        else:
            ids = []
        for _ in range(rng.randint(0 if ids else 1, 3)):
            ids.append(next_id)
            next_id += 1
        if len(chains) < num_roots or rng.random() < 0.3:
            chains.append(ids)
        input_length = 512 * (len(ids) - 1) + rng.choice([1, 100, 511, 512])
        requests.append(TraceRequest(line_no, input_length, rng.randint(0, 600),
                                     float(line_no * rng.randint(50, 400)),
                                     hash_ids=tuple(ids)))
    return Trace("random", requests)


def mooncake_in_smaller_ids(request: TraceRequest, size: int) -> TraceRequest:
    """A Mooncake request spelt in ids of ``size`` tokens (a divisor of 512): id ``h``'s
    ``j``-th ``size`` tokens become id ``512 / size * h + j``, so the two name the same
    sharing at every block size from ``size`` up (the tokens, and so the hashes, differ)."""
    per_id = MOONCAKE_BLOCK_SIZE // size
    num_ids = -(-request.input_length // size)
    ids = tuple(h * per_id + j for h in request.hash_ids for j in range(per_id))[:num_ids]
    return TraceRequest(request.line_no, request.input_length, request.output_length,
                        request.timestamp_ms, hash_ids=ids, hash_block_size=size)


def mooncake_as_bailian(request: TraceRequest) -> TraceRequest:
    """:func:`mooncake_in_smaller_ids` in the Bailian format's 16-token ids."""
    return mooncake_in_smaller_ids(request, BAILIAN_BLOCK_SIZE)


def bailian_line_of(request: TraceRequest, chat_id: int) -> dict:
    """A Bailian-format request as the line a trace file holds (one session per request:
    the replay does not read the session fields)."""
    return {"chat_id": chat_id, "parent_chat_id": -1, "timestamp": request.timestamp_ms / 1000,
            "input_length": request.input_length, "output_length": request.output_length,
            "type": "text", "turn": 1, "hash_ids": list(request.hash_ids)}


def simple_lru_hit_rate(prepared: PreparedTrace, num_blocks: int) -> float:
    """Sequential replay, one live request at a time, with a plain LRU over block keys."""
    free: OrderedDict = OrderedDict()  # head = next to reuse
    num_never_used = num_blocks  # blocks that never held anything come first
    num_hit_tokens = 0
    fresh = 0
    for hashes, max_hit, needed in zip(prepared.block_hashes, prepared.max_hit_blocks,
                                       prepared.blocks_needed, strict=True):
        if needed > num_blocks:
            continue
        hit = 0
        while hit < min(max_hit, len(hashes)) and hashes[hit] in free:
            hit += 1
        for key in hashes[:hit]:
            del free[key]
        to_take = needed - hit
        from_never_used = min(to_take, num_never_used)
        num_never_used -= from_never_used
        for _ in range(to_take - from_never_used):
            free.popitem(last=False)
        table = list(hashes[:hit])
        for key in hashes[hit:]:
            if key in free:  # recomputed although cached: a duplicate, never looked up
                fresh += 1
                key = ("duplicate", fresh)
            table.append(key)
        while len(table) < needed:  # partial prompt block and decode slots
            fresh += 1
            table.append(("empty", fresh))
        for key in reversed(table):  # freed last block first
            free[key] = None
        num_hit_tokens += hit * prepared.block_size
    return num_hit_tokens / prepared.num_prompt_tokens
