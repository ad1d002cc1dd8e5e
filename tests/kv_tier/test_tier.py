"""The tier on its own (no engine): keys, verification, the writer, both backends."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from prefixcache.kv_tier import (
    KVLayout,
    KVTier,
    kv_tier_url_problem,
    open_backend,
    unshareable_hash_seed_reason,
)
from prefixcache.kv_tier.block_value import (
    InvalidBlockValue,
    decode_block_value,
    encode_block_value,
)

LAYOUT = KVLayout(model_digest="m" * 64, dtype="float32", num_layers=2, num_kv_heads=1,
                  head_dim=4, block_size=2, hash_algo="sha256", none_hash="ab",
                  dtype_size=4)
HASHES = [bytes([i]) * 32 for i in range(1, 6)]
TOKENS = [[2 * i, 2 * i + 1] for i in range(5)]


def payload(i: int) -> bytes:
    return bytes([i]) * LAYOUT.block_nbytes


@pytest.fixture(params=["disk", "redis"])
def tier_url(request, tmp_path):
    if request.param == "disk":
        return f"disk:{tmp_path / 'tier'}"
    return request.getfixturevalue("redis_server").url


def open_tier(url: str, layout: KVLayout = LAYOUT, **options) -> KVTier:
    return KVTier(open_backend(url, timeout_s=1.0), layout, **options)


def store_all(tier: KVTier, indices) -> None:
    for i in indices:
        assert tier.store(HASHES[i], TOKENS[i], payload(i))
    assert tier.flush()


def test_round_trip_and_leading_count(tier_url):
    tier = open_tier(tier_url)
    store_all(tier, [0, 1, 3])  # a gap at 2
    assert tier.lookup(HASHES) == 2
    loaded = tier.load(HASHES, TOKENS)
    assert [bytes(p) for p in loaded] == [payload(0), payload(1)]
    stats = tier.stats
    assert stats.num_blocks_stored == 3 and stats.num_blocks_loaded == 2
    assert stats.num_bytes_written == stats.num_bytes_read * 3 // 2 > 3 * LAYOUT.block_nbytes
    assert stats.num_errors == stats.num_invalid_values == 0
    # Another process's tier of the same layout sees the same blocks.
    other = open_tier(tier_url)
    assert other.lookup(HASHES) == 2
    # Storing again writes nothing new.
    other.store(HASHES[0], TOKENS[0], payload(0))
    assert other.flush()
    assert other.stats.num_writes_skipped == 1 and other.stats.num_blocks_stored == 0
    tier.close()
    other.close()


def test_another_layout_shares_nothing(tier_url):
    tier = open_tier(tier_url)
    store_all(tier, [0, 1])
    for change in ({"dtype": "bfloat16", "dtype_size": 2}, {"model_digest": "n" * 64},
                   {"block_size": 4, "head_dim": 2}, {"none_hash": "cd"},
                   {"hash_algo": "sha256_cbor"}, {"layout_version": 2}):
        foreign = open_tier(tier_url, dataclasses.replace(LAYOUT, **change))
        assert foreign.lookup(HASHES) == 0, change
        foreign.close()
    # Clearing one layout leaves the others' blocks alone.
    foreign = open_tier(tier_url, dataclasses.replace(LAYOUT, none_hash="cd"))
    store_all(foreign, [0])
    assert tier.clear() == 2
    assert tier.lookup(HASHES) == 0 and foreign.lookup(HASHES) == 1
    tier.close()
    foreign.close()


def raw_put(tier: KVTier, key: str, value: bytes) -> None:
    """Overwrite a stored value behind the tier's back."""
    backend = tier.backend
    if hasattr(backend, "_client"):
        backend._client.set(key, value)
    else:
        backend._path(key).write_bytes(value)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "tokens", "hash"])
