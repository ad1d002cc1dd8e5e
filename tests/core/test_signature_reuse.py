"""Per-signature reuse rates of new content, with decay: the estimate ``adaptive`` and
``learned-reuse`` judge low-reuse content by."""

from __future__ import annotations

import pytest

from prefixcache.core.eviction.signature_reuse import SignatureReuseEstimate


def test_every_count_halves_when_the_inserted_total_passes_the_memory():
    estimate = SignatureReuseEstimate(memory_blocks=10)
    assert estimate.insert("a", 6) == 0
    estimate.credit("a", 0, 4)
    assert estimate.insert("b", 4) == 0  # 10: not past the memory yet
    assert estimate.insert("b", 2) == 1  # 12: past it, every count halves
    assert estimate.num_inserted == {"a": 3.0, "b": 3.0}
    assert estimate.num_reused == {"a": 2.0}
    assert (estimate.total_inserted, estimate.total_reused) == (6.0, 2.0)


def test_a_reuse_counts_with_the_weight_its_insertion_has_left():
    estimate = SignatureReuseEstimate(memory_blocks=4)
    epoch = estimate.insert("a", 4)
    estimate.insert("b", 4)  # past the memory: halves once
    estimate.insert("b", 4)  # and again
    estimate.credit("a", epoch, 4)  # inserted two halvings ago: a quarter of its weight
    assert estimate.num_reused["a"] == pytest.approx(1.0) == estimate.num_inserted["a"]


def test_low_reuse_is_well_below_the_overall_rate_and_nothing_is_low_without_history():
    estimate = SignatureReuseEstimate(memory_blocks=1_000)
    assert not estimate.is_low_reuse("a")
    for _ in range(10):
        for signature in ("reused", "one-off"):
            epoch = estimate.insert(signature, 4)
        estimate.credit("reused", epoch, 4)
    overall = estimate.overall_reuse_rate()
    assert overall == pytest.approx((40 + 1) / (80 + 2))
    # Shrunk towards the overall rate by the prior's weight.
    assert estimate.reuse_rate("one-off") == pytest.approx(4 * overall / (40 + 4))
    assert estimate.reuse_rate("reused") == pytest.approx((40 + 4 * overall) / (40 + 4))
    assert estimate.is_low_reuse("one-off")
    assert not estimate.is_low_reuse("reused")
    assert not estimate.is_low_reuse("never seen")  # the prior alone: the overall rate
