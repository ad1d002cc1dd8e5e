"""Block hashing: vLLM's vectors byte for byte, seeds, the chain, and injectivity."""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
import warnings

import cbor2
import pytest
import xxhash

from prefixcache.core import (
    DEFAULT_HASH_SEED,
    HASH_ALGOS,
    BlockHasher,
    KVCacheManager,
    MultiModalFeature,
    Request,
    block_hash_to_int64,
    get_hash_fn,
    resolve_hash_seed,
)
from tests.core.helpers import schedule_decode, schedule_prefill, seq
from tests.data_paths import VLLM_HASH_VECTORS_PATH

ALL_ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def _load_vectors() -> list[dict]:
    return json.loads(VLLM_HASH_VECTORS_PATH.read_text())["vectors"]


VECTORS = _load_vectors()


def _vector_id(v: dict) -> str:
    return f"{v['algo']}|{v['seed']}|{v['case']}"


def _as_extra(extra_keys):
    """JSON lists back to the tagged tuples the hash is defined over."""
    if extra_keys is None:
        return None
    return tuple(tuple(key) for key in extra_keys)


# How each shared vector's extra keys arise from a request (the spec's key rules).
CASE_REQUEST_KWARGS = {
    "one block, no extra keys": {},
    "three chained blocks of 16": {},
    "cache_salt on the first block only": {"cache_salt": "tenant-a"},
    "lora on every block": {"lora_name": "sql-adapter", "lora_path": "/adapters/sql"},
    "multimodal item starting inside block 0 and continuing into block 1": {
        "mm_features": (MultiModalFeature("img-hash-abc", 8, 24),),
    },
    "lora, mm and salt together (order: lora, mm, salt)": {
        "lora_name": "a", "lora_path": "/p",
        "mm_features": (MultiModalFeature("m1", 2, 2),), "cache_salt": "s",
    },
    "large token ids": {},
}


@pytest.fixture
def no_env_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


# -- vLLM's vectors (data/compat/) --------------------------------------------------------

def test_vectors_cover_both_algorithms_and_every_case():
    algos = {v["algo"] for v in VECTORS}
    seeds = {v["seed"] for v in VECTORS}
    assert algos == {"sha256_cbor", "xxhash_cbor"}
    assert {"vllm-none-hash", "0"} <= seeds
    assert len(VECTORS) >= 14
    assert set(CASE_REQUEST_KWARGS) == {v["case"] for v in VECTORS}


@pytest.mark.parametrize("vector", VECTORS, ids=_vector_id)
def test_vector_none_hash_and_chain(vector):
    block_size = len(vector["blocks"][0]["tokens"])
    hasher = BlockHasher(block_size, vector["algo"], vector["seed"])
    assert hasher.none_hash.hex() == vector["none_hash_hex"]
    parent = None
    hashes = []
    for block in vector["blocks"]:
        parent = hasher.hash_block_tokens(parent, block["tokens"], _as_extra(block["extra_keys"]))
        hashes.append(parent)
    assert [h.hex() for h in hashes] == vector["block_hashes_hex"]
    assert [block_hash_to_int64(h) for h in hashes] == vector["event_block_hashes_int64"]
    # The bulk path hashes the same chain.
    tokens = [t for block in vector["blocks"] for t in block["tokens"]]
    extras = [_as_extra(block["extra_keys"]) for block in vector["blocks"]]
    assert [h.hex() for h in hasher.hash_blocks(None, tokens, extras)] == \
        vector["block_hashes_hex"]


