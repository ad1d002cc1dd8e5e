"""``adaptive``: a segmented LRU whose protected share, and whether it evicts low-reuse
content first, follow sampled shadow caches."""

from __future__ import annotations

import random

import pytest

from prefixcache.core import EVICTION_POLICIES, KVCacheManager, Request
from prefixcache.core.eviction.adaptive import (
    CANDIDATE_PROTECTED_FRACTIONS,
    CANDIDATES,
    AdaptiveFreeBlockQueue,
    Candidate,
)
from prefixcache.core.eviction.adaptive_bookkeeping import (
    NATIVE_BOOKKEEPING,
    PythonGhostList,
    python_mark_hashed,
    python_note_taken,
    python_sort_released,
)
from prefixcache.core.eviction.document_liveness_model import DocumentLivenessModel
from prefixcache.core.eviction.liveness_classes import LivenessKeyClasses
from prefixcache.core.eviction.liveness_order import (
    NATIVE_LIVENESS_SHADOW,
    PythonShadowLivenessOrder,
)
from prefixcache.core.eviction.shadow import (
    NATIVE_SHADOWS,
    PythonShadowSegmentedLRU,
    python_sampled_hashes,
)
from prefixcache.core.eviction.signature_reuse import SignatureReuseEstimate
from prefixcache.core.request import RequestStatus
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig, replay
from prefixcache.sim.trace import load_trace
from prefixcache.sim.workloads import generate_requests, write_trace

BLOCK_SIZE = 4


def test_registered():
    assert EVICTION_POLICIES["adaptive"] is AdaptiveFreeBlockQueue


def make_manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, eviction_policy="adaptive")


def run_prompt(manager: KVCacheManager, request_id: str, token_ids: list[int],
               num_output_tokens: int = 0) -> int:
    """Look up, allocate, decode ``num_output_tokens`` and free one prompt; returns its
    hit tokens."""
    request = Request(request_id, token_ids, block_hasher=manager.block_hasher)
    blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(token_ids) - num_hit_tokens, num_hit_tokens,
                                  blocks) is not None
    request.num_computed_tokens = len(token_ids)
    for step in range(num_output_tokens):
        request.append_output_token_ids(7 + step)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    manager.free(request)
    return num_hit_tokens


def test_starts_in_the_design_order():
    manager = make_manager(64)
    queue = manager.block_pool.free_block_queue
    assert queue.current_protected_fraction == 0.0
    assert queue.sample_rate == 1.0  # a pool smaller than the shadows samples everything
    assert queue.followed_shares() == [0.0] * len(CANDIDATES)
    run_prompt(manager, "a", list(range(9)))  # two full blocks, one partial
    assert queue.followed_shares() == [1.0] + [0.0] * (len(CANDIDATES) - 1)
    assert queue.policy_state()["switches"] == 0
    # As unhashed-first: the partial block first, then the deepest full block.
    order = [block.block_id for block in queue.get_all_free_blocks()]
    assert order[0] == 2 and order[-2:] == [1, 0]


def popular_prefix_hits(policy: str) -> tuple[int, KVCacheManager]:
    """A popular 8-block prefix asked for every third request, between one-off prompts
    of 13 blocks: two one-offs flush the prefix out of 24 blocks in LRU order."""
    manager = KVCacheManager(24, BLOCK_SIZE, eviction_policy=policy)
    popular = list(range(1000, 1032))
    num_popular_hits = 0
    for i in range(90):
        if i % 3 == 2:
            num_popular_hits += run_prompt(manager, f"p{i}", popular + [7])
        else:
            run_prompt(manager, f"s{i}", [10_000 * (i + 1) + t for t in range(49)])
    return num_popular_hits, manager


