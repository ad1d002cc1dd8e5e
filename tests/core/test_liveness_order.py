"""The liveness order ``adaptive`` can follow: its shadow cache and its queue over real
free blocks, keyed ``logit(p) + H(release)``."""

from __future__ import annotations

import random

import pytest

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction import liveness_order
from prefixcache.core.eviction.liveness_order import (
    NATIVE_LIVENESS_SHADOW,
    UNKNOWN_CLASS,
    LivenessOrderQueue,
    PythonShadowLivenessOrder,
)

SHADOWS = [pytest.param(PythonShadowLivenessOrder, id="python"),
           pytest.param(liveness_order.NativeShadowLivenessOrder, id="c",
                        marks=pytest.mark.skipif(not NATIVE_LIVENESS_SHADOW,
                                                 reason="built without a C compiler"))]


class Estimates:
    """What the order reads of a DocumentLivenessModel, set by hand: log-odds per class,
    the overall log-odds, the clock and the number of fits."""

    def __init__(self, log_odds: list[float]) -> None:
        self.log_odds = log_odds
        self.overall_log_odds = 0.0
        self.clock = 0.0
        self.num_fits = 0

    def class_log_odds(self, finest_class: int) -> float:
        return self.log_odds[finest_class]

    @property
    def all_class_log_odds(self) -> list[float]:
        return self.log_odds

    def refit(self, rng: random.Random) -> None:
        self.log_odds = [rng.uniform(-3, 3) for _ in self.log_odds]
        self.overall_log_odds = rng.uniform(-3, 3)
        self.num_fits += 1


def key_of(model: Estimates, parts) -> float:
    finest_class, clock, _ = parts
    log_odds = (model.overall_log_odds if finest_class == UNKNOWN_CLASS
                else model.class_log_odds(finest_class))
    return log_odds + clock


@pytest.mark.parametrize("shadow_type", SHADOWS)
@pytest.mark.parametrize("seed", range(4))
def test_the_shadow_keeps_the_highest_keys_and_counts_hits(seed, shadow_type):
    """Against a plain model: every hash given is held with the access's parts, or the
    shared parts for the first ``num_shared`` (a hash given again takes the new ones),
    then the lowest (key, order) go while more than the capacity are held, the order
    counting hashes deepest first; estimates change at random refits."""
    rng = random.Random(seed)
    model = Estimates([rng.uniform(-3, 3) for _ in range(5)])
    shadow = shadow_type(12, model)
    held: dict[bytes, tuple] = {}  # hash -> (parts, order)
    order = 0
    num_hits = 0
    for step in range(600):
        model.clock += rng.random()
        if rng.random() < 0.05:
            model.refit(rng)
        parts = (rng.choice([UNKNOWN_CLASS, 0, 1, 2, 3, 4]), model.clock, step)
        shared_parts = (rng.choice([0, 1, 2, 3, 4]), model.clock, step)
        hashes = list(dict.fromkeys(bytes([rng.randrange(40)]) * 4
                                    for _ in range(rng.randrange(1, 6))))
        num_shared = rng.choice([0, 0, rng.randrange(len(hashes) + 1)])
        expected_hits = sum(h in held for h in hashes)
        for position in range(len(hashes) - 1, -1, -1):
            order += 1
            held[hashes[position]] = (shared_parts if position < num_shared else parts, order)
        while len(held) > 12:
            lowest = min(held, key=lambda h: (key_of(model, held[h][0]), held[h][1]))
            del held[lowest]
        shadow.parts, shadow.shared_parts, shadow.num_shared = parts, shared_parts, num_shared
        assert shadow.access(hashes) == expected_hits
        num_hits += expected_hits
        assert shadow.keys_in_order() == sorted(
            held, key=lambda h: (key_of(model, held[h][0]), held[h][1]))
        assert len(shadow) == len(held)
    assert shadow.num_hits == num_hits > 0
    shadow.forget()
    assert not len(shadow) and shadow.keys_in_order() == []


