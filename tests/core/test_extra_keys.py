"""Extra keys: ("lora", name, path) on every block, ("mm", id, offset - block_start) per
overlapping item, ("cache_salt", salt) on block 0 only — in that order."""

from __future__ import annotations

import pytest

from prefixcache.core import BlockHasher, KVCacheManager, MultiModalFeature, Request
from tests.core.helpers import make_manager, schedule_decode, schedule_prefill, seq

BS = 4


@pytest.fixture
def hasher() -> BlockHasher:
    return BlockHasher(BS, "sha256", "seed")


def expected_chain(hasher: BlockHasher, tokens: list[int], extras: list) -> list[bytes]:
    """The spec's chain built by hand from per-block extra keys."""
    parent = None
    out = []
    for i, extra in enumerate(extras):
        parent = hasher.hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS], extra)
        out.append(parent)
    return out


def check(hasher: BlockHasher, tokens: list[int], expected_extras: list, **kwargs) -> Request:
    req = Request("r", tokens, block_hasher=hasher, **kwargs)
    assert len(req.block_hashes) == len(expected_extras)
    assert [req.block_extra_keys(i, BS) for i in range(len(expected_extras))] == expected_extras
    assert req.block_hashes == expected_chain(hasher, tokens, expected_extras)
    return req


def test_no_extra_keys_means_none(hasher):
    check(hasher, seq(0, 12), [None, None, None])


def test_lora_on_every_block(hasher):
    key = ("lora", "sql", "/adapters/sql")
    check(hasher, seq(0, 13), [(key,), (key,), (key,)], lora_name="sql",
          lora_path="/adapters/sql")


def test_lora_without_a_path(hasher):
    check(hasher, seq(0, 8), [(("lora", "sql", None),)] * 2, lora_name="sql")


def test_salt_only_on_block_zero(hasher):
    check(hasher, seq(0, 12), [(("cache_salt", "tenant"),), None, None], cache_salt="tenant")


def test_mm_offsets_relative_to_block_start(hasher):
    # placeholders: A covers [2, 7) -> blocks 0 (+2) and 1 (-2); B covers [6, 7) -> block 1 (+2)
    # C covers [8, 16) -> block 2 (0, a full overlap) and block 3 (-4, a full overlap)
    # D covers [16, 17) -> block 4 (0); block 5 has no item; E covers [23, 24): block 5 (+3)
    feats = (MultiModalFeature("A", 2, 5), MultiModalFeature("B", 6, 1),
             MultiModalFeature("C", 8, 8), MultiModalFeature("D", 16, 1),
             MultiModalFeature("E", 23, 1))
    expected = [
        (("mm", "A", 2),),
        (("mm", "A", -2), ("mm", "B", 2)),
        (("mm", "C", 0),),
        (("mm", "C", -4),),
        (("mm", "D", 0),),
        (("mm", "E", 3),),
        None,
    ]
    check(hasher, seq(0, 28), expected, mm_features=feats)


def test_mm_item_spanning_several_blocks(hasher):
    # one item covers [3, 14): it overlaps blocks 0..3 with offsets 3, -1, -5, -9
    feats = (MultiModalFeature("img", 3, 11),)
    expected = [(("mm", "img", 3),), (("mm", "img", -1),), (("mm", "img", -5),),
                (("mm", "img", -9),), None]
    check(hasher, seq(0, 20), expected, mm_features=feats)


def test_mm_item_ending_at_a_block_boundary_does_not_touch_the_next_block(hasher):
    # [0, 4) is exactly block 0; [8, 12) is exactly block 2
    feats = (MultiModalFeature("a", 0, 4), MultiModalFeature("b", 8, 4))
    check(hasher, seq(0, 16), [(("mm", "a", 0),), None, (("mm", "b", 0),), None],
          mm_features=feats)