def test_follows_the_protected_share_when_one_offs_flush_a_popular_prefix():
    lru_hits, _ = popular_prefix_hits("lru")
    adaptive_hits, manager = popular_prefix_hits("adaptive")
    queue = manager.block_pool.free_block_queue
    assert queue.current_protected_fraction > 0
    shares = {standing.label: standing.share for standing in queue.candidate_standings()}
    assert shares[queue.current_candidate.label] > shares[CANDIDATES[0].label]
    assert lru_hits == 0
    assert adaptive_hits > 25 * 32  # all but the first few asks hit the whole prefix
    state = queue.policy_state()
    assert state["protected_fraction"] == queue.current_protected_fraction
    assert set(state["candidate_hit_shares"]) == {c.label for c in CANDIDATES}
    assert sum(state["candidate_hit_shares"].values()) == pytest.approx(1, abs=1e-3)
    # It began in the design's order and changed at least once, to the one it follows.
    followed = state["candidate_followed_shares"]
    assert state["switches"] >= 1
    assert followed[CANDIDATES[0].label] > 0 and followed[queue.current_candidate.label] > 0
    assert sum(followed.values()) == pytest.approx(1, abs=1e-3)


def test_stays_in_lru_order_when_recency_is_what_matters():
    manager = make_manager(40)
    queue = manager.block_pool.free_block_queue
    lru_manager = KVCacheManager(40, BLOCK_SIZE, eviction_policy="lru")
    # Every document is asked about twice, five documents apart, and never again:
    # protecting what was reused only keeps dead content, while LRU holds every revisit.
    num_hits = {"adaptive": 0, "lru": 0}
    for i in range(120):
        for name, target in (("adaptive", manager), ("lru", lru_manager)):
            document = [1000 * i + t for t in range(8)]
            run_prompt(target, f"new{i}", document + [1])
            if i >= 5:
                num_hits[name] += run_prompt(target, f"again{i}",
                                             [1000 * (i - 5) + t for t in range(8)] + [2])
    assert queue.current_protected_fraction == 0.0
    assert num_hits["adaptive"] == num_hits["lru"] == 115 * 8


@pytest.mark.parametrize("family", ["chat", "rag", "agent", "tenants", "mixture"])
def test_never_far_below_lru_on_small_generated_traces(family, tmp_path):
    path = tmp_path / "trace.jsonl"
    with path.open("w") as handle:
        write_trace(generate_requests(family, 7, 200), handle, "mooncake", 7)
    prepared = prepare_trace(load_trace(path), TraceExpander(512))
    for num_blocks in (40, 160, 640):
        lru = replay(prepared, ReplayConfig(num_blocks, "lru")).hit_rate
        adaptive = replay(prepared, ReplayConfig(num_blocks, "adaptive")).hit_rate
        assert adaptive >= lru - 0.002, (num_blocks, lru, adaptive)


def run_in_python(patch: pytest.MonkeyPatch, parts: str) -> None:
    """Make ``adaptive`` run its shadows and sample, or its bookkeeping, in Python."""
    if parts == "shadows":
        patch.setattr(AdaptiveFreeBlockQueue, "shadow_type", PythonShadowSegmentedLRU)
        patch.setattr(AdaptiveFreeBlockQueue, "sampled_hashes",
                      staticmethod(python_sampled_hashes))
    elif parts == "liveness shadow":
        patch.setattr(AdaptiveFreeBlockQueue, "liveness_shadow_type",
                      PythonShadowLivenessOrder)
    else:
        patch.setattr(AdaptiveFreeBlockQueue, "ghost_list_type", PythonGhostList)
        patch.setattr(AdaptiveFreeBlockQueue, "note_taken", staticmethod(python_note_taken))
        patch.setattr(AdaptiveFreeBlockQueue, "sort_released",
                      staticmethod(python_sort_released))
        patch.setattr(AdaptiveFreeBlockQueue, "mark_hashed", staticmethod(python_mark_hashed))


@pytest.mark.parametrize("parts", [
    pytest.param("shadows", marks=pytest.mark.skipif(
        not NATIVE_SHADOWS, reason="built without a C compiler")),
    pytest.param("bookkeeping", marks=pytest.mark.skipif(
        not NATIVE_BOOKKEEPING, reason="built without a C compiler")),
    pytest.param("liveness shadow", marks=pytest.mark.skipif(
        not NATIVE_LIVENESS_SHADOW, reason="built without a C compiler"))])