def blocks_with_hashes(count: int) -> list[KVCacheBlock]:
    blocks = [KVCacheBlock(i) for i in range(count)]
    for block in blocks:
        block.block_hash = block.block_id.to_bytes(4, "big") * 8
    return blocks


def test_the_queue_built_from_free_blocks_takes_empty_ones_then_the_lowest_keys():
    model = Estimates([0.0, -2.0])
    blocks = blocks_with_hashes(8)
    blocks[3].block_hash = blocks[6].block_hash = None  # empty: first, in the order given
    early = (0, 1.0, 1)  # key 1.0
    late_low = (1, 2.5, 2)  # key 0.5: lower, though released later
    late_same = (0, 1.0, 3)  # key 1.0, as `early`, but released later
    parts_of = [early, late_low, early, None, late_same, late_low, None, None]
    given = [blocks[i] for i in (4, 0, 3, 5, 2, 6, 1, 7)]
    model.clock = 9.0  # block 7 has no parts: an unknown document's, released now
    queue = LivenessOrderQueue.from_free_blocks(model, given, parts_of)
    expected = [3, 6, 5, 1, 0, 2, 4, 7]
    assert [b.block_id for b in queue.get_all_free_blocks()] == expected
    assert queue.num_free_blocks == 8
    queue.remove(blocks[1])
    expected.remove(1)
    assert [b.block_id for b in queue.popleft_n(7)] == expected
    assert queue.num_free_blocks == 0


def test_content_without_parts_goes_after_releases_of_the_same_key():
    """Blocks released without parts are keyed as an unknown document's released now: on
    a tie with a release's key they go after it, as the latest release would."""
    model = Estimates([0.0])
    model.clock = 1.0  # the unknown document's key: overall log-odds 0 + 1.0
    blocks = blocks_with_hashes(3)
    parts_of = [None, (0, 1.0, 1), (0, 1.0, 2)]  # keys 1.0 too, released 1st and 2nd
    queue = LivenessOrderQueue.from_free_blocks(model, [blocks[0], blocks[2], blocks[1]],
                                                parts_of)
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 2, 0]


def test_the_queue_rekeys_its_releases_when_the_model_refits():
    model = Estimates([0.0, 0.0])
    blocks = blocks_with_hashes(4)
    queue = LivenessOrderQueue(model)
    queue.add_released(blocks[:2], (0, 1.0, 1))
    queue.add_released(blocks[2:], (1, 2.0, 2))
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3]
    model.log_odds = [5.0, 0.0]  # class 0 now far likelier to be asked about again
    model.num_fits += 1
    empty = KVCacheBlock(9)
    queue.add_released([empty], (1, 3.0, 3))  # a release after the refit re-keys
    assert [b.block_id for b in queue.get_all_free_blocks()] == [9, 2, 3, 0, 1]
    assert [b.block_id for b in queue.popleft_n(5)] == [9, 2, 3, 0, 1]


@pytest.mark.skipif(not NATIVE_LIVENESS_SHADOW, reason="built without a C compiler")
def test_the_c_shadow_refuses_what_it_cannot_use():
    from prefixcache.core.eviction._key_order_shadow_native import KeyOrderShadow

    shadow = KeyOrderShadow(4)
    with pytest.raises(TypeError):
        shadow.access(["not bytes"], 0, 1.0, 1.0)
    assert shadow.access([b"a" * 8, b"b" * 8], 3, 1.0, 1.0) == 0
    with pytest.raises(IndexError):  # class 3 has no log-odds in a list of two
        shadow.rekey([0.0, 0.0], 0.0)
    shadow.rekey([0.0, 0.0, 0.0, -5.0], 0.0)
    assert shadow.keys_in_order() == [b"b" * 8, b"a" * 8]  # the deepest entered first
    assert shadow.access([b"a" * 8], UNKNOWN_CLASS, 2.0, 2.0) == 1 and shadow.num_hits == 1