def test_order_is_lora_then_mm_then_salt(hasher):
    feats = (MultiModalFeature("m1", 2, 4),)
    expected = [
        (("lora", "a", "/p"), ("mm", "m1", 2), ("cache_salt", "s")),
        (("lora", "a", "/p"), ("mm", "m1", -2)),
        (("lora", "a", "/p"),),
    ]
    check(hasher, seq(0, 12), expected, lora_name="a", lora_path="/p", mm_features=feats,
          cache_salt="s")


def test_design_mm_example_blocks_of_sixteen():
    """The design's image prompt: 8 text tokens, 41 placeholders, then token 4."""
    hasher = BlockHasher(16, "sha256", "seed")
    tokens = [1, 3, 7493, 1681, 1294, 1593, 3937, 9551] + [32000] * 41 + [4]
    feats = (MultiModalFeature("image-hash", 8, 41),)
    req = Request("r", tokens, mm_features=feats, block_hasher=hasher)
    # 50 tokens: 3 full blocks now; block 3 ("<p>, ..., <p>, 4") completes with decode tokens
    assert [req.block_extra_keys(i, 16) for i in range(4)] == [
        (("mm", "image-hash", 8),), (("mm", "image-hash", -8),),
        (("mm", "image-hash", -24),), (("mm", "image-hash", -40),)]
    assert len(req.block_hashes) == 3
    req.append_output_token_ids(seq(900, 14))
    assert len(req.block_hashes) == 4
    block3 = hasher.hash_block_tokens(req.block_hashes[2], req.all_token_ids[48:64],
                                      (("mm", "image-hash", -40),))
    assert req.block_hashes[3] == block3


def test_decode_tokens_completing_an_mm_block_keep_the_mm_key(hasher):
    feats = (MultiModalFeature("img", 9, 2),)  # [9, 11) in block 2, prompt has 10 tokens
    req = Request("r", seq(0, 10), mm_features=feats, block_hasher=hasher)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([10, 11])
    expected = expected_chain(hasher, seq(0, 12), [None, None, (("mm", "img", 1),)])
    assert req.block_hashes == expected


def test_salt_equal_to_a_lora_name_does_not_collide(hasher):
    salted = Request("a", seq(0, 8), cache_salt="x", block_hasher=hasher)
    lora = Request("b", seq(0, 8), lora_name="x", block_hasher=hasher)
    lora_path = Request("c", seq(0, 8), lora_name="x", lora_path="x", block_hasher=hasher)
    assert salted.block_hashes[0] != lora.block_hashes[0]
    assert salted.block_hashes[0] != lora_path.block_hashes[0]
    assert len({salted.block_hashes[1], lora.block_hashes[1], lora_path.block_hashes[1]}) == 3


def test_salt_equal_to_an_mm_identifier_does_not_collide(hasher):
    salted = Request("a", seq(0, 4), cache_salt="x", block_hasher=hasher)
    mm = Request("b", seq(0, 4), mm_features=(MultiModalFeature("x", 0, 1),),
                 block_hasher=hasher)
    assert salted.block_hashes != mm.block_hashes


def test_changed_lora_path_changes_every_hash(hasher):
    a = Request("a", seq(0, 12), lora_name="ad", lora_path="/v1", block_hasher=hasher)
    b = Request("b", seq(0, 12), lora_name="ad", lora_path="/v2", block_hasher=hasher)
    c = Request("c", seq(0, 12), lora_name="other", lora_path="/v1", block_hasher=hasher)
    plain = Request("d", seq(0, 12), block_hasher=hasher)
    for i in range(3):
        assert len({a.block_hashes[i], b.block_hashes[i], c.block_hashes[i],
                    plain.block_hashes[i]}) == 4