def test_the_c_parts_change_no_decision(tmp_path, monkeypatch, parts):
    """A replay under the C shadows and sample, or the C bookkeeping, is the replay under
    the Python ones, hit for hit, choice for choice (small shadows, so that the sample
    filters hashes; pools small enough that recomputed content is found in the ghost
    list, within the reach followed and beyond it)."""
    path = tmp_path / "trace.jsonl"
    with path.open("w") as handle:
        write_trace(generate_requests("mixture", 3, 400), handle, "mooncake", 3)
    prepared = prepare_trace(load_trace(path), TraceExpander(512))
    monkeypatch.setattr(AdaptiveFreeBlockQueue, "shadow_entries", 24)
    for num_blocks in (60, 240):
        native = replay(prepared, ReplayConfig(num_blocks, "adaptive"))
        with monkeypatch.context() as python_parts:
            run_in_python(python_parts, parts)
            python = replay(prepared, ReplayConfig(num_blocks, "adaptive"))
        assert native.num_hit_tokens == python.num_hit_tokens > 0
        assert native.num_evictions == python.num_evictions > 0
        assert native.policy_state == python.policy_state


def test_evicts_the_new_content_of_long_answers_first_once_it_learns_they_are_one_offs():
    """Documents with one-token answers are asked about again four requests later; in
    between come one-off prompts with long answers, twice the cache in size. LRU and
    ``2q`` (a document is reused only on its second ask) lose every document; once the
    queue has seen that long answers' content never comes back, it evicts that first."""
    num_hits = {}
    for policy in ("adaptive", "lru", "2q"):
        manager = KVCacheManager(72, BLOCK_SIZE, eviction_policy=policy)
        num_hits[policy] = 0
        for i in range(150):
            run_prompt(manager, f"doc{i}", [1_000_000 + 100 * i + t for t in range(17)], 1)
            run_prompt(manager, f"one-off{i}", [10_000_000 + 1000 * i + t for t in range(33)],
                       64)
            if i >= 4:
                num_hits[policy] += run_prompt(
                    manager, f"again{i}", [1_000_000 + 100 * (i - 4) + t for t in range(17)], 1)
        if policy == "adaptive":
            queue = manager.block_pool.free_block_queue
            assert queue.evicts_low_reuse_first
            assert queue.policy_state()["low_reuse_first"] is True
    assert num_hits["lru"] == num_hits["2q"] == 0
    assert num_hits["adaptive"] > 100 * 16  # all but the first few documents hit


def test_a_hit_on_new_content_credits_the_signature_that_cached_it():
    manager = make_manager(64)
    queue = manager.block_pool.free_block_queue
    run_prompt(manager, "a", list(range(17)), 3)  # 5 full blocks new, signature 2
    signature = (3).bit_length()
    assert queue.reuse.num_inserted[signature] == 5
    assert queue.reuse.num_reused.get(signature, 0) == 0
    assert run_prompt(manager, "b", list(range(16)) + [99]) == 16  # 4 of them hit
    assert queue.reuse.num_reused[signature] == 4


def test_new_content_recomputed_after_its_eviction_credits_its_signature():
    manager = make_manager(16)
    queue = manager.block_pool.free_block_queue
    run_prompt(manager, "a", list(range(17)), 3)  # 5 full blocks new, signature 2
    signature = (3).bit_length()
    for i in range(2):  # 20 new blocks through a pool of 16: a's are evicted
        run_prompt(manager, f"flood{i}", [1000 * (i + 1) + t for t in range(40)])
    assert queue.reuse.num_reused.get(signature, 0) == 0
    assert run_prompt(manager, "a again", list(range(17)), 3) == 0
    # Its 5 blocks (the same answer again) were in the ghost list, unproven: wanted
    # again after their eviction.
    assert queue.reuse.num_reused[signature] == 5


def test_reset_forgets_shadows_but_keeps_the_choice():
    manager = make_manager(24)
    queue = manager.block_pool.free_block_queue
    most_protected = max(CANDIDATE_PROTECTED_FRACTIONS)
    queue.leader = next(i for i, candidate in enumerate(CANDIDATES)
                        if candidate.protected_fraction == most_protected)
    queue._follow(CANDIDATES[queue.leader])
    run_prompt(manager, "a", list(range(40)))
    assert manager.reset_prefix_cache()
    assert all(not len(shadow) and not getattr(shadow, "ghost", ()) for shadow in queue.shadows)
    assert queue.upper.num_free_blocks == 0
    assert queue.current_protected_fraction == most_protected