def test_a_bad_value_is_a_counted_miss(tier_url, damage):
    tier = open_tier(tier_url)
    store_all(tier, [0, 1, 2])
    key = tier.key(HASHES[1])
    good = encode_block_value(tier.fingerprint, HASHES[1], TOKENS[1], payload(1))
    bad = {
        "flip": good[:-5] + bytes([good[-5] ^ 1]) + good[-4:],
        "truncate": good[:len(good) // 2],
        "foreign": encode_block_value(bytes(32), HASHES[1], TOKENS[1], payload(1)),
        "tokens": encode_block_value(tier.fingerprint, HASHES[1], [7, 7], payload(1)),
        "hash": encode_block_value(tier.fingerprint, HASHES[2], TOKENS[1], payload(1)),
    }[damage]
    raw_put(tier, key, bad)
    loaded = tier.load(HASHES[:3], TOKENS[:3])
    assert [bytes(p) for p in loaded] == [payload(0)]  # stops before the bad block
    assert tier.stats.num_invalid_values == 1
    tier.close()


def test_decode_names_the_failed_check():
    fingerprint = LAYOUT.fingerprint()
    value = encode_block_value(fingerprint, HASHES[0], TOKENS[0], payload(0))
    assert bytes(decode_block_value(value, fingerprint, HASHES[0], TOKENS[0],
                                    LAYOUT.block_nbytes)) == payload(0)
    cases = {
        "fingerprint": (value, bytes(32), HASHES[0], TOKENS[0], LAYOUT.block_nbytes),
        "block_hash": (value, fingerprint, HASHES[1], TOKENS[0], LAYOUT.block_nbytes),
        "token_ids": (value, fingerprint, HASHES[0], TOKENS[1], LAYOUT.block_nbytes),
        "size": (value, fingerprint, HASHES[0], TOKENS[0], LAYOUT.block_nbytes + 1),
        "truncated": (value[:10], fingerprint, HASHES[0], TOKENS[0], LAYOUT.block_nbytes),
        "format": (b"XXXX" + value[4:], fingerprint, HASHES[0], TOKENS[0],
                   LAYOUT.block_nbytes),
        "checksum": (value[:-1] + b"\x01", fingerprint, HASHES[0], TOKENS[0],
                     LAYOUT.block_nbytes),
    }
    for reason, args in cases.items():
        with pytest.raises(InvalidBlockValue) as caught:
            decode_block_value(*args)
        assert caught.value.reason == reason


def test_a_dead_server_is_a_miss_and_an_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the with ends: nothing listens
    tier = open_tier(f"redis://127.0.0.1:{port}/0", retry_interval_s=0.0)
    assert tier.lookup(HASHES) == 0
    assert tier.load(HASHES, TOKENS) == []
    assert tier.store(HASHES[0], TOKENS[0], payload(0))
    assert tier.flush()
    stats = tier.stats
    assert stats.num_errors == 3 and stats.num_writes_dropped == 1
    tier.close()


def test_after_an_error_the_tier_rests(redis_server):
    tier = open_tier(redis_server.url, retry_interval_s=3600)
    store_all(tier, [0])
    redis_server.stop()
    assert tier.lookup(HASHES) == 0
    assert tier.lookup(HASHES) == 0  # not asked again: one error, not two
    assert not tier.store(HASHES[1], TOKENS[1], payload(1))
    assert tier.stats.num_errors == 1
    tier.close()


def test_full_write_queue_drops_and_counts(tmp_path):
    tier = open_tier(f"disk:{tmp_path}", write_queue_bytes=1)
    assert not tier.store(HASHES[0], TOKENS[0], payload(0))
    assert tier.flush()
    assert tier.stats.num_writes_dropped == 1 and tier.lookup(HASHES) == 0


def test_wants(tmp_path):
    tier = open_tier(f"disk:{tmp_path}", admission="seen-twice")
    assert not tier.wants(HASHES[0])  # first sight
    assert tier.wants(HASHES[0])  # second
    store_all(tier, [0])
    assert not tier.wants(HASHES[0])  # held now
    always = open_tier(f"disk:{tmp_path}")
    assert always.wants(HASHES[1]) and always.wants(HASHES[1])


def test_disk_tier_survives_a_restart_and_keeps_its_size(tmp_path):
    url = f"disk:{tmp_path / 'kv'}"
    tier = open_tier(url)
    store_all(tier, range(5))
    tier.close()
    restarted = open_tier(url)
    assert [bytes(p) for p in restarted.load(HASHES, TOKENS)] == [payload(i) for i in range(5)]
    value_bytes = len(encode_block_value(LAYOUT.fingerprint(), HASHES[0], TOKENS[0],
                                         payload(0)))
    assert restarted.backend.num_bytes == 5 * value_bytes
    # Bounded to 3 values: the 4th prunes down to nine tenths (2 values), least recently
    # used first.
    bounded = KVTier(open_backend(url, max_bytes=3 * value_bytes), LAYOUT)
    bounded.clear()
    store_all(bounded, range(3))
    for i, path in enumerate(bounded.backend._path(bounded.key(h)) for h in HASHES[:3]):
        os.utime(path, (1000 + i, 1000 + i))
    store_all(bounded, [3])
    assert bounded.backend.num_bytes == 2 * value_bytes
    held = [bounded.backend.exists_many([bounded.key(h)])[0] for h in HASHES[:4]]
    assert held == [False, False, True, True]


def test_url_checks_and_the_seed_rule(monkeypatch):
    assert kv_tier_url_problem("redis://127.0.0.1:6379/0") is None
    assert kv_tier_url_problem("disk:/tmp/x") is None
    for bad in ("disk:", "127.0.0.1:6379", "http://x", "redis://h:99999/0", "redis:///0",
                "redis://h:1/abc"):
        assert kv_tier_url_problem(bad) is not None, bad
    with pytest.raises(ValueError, match="maxmemory"):
        open_backend("redis://127.0.0.1:1/0", max_bytes=10)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert unshareable_hash_seed_reason("sha256", None) is None
    assert unshareable_hash_seed_reason("xxhash", "s") is None
    assert "random seed" in unshareable_hash_seed_reason("xxhash_cbor", None)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert unshareable_hash_seed_reason("xxhash", None) is None