def test_different_mm_identifier_changes_every_overlapping_block_and_after(hasher):
    def hashes(identifier):
        feats = (MultiModalFeature(identifier, 5, 6),)  # blocks 1 and 2
        return Request(identifier, seq(0, 16), mm_features=feats,
                       block_hasher=hasher).block_hashes

    a, b = hashes("img-a"), hashes("img-b")
    assert a[0] == b[0]  # before the item: shared
    assert a[1] != b[1] and a[2] != b[2]  # overlapping blocks differ
    assert a[3] != b[3]  # after it: differs through the chain
    plain = Request("p", seq(0, 16), block_hasher=hasher).block_hashes
    assert plain[0] == a[0] and plain[1] != a[1]


def test_mm_offset_difference_changes_the_hash(hasher):
    # same identifier and tokens, placeholder at another position
    a = Request("a", seq(0, 8), mm_features=(MultiModalFeature("i", 1, 2),),
                block_hasher=hasher)
    b = Request("b", seq(0, 8), mm_features=(MultiModalFeature("i", 2, 2),),
                block_hasher=hasher)
    assert a.block_hashes[0] != b.block_hashes[0]


def test_bad_mm_features_are_rejected():
    with pytest.raises(ValueError):
        MultiModalFeature("x", -1, 2)
    with pytest.raises(ValueError):
        MultiModalFeature("x", 0, 0)


def test_non_string_salt_is_rejected():
    with pytest.raises(TypeError):
        Request("r", [1, 2, 3], cache_salt=5)


# -- what the keys mean for the cache ----------------------------------------------------

def test_same_salt_hits_different_salt_misses_entirely():
    mgr = make_manager(num_blocks=12)
    prompt = seq(0, 13)
    assert schedule_prefill(mgr, Request("a", prompt, cache_salt="s1")) == (0, [0, 1, 2, 3])
    same = Request("b", prompt, cache_salt="s1")
    assert schedule_prefill(mgr, same) == (12, [4])
    other = Request("c", prompt, cache_salt="s2")
    assert schedule_prefill(mgr, other) == (0, [5, 6, 7, 8])
    unsalted = Request("d", prompt)
    blocks, hits = mgr.get_computed_blocks(unsalted)
    assert (blocks, hits) == ([], 0)
    # the salts differ in block 0 only, yet block 1 on differs through the chain
    assert all(x != y for x, y in zip(same.block_hashes, other.block_hashes, strict=True))


def test_lora_requests_share_only_with_the_same_adapter():
    mgr = make_manager(num_blocks=12)
    prompt = seq(0, 9)
    schedule_prefill(mgr, Request("a", prompt, lora_name="x", lora_path="/x"))
    assert mgr.get_computed_blocks(Request("b", prompt, lora_name="x", lora_path="/x"))[1] == 8
    assert mgr.get_computed_blocks(Request("c", prompt, lora_name="x", lora_path="/y"))[1] == 0
    assert mgr.get_computed_blocks(Request("d", prompt))[1] == 0


def test_mm_requests_hit_only_with_the_same_images():
    mgr = KVCacheManager(num_blocks=12, block_size=4, hash_seed="s")
    tokens = [1, 2] + [0] * 9 + [3, 4, 5]  # 14 tokens, placeholders [2, 11)
    img_a = (MultiModalFeature("a", 2, 9),)
    r0 = Request("r0", tokens, mm_features=img_a)
    assert schedule_prefill(mgr, r0) == (0, [0, 1, 2, 3])
    # decode completes block 3: its hash has no mm key (the item ended in block 2)
    schedule_decode(mgr, r0, [6, 7])
    assert len(r0.block_hashes) == 4
    r1 = Request("r1", tokens + [6, 7, 8], mm_features=img_a)
    assert schedule_prefill(mgr, r1) == (16, [4])
    assert mgr.get_block_ids("r1") == [0, 1, 2, 3, 4]
    r2 = Request("r2", tokens + [6, 7, 8], mm_features=(MultiModalFeature("b", 2, 9),))
    # block 0 holds placeholders of image b: nothing is shared
    assert mgr.get_computed_blocks(r2) == ([], 0)