def test_memory_stays_bounded_under_endless_new_content(monkeypatch):
    monkeypatch.setattr(AdaptiveFreeBlockQueue, "shadow_entries", 8)
    manager = make_manager(64)
    queue = manager.block_pool.free_block_queue
    assert queue.sample_rate == 32 / 256  # 8 of 64 blocks' worth of hashes are sampled
    for i in range(400):  # 400 distinct prompts of 6 full blocks: 2,400 hashes
        run_prompt(manager, f"r{i}", [100 * i + t for t in range(25)])
        if i % 3 == 0:  # and a prompt seen before, so something is protected
            run_prompt(manager, f"again{i}", [100 * (i // 2) + t for t in range(25)])
    assert len(queue.ghost) <= queue.ghost_factor * 64
    assert len(queue.documents.documents) <= queue.max_documents
    assert len(queue.release_parts) == queue.num_block_ids
    for shadow, candidate in zip(queue.shadows, CANDIDATES, strict=True):
        assert shadow.capacity == 8
        assert len(shadow) <= shadow.capacity
        if candidate.liveness:
            continue
        assert len(shadow.probation) + len(shadow.protected) <= shadow.capacity
        # The shadow's ghost is as many times its size as the real queue's is the pool's.
        assert len(shadow.ghost) <= queue.ghost_factor * shadow.capacity
        assert len(shadow.protected) <= shadow.max_protected
    assert sum(shadow.num_hits for shadow in queue.shadows) > 0  # the sample saw reuse


@pytest.mark.parametrize("ghost_factor", [2, 4])
def test_a_recomputation_is_protected_only_within_the_reach_followed(ghost_factor,
                                                                     monkeypatch):
    """Content evicted 2.5 cache-fulls of evictions ago and computed again is protected
    under the candidate whose ghost list reaches 4 cache-fulls back, not under 2."""
    # Nothing is judged low-reuse, so the one-offs queue behind the probe in probation.
    monkeypatch.setattr(SignatureReuseEstimate, "is_low_reuse", lambda self, signature: False)
    num_blocks = 16
    manager = make_manager(num_blocks)
    queue = manager.block_pool.free_block_queue
    queue.leader = CANDIDATES.index(Candidate(0.9, True, ghost_factor))
    queue._follow(queue.current_candidate)
    tokens = list(range(9))  # two full blocks
    hashes = Request("probe", tokens, block_hasher=manager.block_hasher).block_hashes
    run_prompt(manager, "x", tokens)
    for i in range(100):  # bounded: a probe that is never evicted must fail, not hang
        if all(h in queue.ghost for h in hashes) and (
                queue.num_evicted - max(queue.ghost[h][0] for h in hashes)
                >= 2.5 * num_blocks):
            break
        run_prompt(manager, f"one-off{i}", [10_000 * (i + 1) + t for t in range(13)])
    assert all(h in queue.ghost for h in hashes)
    ages = [queue.num_evicted - queue.ghost[h][0] for h in hashes]
    assert 2.5 * num_blocks <= min(ages) and max(ages) < 3 * num_blocks
    assert queue.current_candidate.ghost_factor == ghost_factor  # one-offs hit nothing
    run_prompt(manager, "x again", tokens)
    protected = {block.block_hash for block in queue.upper.get_all_free_blocks()}
    if ghost_factor == 4:
        assert set(hashes) <= protected
    else:
        assert not set(hashes) & protected
    # Either way the recomputation was seen: the ghost entries are gone.
    assert not any(h in queue.ghost for h in hashes)


LIVENESS = next(i for i, candidate in enumerate(CANDIDATES) if candidate.liveness)


def follow(queue: AdaptiveFreeBlockQueue, index: int) -> None:
    queue.leader = index
    queue._follow(CANDIDATES[index])


def assert_whole(manager: KVCacheManager) -> None:
    """The queue holds exactly the pool's free blocks, in the segments and, while it is
    followed, in the liveness order."""
    queue = manager.block_pool.free_block_queue
    free = {b.block_id for b in manager.block_pool.blocks if b.ref_cnt == 0}
    segments = [b.block_id for b in queue._segment_blocks()]
    assert sorted(segments) == sorted(free) and queue.num_free_blocks == len(free)
    if queue.follows_liveness:
        ordered = [b.block_id for b in queue.get_all_free_blocks()]
        assert sorted(ordered) == sorted(free)
        assert queue.liveness_queue.num_free_blocks == len(free)


def test_following_the_liveness_order_evicts_in_it_and_keeps_the_segments_whole():
    manager = make_manager(40)
    queue = manager.block_pool.free_block_queue
    rng = random.Random(3)
    documents = [[100_000 * d + t for t in range(13)] for d in range(12)]

    def ask(i: int) -> None:
        document = rng.choice(documents)
        run_prompt(manager, f"r{i}", document + [rng.randrange(10_000) for _ in range(5)],
                   rng.choice([1, 40]))

    for i in range(60):
        ask(i)
    follow(queue, LIVENESS)
    assert queue.follows_liveness and queue.policy_state()["liveness_order"]
    # The segments keep the best of the other orders.
    assert not queue.segments_candidate.liveness
    assert_whole(manager)
    # Every take comes from the front of the liveness order.
    num_taken = []
    take = queue.popleft_n

    def checked_take(n: int) -> list:
        expected = [b.block_id for b in queue.get_all_free_blocks()][:n]
        taken = take(n)
        assert [b.block_id for b in taken] == expected
        num_taken.append(n)
        return taken

    queue.popleft_n = checked_take
    for i in range(60, 160):
        ask(i)
        assert_whole(manager)
    assert sum(num_taken) > 200
    del queue.popleft_n
    follow(queue, 0)
    assert not queue.follows_liveness and queue.liveness_queue is None
    assert_whole(manager)
    assert queue.get_all_free_blocks() == queue._segment_blocks()


def test_a_reset_while_following_the_liveness_order_empties_it():
    manager = make_manager(24)
    queue = manager.block_pool.free_block_queue
    run_prompt(manager, "a", list(range(40)), 3)
    follow(queue, LIVENESS)
    assert manager.reset_prefix_cache()
    assert queue.follows_liveness
    assert all(b.block_hash is None for b in queue.get_all_free_blocks())
    assert_whole(manager)
    assert queue.documents.documents  # what was learned about documents is kept
    run_prompt(manager, "b", list(range(40)), 3)
    assert_whole(manager)


def test_the_liveness_order_keys_a_shared_prefix_by_its_document_and_the_rest_by_its_conversation():
    manager = make_manager(64)
    queue = manager.block_pool.free_block_queue
    classes = queue.liveness_classes
    system = list(range(8))  # two full blocks every conversation starts with
    run_prompt(manager, "first", system + [100, 101, 102, 103])
    follow(queue, LIVENESS)  # its order, over the free blocks, keys them by those parts too
    first_blocks = [b for b in manager.block_pool.blocks if b.block_hash is not None]
    # The only conversation of its document: one class for all, the higher of the two.
    (only,) = {queue.release_parts[b.block_id][0] for b in first_blocks}
    assert classes._pairs[only][0] >= 0 and classes._pairs[only][1] >= 0
    run_prompt(manager, "second", system + [200, 201, 202, 203])
    system_parts = {queue.release_parts[b.block_id]
                    for b in manager.block_pool.blocks[:2]}
    (shared,) = system_parts
    # Released again by the second conversation, the system prompt is the document's...
    assert classes._pairs[shared[0]][1] == -2 and classes._pairs[shared[0]][0] >= 0
    own = [b for b in manager.block_pool.blocks
           if b.block_hash is not None and b.block_id not in (0, 1)
           and queue.release_parts[b.block_id][2] == shared[2]]
    # ... and the second conversation's own block its alone: the document has two.
    assert len(own) == 1
    assert classes._pairs[queue.release_parts[own[0].block_id][0]][0] == -2
    # The liveness shadow saw the request with the same split.
    shadow = queue.shadows[queue.liveness_index]
    assert shadow.shared_parts == shared and shadow.parts[0] != shared[0]
    groups = queue.liveness_queue._group_of
    for block in manager.block_pool.blocks:
        if block.block_hash is not None:
            assert groups[block.block_id].parts == queue.release_parts[block.block_id]


def test_the_liveness_shadow_splits_the_sampled_hashes_where_the_shared_prefix_ends():
    manager = make_manager(4096)
    queue = manager.block_pool.free_block_queue
    threshold = queue.sample_threshold
    assert threshold < 256  # a large pool: a sample of the hashes
    system = list(range(4 * 64))  # 64 full blocks every conversation starts with
    run_prompt(manager, "first", system + [100, 101, 102, 103])
    run_prompt(manager, "second", system + [200, 201, 202, 203])
    shared = manager.block_hasher.hash_blocks(None, system)
    shadow = queue.shadows[queue.liveness_index]
    assert shadow.num_shared == sum(block_hash[-1] < threshold for block_hash in shared)


def test_a_preempted_request_teaches_the_reuse_estimate_nothing():
    manager = make_manager(64)
    queue = manager.block_pool.free_block_queue
    request = Request("preempted", list(range(17)), block_hasher=manager.block_hasher)
    assert manager.allocate_slots(request, 17) is not None
    request.num_computed_tokens = 17
    request.status = RequestStatus.PREEMPTED
    manager.free(request)
    assert queue.reuse.total_inserted == 0 and not queue.reuse.num_inserted
    run_prompt(manager, "finished", list(range(100, 117)))  # as a finished one does
    assert queue.reuse.total_inserted == 4


def test_key_classes_are_read_on_the_conversations_clock_unless_told_otherwise():
    documents, conversations = DocumentLivenessModel(), DocumentLivenessModel()
    documents.rate = 0.05  # a system prompt: asked about far more often than a chat goes on
    for _ in range(3):
        documents.tick()
        conversations.tick()
    assert documents.clock > conversations.clock > 0
    assert LivenessKeyClasses(documents, conversations).clock == conversations.clock
    on_documents = LivenessKeyClasses(documents, conversations, clock="documents")
    assert on_documents.clock == documents.clock
    with pytest.raises(ValueError, match="clock must be one of"):
        LivenessKeyClasses(documents, conversations, clock="requests")


@pytest.mark.parametrize("clock", ["conversations", "documents"])
def test_adaptive_keys_every_release_on_the_clock_it_is_set_to(clock, monkeypatch):
    monkeypatch.setattr(AdaptiveFreeBlockQueue, "liveness_clock", clock)
    manager = make_manager(64)
    queue = manager.block_pool.free_block_queue
    queue.liveness.rate = 0.05  # the two models' clocks now run apart
    system = list(range(8))
    for i in range(4):
        run_prompt(manager, f"c{i}", system + [100 * i + t for t in range(8)])
        model = queue.conversations.model if clock == "conversations" else queue.liveness
        latest = max(queue.release_parts[b.block_id][2] for b in manager.block_pool.blocks
                     if queue.release_parts[b.block_id] is not None)
        clocks = {parts[1] for parts in queue.release_parts
                  if parts is not None and parts[2] == latest}
        assert clocks == {model.clock}
    assert queue.liveness.clock != queue.conversations.model.clock


def test_where_the_prompts_kept_were_dropped_the_documents_latest_prompt_still_counts():
    manager = make_manager(64)
    queue = manager.block_pool.free_block_queue
    queue.conversations.max_seen_hashes = 1  # every prompt but the latest is dropped
    document = list(range(12))  # three full blocks
    run_prompt(manager, "q1", document + [500, 501, 502, 503])
    run_prompt(manager, "other", list(range(9_000, 9_012)))
    first = queue.documents.documents[manager.block_pool.blocks[0].block_hash]
    assert all(recent.prompt is None for recent in first.recent_conversations)
    run_prompt(manager, "q2", document + [600, 601, 602, 603])
    (conversation,) = [c for c in queue.conversations._by_tail.values()
                       if c.prompt is not None]
    # q1's tail, kept with its document, shows the three document blocks were shared:
    # only the question is the new conversation's own.
    assert conversation.own_from == 3
