"""Small drivers shared by the core tests: they play the scheduler's part, one step at a time
(and for the scheduler's own tests, ``step`` plays the engine's).

Every helper goes through the public surface of ``prefixcache.core`` only
(``get_computed_blocks`` / ``allocate_slots`` / ``free`` and the documented inspection
attributes), so the tests read like the stories of the design document.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.request import RequestStatus
from prefixcache.core.scheduler import Scheduler


def make_manager(num_blocks: int = 10, block_size: int = 4, **kwargs) -> KVCacheManager:
    kwargs.setdefault("hash_algo", "sha256")
    kwargs.setdefault("hash_seed", None)
    return KVCacheManager(num_blocks=num_blocks, block_size=block_size, **kwargs)


def schedule_prefill(mgr: KVCacheManager, req: Request,
                     num_tokens: int | None = None) -> tuple[int, list[int] | None]:
    """Look up the prefix cache and allocate the (rest of the) prompt, like a scheduler.

    Returns ``(num_hit_tokens, new_block_ids)``; ``new_block_ids`` is None when the
    allocation did not fit (then the request is not advanced). On success the request's
    ``num_computed_tokens`` is advanced over the hit and the scheduled tokens.
    """
    blocks, num_hit_tokens = mgr.get_computed_blocks(req)
    if num_tokens is None:
        num_tokens = req.num_tokens - num_hit_tokens
    new_blocks = mgr.allocate_slots(req, num_tokens, num_new_computed_tokens=num_hit_tokens,
                                    new_computed_blocks=blocks)
    if new_blocks is None:
        return num_hit_tokens, None
    req.num_computed_tokens += num_hit_tokens + num_tokens
    return num_hit_tokens, [b.block_id for b in new_blocks]


def schedule_decode(mgr: KVCacheManager, req: Request,
                    token_ids: int | Sequence[int]) -> list[int] | None:
    """Append sampled tokens and allocate slots for every not-yet-computed token."""
    req.append_output_token_ids(token_ids)
    num_new_tokens = req.num_tokens - req.num_computed_tokens
    new_blocks = mgr.allocate_slots(req, num_new_tokens)
    if new_blocks is None:
        return None
    req.num_computed_tokens += num_new_tokens
    return [b.block_id for b in new_blocks]


def free_ids(mgr: KVCacheManager) -> list[int]:
    """The free queue, head (evicted first) to tail, as block ids."""
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def cached_ids(mgr: KVCacheManager) -> list[int]:
    """Ids of every block currently carrying a hash, ascending."""
    return [b.block_id for b in mgr.block_pool.blocks if b.block_hash is not None]


def ref_cnts(mgr: KVCacheManager, block_ids: Sequence[int]) -> list[int]:
    return [mgr.block_pool.blocks[i].ref_cnt for i in block_ids]


def blocks_under(mgr: KVCacheManager, block_hash: bytes) -> list[int]:
    """Ids of every block cached under ``block_hash`` (duplicates included), insertion order."""
    cache = mgr.block_pool.cached_block_hash_to_block
    return [b.block_id for b in cache.get_all_blocks(block_hash)]


def snapshot(mgr: KVCacheManager, request_ids: Sequence[str] = ()) -> tuple:
    """Everything an allocation may change, in a comparable form."""
    pool = mgr.block_pool
    cache = pool.cached_block_hash_to_block
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        free_ids(mgr),
        pool.free_block_queue.num_free_blocks,
        sorted((h, tuple(b.block_id for b in cache.get_all_blocks(h)))
               for h in cache.keys()),  # noqa: SIM118 - the map is not iterable
        {rid: mgr.get_block_ids(rid) for rid in request_ids},
    )


def seq(start: int, n: int) -> list[int]:
    """``n`` consecutive token ids from ``start``: distinct, readable prompts."""
    return list(range(start, start + n))


def step(scheduler: Scheduler, max_tokens: dict[str, int]):
    """One engine step: sample token ``1000 + len(outputs)`` for each sequence that needs
    logits; finish requests that reached their max_tokens."""
    output = scheduler.schedule()
    for scheduled in output.scheduled:
        request = scheduled.request
        if scheduled.needs_logits:
            request.append_output_token_ids(1000 + request.num_output_tokens)
            if request.num_output_tokens >= max_tokens[request.request_id]:
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    return output