@pytest.mark.parametrize("vector", VECTORS, ids=_vector_id)
def test_vector_through_a_request(vector, no_env_seed):
    """A request whose lora/mm/salt produce the vector's extra keys gets its exact hashes."""
    block_size = len(vector["blocks"][0]["tokens"])
    tokens = [t for block in vector["blocks"] for t in block["tokens"]]
    mgr = KVCacheManager(num_blocks=8, block_size=block_size, hash_algo=vector["algo"],
                         hash_seed=vector["seed"])
    req = Request("r", tokens, **CASE_REQUEST_KWARGS[vector["case"]])
    mgr.get_computed_blocks(req)
    assert [h.hex() for h in req.block_hashes] == vector["block_hashes_hex"]


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
def test_vector_with_seed_from_pythonhashseed(algo, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    vector = next(v for v in VECTORS if v["algo"] == algo and v["seed"] == "0")
    hasher = BlockHasher(len(vector["blocks"][0]["tokens"]), algo)
    assert hasher.hash_seed == "0"
    assert hasher.none_hash.hex() == vector["none_hash_hex"]


def test_vector_default_seed_for_sha256_cbor(no_env_seed):
    vector = next(v for v in VECTORS if v["algo"] == "sha256_cbor"
                  and v["seed"] == "vllm-none-hash")
    hasher = BlockHasher(4, "sha256_cbor")
    assert hasher.none_hash.hex() == vector["none_hash_hex"]


def test_block_hash_to_int64_is_low_eight_bytes_big_endian():
    digest = bytes(range(32))
    assert block_hash_to_int64(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    assert block_hash_to_int64(b"\xff" * 16) == 2**64 - 1
    assert block_hash_to_int64(b"\x00" * 8 + b"\x00" * 7 + b"\x05") == 5


# -- the hash functions are what the design names --------------------------------------

SAMPLE_OBJ = (b"\x01" * 32, (1, 2, 3, 4), (("lora", "a", "/p"),))


def test_cbor_algorithms_are_canonical_cbor():
    encoded = cbor2.dumps(SAMPLE_OBJ, canonical=True)
    assert get_hash_fn("sha256_cbor")(SAMPLE_OBJ) == hashlib.sha256(encoded).digest()
    assert get_hash_fn("xxhash_cbor")(SAMPLE_OBJ) == xxhash.xxh3_128(encoded).digest()


def test_xxhash_is_xxh3_128_over_pickle():
    encoded = pickle.dumps(SAMPLE_OBJ, protocol=pickle.HIGHEST_PROTOCOL)
    assert get_hash_fn("xxhash")(SAMPLE_OBJ) == xxhash.xxh3_128(encoded).digest()


@pytest.mark.parametrize("algo,size", [("sha256", 32), ("sha256_cbor", 32), ("xxhash", 16),
                                       ("xxhash_cbor", 16)])
def test_digest_sizes(algo, size):
    assert len(get_hash_fn(algo)(SAMPLE_OBJ)) == size
    assert len(BlockHasher(4, algo, "seed").hash_block_tokens(None, [1, 2, 3, 4])) == size


def test_hash_algos_lists_the_four_names():
    assert tuple(HASH_ALGOS) == ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


# -- seed resolution ---------------------------------------------------------------------

@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_explicit_seed_beats_environment(algo, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_hash_seed(algo, "mine") == "mine"
        hasher = BlockHasher(4, algo, "mine")
    assert hasher.none_hash == get_hash_fn(algo)("mine")


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_environment_seed_beats_default(algo, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_hash_seed(algo) == "123"
        hasher = BlockHasher(4, algo)
    assert hasher.none_hash == get_hash_fn(algo)("123")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_sha256_algorithms_default_to_vllms_seed(algo, no_env_seed):
    assert DEFAULT_HASH_SEED == "vllm-none-hash"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_hash_seed(algo) == "vllm-none-hash"
        first = BlockHasher(4, algo)
        second = BlockHasher(4, algo)
    assert first.none_hash == second.none_hash == get_hash_fn(algo)("vllm-none-hash")


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_algorithms_get_a_random_seed_with_a_warning(algo, no_env_seed):
    with pytest.warns(Warning):
        first = resolve_hash_seed(algo)
    with pytest.warns(Warning):
        second = resolve_hash_seed(algo)
    assert first != second
    assert DEFAULT_HASH_SEED not in (first, second)
    with pytest.warns(Warning):
        hasher_a = BlockHasher(4, algo)
    with pytest.warns(Warning):
        hasher_b = BlockHasher(4, algo)
    assert hasher_a.none_hash != hasher_b.none_hash
    assert hasher_a.none_hash == get_hash_fn(algo)(hasher_a.hash_seed)
    # Two managers with random seeds share nothing.
    assert hasher_a.hash_block_tokens(None, [1, 2, 3, 4]) != \
        hasher_b.hash_block_tokens(None, [1, 2, 3, 4])


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_seeded_xxhash_is_reproducible_and_silent(algo, no_env_seed):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = BlockHasher(4, algo, "cluster")
        b = BlockHasher(4, algo, "cluster")
    assert a.none_hash == b.none_hash
    assert a.hash_blocks(None, seq(0, 12)) == b.hash_blocks(None, seq(0, 12))


# -- the hash chain ----------------------------------------------------------------------

@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_hash_block_tokens_is_hash_fn_of_the_triple(algo):
    hasher = BlockHasher(4, algo, "s")
    hash_fn = get_hash_fn(algo)
    parent = hasher.hash_block_tokens(None, [9, 8, 7, 6])
    assert parent == hash_fn((hasher.none_hash, (9, 8, 7, 6), None))
    extra = (("mm", "img", -2), ("cache_salt", "x"))
    assert hasher.hash_block_tokens(parent, [1, 2, 3, 4], extra) == \
        hash_fn((parent, (1, 2, 3, 4), extra))
    # a list and a tuple of the same tokens hash alike
    assert hasher.hash_block_tokens(parent, (1, 2, 3, 4)) == \
        hasher.hash_block_tokens(parent, [1, 2, 3, 4])


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_hash_blocks_is_the_chain_of_hash_block_tokens(algo):
    hasher = BlockHasher(4, algo, "s")
    tokens = seq(100, 14)  # three full blocks and a partial one
    extras = [None, (("mm", "a", 1),), None]
    expected = []
    parent = None
    for i in range(3):
        parent = hasher.hash_block_tokens(parent, tokens[4 * i:4 * i + 4], extras[i])
        expected.append(parent)
    assert hasher.hash_blocks(None, tokens, extras) == expected
    # continuing a chain from a parent equals the tail of the full chain
    assert hasher.hash_blocks(expected[0], tokens[4:12], extras[1:]) == expected[1:]
    # without extra keys
    plain = hasher.hash_blocks(None, tokens)
    assert plain[0] == hasher.hash_block_tokens(None, tokens[:4])
    assert plain[1] == hasher.hash_block_tokens(plain[0], tokens[4:8])
    assert len(plain) == 3


@pytest.mark.parametrize("algo", ALL_ALGOS)
@pytest.mark.parametrize("parent_len", [0, 1, 8, 16, 31, 32, 33, 64])
def test_hash_blocks_equals_the_chain_for_a_first_parent_of_any_length(algo, parent_len):
    """The sha256 fast path builds its headers outside the chain; the first parent (a
    caller's own seed, or a 16-byte xxhash digest) need not be a 32-byte sha256 digest."""
    hasher = BlockHasher(4, algo, "s")
    first_parent = bytes(range(parent_len))
    tokens = seq(100, 13)
    for extras in (None, [(("mm", "a", 1),), None, (("cache_salt", "x"),)]):
        expected = []
        parent = first_parent
        for i in range(3):
            parent = hasher.hash_block_tokens(parent, tokens[4 * i:4 * i + 4],
                                              None if extras is None else extras[i])
            expected.append(parent)
        assert hasher.hash_blocks(first_parent, tokens, extras) == expected


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_only_full_blocks_are_hashed(algo, no_env_seed):
    hasher = BlockHasher(4, algo, "s")
    assert hasher.hash_blocks(None, [1, 2, 3]) == []
    assert len(hasher.hash_blocks(None, seq(0, 7))) == 1
    assert len(hasher.hash_blocks(None, seq(0, 8))) == 2
    req = Request("r", seq(0, 7), block_hasher=hasher)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids(7)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([8, 9, 10])
    assert len(req.block_hashes) == 2
    req.append_output_token_ids(11)
    assert len(req.block_hashes) == 3


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_chain_depends_on_the_whole_prefix(algo):
    hasher = BlockHasher(4, algo, "s")
    a = hasher.hash_blocks(None, [1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.hash_blocks(None, [0, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0]
    assert a[1] != b[1]  # same block tokens, different prefix


CBOR_EDGE_TOKENS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1,
                    -1, -24, -25, -256, -257, 2**64 - 1]


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
@pytest.mark.parametrize("block_size", [1, 23, 24, 255, 256, 300])
def test_cbor_bulk_path_equals_canonical_cbor_of_the_triple(algo, block_size):
    """Whatever shortcut builds the CBOR, it must be the bytes cbor2 gives for the tuple:
    array and integer heads of every width, negative and 64-bit ids, extra keys."""
    hasher = BlockHasher(block_size, algo, "s")
    digest = hashlib.sha256 if algo == "sha256_cbor" else xxhash.xxh3_128
    tokens = [CBOR_EDGE_TOKENS[i % len(CBOR_EDGE_TOKENS)] + (i // len(CBOR_EDGE_TOKENS)) * 7
              for i in range(2 * block_size)]
    extras = [(("mm", "img", -3), ("cache_salt", "x" * 30)), None]
    got = hasher.hash_blocks(None, tokens, extras)
    parent = digest(cbor2.dumps("s", canonical=True)).digest()
    assert hasher.none_hash == parent
    for i in range(2):
        triple = (parent, tuple(tokens[i * block_size:(i + 1) * block_size]), extras[i])
        parent = digest(cbor2.dumps(triple, canonical=True)).digest()
        assert got[i] == parent
    # and again, now that the per-integer encodings may be memoised
    assert hasher.hash_blocks(None, tokens, extras) == got


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
def test_cbor_distinguishes_ids_that_share_low_bytes(algo):
    hasher = BlockHasher(2, algo, "s")
    pairs = [[1, 256], [1, 1], [257, 0], [-1, 0], [2**32 + 1, 0], [1, 0], [0, 1]]
    digests = {hasher.hash_blocks(None, p)[0] for p in pairs}
    assert len(digests) == len(pairs)


# -- incremental hashing -----------------------------------------------------------------

INCREMENTAL_CASES = {
    "plain": {},
    "salt": {"cache_salt": "tenant"},
    "lora": {"lora_name": "ad", "lora_path": "/ad"},
    "mm-and-salt": {
        "cache_salt": "t",
        "mm_features": (MultiModalFeature("img0", 2, 5), MultiModalFeature("img1", 9, 2),
                        MultiModalFeature("img2", 14, 7)),
    },
}


@pytest.mark.parametrize("algo", ALL_ALGOS)
@pytest.mark.parametrize("case", list(INCREMENTAL_CASES))
@pytest.mark.parametrize("chunks", [[1] * 20, [3, 5, 1, 7, 4], [20]])
def test_incremental_hashing_equals_hashing_from_scratch(algo, case, chunks):
    kwargs = INCREMENTAL_CASES[case]
    hasher = BlockHasher(4, algo, "s")
    prompt = seq(50, 3)
    tail = seq(500, 20)
    grown = Request("grown", prompt, block_hasher=hasher, **kwargs)
    pos = 0
    for n in chunks:
        piece = tail[pos:pos + n]
        grown.append_output_token_ids(piece[0] if n == 1 else piece)
        pos += n
        fresh = Request("fresh", prompt + tail[:pos], block_hasher=hasher, **kwargs)
        assert grown.block_hashes == fresh.block_hashes
        assert len(grown.block_hashes) == (3 + pos) // 4
    assert grown.all_token_ids == prompt + tail
    assert grown.output_token_ids == tail


def test_hashes_are_computed_when_the_manager_first_sees_the_request(no_env_seed):
    """Tokens appended before the manager saw the request are hashed on first sight."""
    mgr = KVCacheManager(num_blocks=8, block_size=4, hash_seed="s")
    req = Request("r", seq(0, 6))
    assert req.block_hashes == []
    req.append_output_token_ids([6, 7])
    mgr.get_computed_blocks(req)
    assert req.block_hashes == mgr.block_hasher.hash_blocks(None, seq(0, 8))


# -- injectivity of the default encoding -------------------------------------------------

PARENT = hashlib.sha256(b"parent").digest()

DISTINCT_INPUTS = [
    (PARENT, (1, 2, 3, 4), None),
    (PARENT, (1, 2, 3), None),
    (PARENT, (1, 2, 3, 4, 0), None),
    (PARENT, (0, 1, 2, 3, 4), None),
    (PARENT, (4, 3, 2, 1), None),
    (PARENT, (1, 2, 3, 4), ()),
    (PARENT, (1, 2, 3, 4), (("cache_salt", "x"),)),
    (PARENT, (1, 2, 3, 4), (("cache_salt", "y"),)),
    (PARENT, (1, 2, 3, 4), (("lora", "x", None),)),
    (PARENT, (1, 2, 3, 4), (("mm", "x", 0),)),
    (PARENT, (1, 2, 3, 4), (("mm", "x", -1),)),
    (PARENT, (1, 2, 3, 4), (("mm", "x", 0), ("mm", "y", 1))),
    (PARENT, (1, 2, 3, 4), (("mm", "y", 1), ("mm", "x", 0))),
    (PARENT, (1, 2, 3, 256), None),
    (PARENT, (1, 2, 3, 2**31), None),
    (PARENT, (1, 2, 3, 2**32 + 4), None),
    (PARENT, (1, 2, 3, 2**63 - 1), None),
    (PARENT, (1, 2, 3, -1), None),
    (PARENT, (1, 2, 3, -4), None),
    (PARENT, (1, 2, 3, 65536 * 4), None),
    (PARENT, (), None),
    (PARENT, (0,), None),
    (PARENT, (0, 0), None),
    (hashlib.sha256(b"other").digest(), (1, 2, 3, 4), None),
]


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_distinct_inputs_hash_distinctly(algo):
    hash_fn = get_hash_fn(algo)
    digests = [hash_fn(obj) for obj in DISTINCT_INPUTS]
    assert len(set(digests)) == len(DISTINCT_INPUTS)
    # and the seed (a plain string) never looks like a block
    assert hash_fn("vllm-none-hash") not in digests


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_equal_inputs_hash_equally(algo):
    hash_fn = get_hash_fn(algo)
    for obj in DISTINCT_INPUTS:
        copy = (bytes(obj[0]), tuple(list(obj[1])), obj[2])
        assert hash_fn(copy) == hash_fn(obj)


def test_default_sha256_splits_of_the_same_tokens_differ():
    hasher = BlockHasher(2, "sha256", "s")
    # The same token stream hashed with different block boundaries is different content.
    two_by_two = hasher.hash_blocks(None, [1, 2, 3, 4])
    h1 = hasher.hash_block_tokens(None, [1])
    h123 = hasher.hash_block_tokens(h1, [2, 3, 4])
    assert h123 != two_by_two[-1]
    h12 = hasher.hash_block_tokens(None, [1, 2])
    assert hasher.hash_block_tokens(h12, [3, 4]) == two_by_two[-1]
    assert hasher.hash_block_tokens(h12, [3]) != hasher.hash_block_tokens(h12, [3, 4])


# -- missing xxhash, unknown names -------------------------------------------------------

@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_the_package_is_a_clear_import_error(algo, monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ImportError, match="xxhash"):
        get_hash_fn(algo)
    with pytest.raises(ImportError, match="xxhash"):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo=algo, hash_seed="s")
    # the sha256 algorithms do not need it
    assert len(get_hash_fn("sha256")(SAMPLE_OBJ)) == 32
    assert len(get_hash_fn("sha256_cbor")(SAMPLE_OBJ)) == 32


@pytest.mark.parametrize("name", ["md5", "SHA256", "sha-256", "", "xxhash64"])
def test_unknown_algorithm_is_a_value_error_naming_the_choices(name):
    with pytest.raises(ValueError) as excinfo:
        get_hash_fn(name)
    message = str(excinfo.value)
    for choice in ALL_ALGOS:
        assert choice in message
    with pytest.raises(ValueError, match="sha256_cbor"):
        BlockHasher(4, name, "s")
    with pytest.raises(ValueError, match="xxhash_cbor"):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo=name)


# -- all four algorithms drive the manager ----------------------------------------------

@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_every_algorithm_serves_hits(algo):
    mgr = KVCacheManager(num_blocks=10, block_size=4, hash_algo=algo, hash_seed="s")
    r0 = Request("r0", seq(0, 10))
    assert schedule_prefill(mgr, r0) == (0, [0, 1, 2])
    assert schedule_decode(mgr, r0, [10, 11]) == []
    r1 = Request("r1", seq(0, 13))
    assert schedule_prefill(mgr, r1) == (12, [3])
    assert mgr.get_block_ids("r1") == [0, 1, 2, 3]
    assert r1.block_hashes == r0.block_hashes


def test_appending_tokens_never_rehashes_earlier_blocks(no_env_seed):
    mgr = KVCacheManager(num_blocks=64, block_size=4, hash_seed="s")
    req = Request("r", seq(0, 50))
    mgr.get_computed_blocks(req)
    first = list(req.block_hashes)
    assert len(first) == 12
    for t in range(50, 70):
        req.append_output_token_ids(t)
        # the earlier digests are the very same objects: extended, never recomputed
        assert all(a is b for a, b in zip(first, req.block_hashes, strict=False))
        first = list(req.block_hashes)
    assert len(req.block_hashes) == 17


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_unseeded_xxhash_managers_warn_and_share_nothing(algo, no_env_seed):
    with pytest.warns(Warning):
        a = KVCacheManager(num_blocks=4, block_size=4, hash_algo=algo)
    with pytest.warns(Warning):
        b = KVCacheManager(num_blocks=4, block_size=4, hash_algo=algo)
    ra, rb = Request("a", seq(0, 5)), Request("b", seq(0, 5))
    a.get_computed_blocks(ra)
    b.get_computed_blocks(rb)
    assert ra.block_hashes != rb.block_hashes
