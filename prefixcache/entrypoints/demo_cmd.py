"""``prefixcache demo``: replay the design's worked example and show the cache at each step.

Ten blocks of four tokens; three requests that share prefixes. Every step prints the
block tables, which blocks are cached, and the free queue (head = next to evict), so the
output can be checked line by line against the worked example in docs/design.md, the
design this prefix cache implements (vLLM's "Automatic Prefix Caching"): hash chain,
block pool, free queue order, extra keys.
"""

from __future__ import annotations

import argparse

from prefixcache.core import EVICTION_POLICIES, KVCacheManager, Request


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="walk through the design's worked example of the prefix cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--policy", default="lru", choices=sorted(EVICTION_POLICIES),
                        help="eviction policy (default: lru, the design's order)")
    parser.set_defaults(func=run)


def _show(manager: KVCacheManager, time_step: int, what: str, requests: list[Request]) -> None:
    pool = manager.block_pool
    print(f"Time {time_step}: {what}")
    for request in requests:
        if manager.get_block_ids(request.request_id):
            print(f"  {request.request_id} block table: "
                  f"{manager.get_block_ids(request.request_id)}")
    cached = [block.block_id for block in pool.blocks if block.block_hash is not None]
    free = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
    print(f"  cached blocks: {cached}")
    print(f"  free queue (head first): {' - '.join(map(str, free)) or '(empty)'}")


def _admit(manager: KVCacheManager, request: Request) -> tuple[int, list[int]]:
    """Look up and allocate ``request``'s prompt: its hit tokens, and the ids of the cached
    blocks its new blocks evicted."""
    cached_before = {b.block_id for b in manager.block_pool.blocks if b.block_hash is not None}
    blocks, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens,
                                        num_hit_tokens, blocks)
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens, [b.block_id for b in new_blocks if b.block_id in cached_before]


def _evicted(block_ids: list[int]) -> str:
    if not block_ids:
        return "evicting nothing cached"
    noun = "block" if len(block_ids) == 1 else "blocks"
    return f"evicting cached {noun} {', '.join(map(str, block_ids))}"


def run(args: argparse.Namespace) -> int:
    manager = KVCacheManager(num_blocks=10, block_size=4, eviction_policy=args.policy)
    shared = list(range(100, 115))  # request 0's 15 prompt tokens
    r0 = Request("request0", shared)
    r1 = Request("request1", shared[:10] + [900, 901, 902, 903])
    r2 = Request("request2", shared[:12] + list(range(500, 517)))
    everyone = [r0, r1, r2]

    _admit(manager, r0)  # an empty cache: nothing to hit, nothing to evict
    _show(manager, 1, "request0 arrives with 15 prompt tokens: 3 full blocks cached, "
          "the 4th holds 3 tokens", everyone)
    for token in (1, 2):  # two decode steps: fill block 3, then need block 4
        r0.append_output_token_ids(token)
        manager.allocate_slots(r0, 1)
        r0.num_computed_tokens += 1
    _show(manager, 2, "request0 decodes: block 3 becomes full and cached, block 4 allocated",
          everyone)
    hits, _ = _admit(manager, r1)
    _show(manager, 3, f"request1 (14 tokens, first 10 shared) hits {hits} tokens", everyone)
    manager.free(r0)
    placed = "" if args.policy == "lru" else f", placed by the {args.policy} policy"
    joined = "join the tail" if args.policy == "lru" else "are released"
    _show(manager, 4, f"request0 finishes: its free blocks {joined} in reverse order{placed}",
          everyone)
    manager.free(r1)
    _show(manager, 5, "request1 finishes", everyone)
    hits, evicted = _admit(manager, r2)
    _show(manager, 6, f"request2 (29 tokens, first 12 shared) hits {hits} tokens; the rest "
          f"comes from the queue head, {_evicted(evicted)}", everyone)
    manager.free(r2)
    return 0
