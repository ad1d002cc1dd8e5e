"""The wire format: byte equality with vLLM's encoding, and the core -> wire conversion."""

from __future__ import annotations

import hashlib
import json

import msgspec
import pytest

from prefixcache.core import kv_events as core
from prefixcache.events.convert import (
    block_hash_to_int64,
    make_batch,
    to_external_block_hash,
    to_wire_event,
    untag_block_extra_keys,
)
from prefixcache.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tests.data_paths import REPO_ROOT, VLLM_HASH_VECTORS_PATH


@pytest.fixture(scope="module")
def vectors() -> dict:
    return json.loads(VLLM_HASH_VECTORS_PATH.read_text())


def _vector_batch() -> KVEventBatch:
    # The batch the vector file describes in words, built field by field.
    return KVEventBatch(
        ts=1700000000.5,
        events=[
            BlockStored(
                block_hashes=[123456789, 987654321],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            BlockRemoved(block_hashes=[123456789], medium="GPU"),
            AllBlocksCleared(),
        ],
    )


def test_event_batch_bytes_equal_vllm_vector(vectors):
    expected = vectors["event_batch"]["msgpack_hex"]
    assert encode_batch(_vector_batch()).hex() == expected


def test_event_batch_from_core_records_equals_vllm_vector(vectors):
    # The same batch reached the way the engine reaches it: core records with raw digests
    # whose low 8 bytes are the vector's integers.
    def digest(n: int) -> bytes:
        return b"\xee" * 24 + n.to_bytes(8, "big")

    records = [
        core.BlockStored(
            block_hashes=[digest(123456789), digest(987654321)],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
            block_size=4,
        ),
        core.BlockRemoved(block_hashes=[digest(123456789)]),
        core.AllBlocksCleared(),
    ]
    batch = make_batch(records, ts=1700000000.5)
    assert encode_batch(batch).hex() == vectors["event_batch"]["msgpack_hex"]


def test_vector_decodes_as_plain_msgpack_the_file_describes(vectors):
    payload = bytes.fromhex(vectors["event_batch"]["msgpack_hex"])
    plain = msgspec.msgpack.decode(payload)
    assert plain == vectors["event_batch"]["decoded_as_plain_msgpack"]
    assert decode_batch(payload) == _vector_batch()


def test_int64_hashes_match_the_vectors(vectors):
    for vector in vectors["vectors"]:
        digests = [bytes.fromhex(h) for h in vector["block_hashes_hex"]]
        assert [block_hash_to_int64(d) for d in digests] == vector["event_block_hashes_int64"]
        assert [to_external_block_hash(d) for d in digests] == vector["event_block_hashes_int64"]


def test_bytes_format_keeps_the_digest():
    digest = hashlib.sha256(b"x").digest()
    assert to_external_block_hash(digest, "bytes") == digest
    with pytest.raises(ValueError):
        to_external_block_hash(digest, "hex")  # type: ignore[arg-type]


def test_extra_keys_are_untagged_like_vllm_events():
    tagged = (("lora", "sql-adapter", "/adapters/sql"), ("mm", "img-abc", -8), ("cache_salt", "s"))
    assert untag_block_extra_keys(tagged) == ("sql-adapter", ("img-abc", -8), "s")
    assert untag_block_extra_keys((("prompt_embeds", b"\x01\x02"),)) == (b"\x01\x02",)
    assert untag_block_extra_keys(None) is None
    assert untag_block_extra_keys(()) is None


def test_block_stored_omits_extra_keys_unless_some_block_has_them():
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    without = core.BlockStored(digests[1:], digests[0], [1, 2, 3, 4], 2, extra_keys=[None, None])
    event = to_wire_event(without)
    assert event.extra_keys is None
    assert b"extra_keys" not in msgspec.msgpack.encode(event)

    with_keys = core.BlockStored(
        digests[1:],
        digests[0],
        [1, 2, 3, 4],
        2,
        lora_id=7,
        lora_name="a",
        extra_keys=[(("lora", "a", "/p"), ("cache_salt", "s")), (("lora", "a", "/p"),)],
    )
    event = to_wire_event(with_keys)
    assert event.extra_keys == [("a", "s"), ("a",)]
    assert event.parent_block_hash == block_hash_to_int64(digests[0])
    assert event.lora_id == 7 and event.lora_name == "a"
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(event))
    assert plain["extra_keys"] == [["a", "s"], ["a"]]


def test_round_trip_through_bytes_in_both_hash_formats():
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    records = [
        core.BlockStored(
            digests[:2], None, list(range(8)), 4, extra_keys=[(("mm", "img", 3),), None]
        ),
        core.BlockStored(digests[2:], digests[1], list(range(8, 16)), 4),
        core.BlockRemoved(digests[:1]),
        core.AllBlocksCleared(),
    ]
    for block_hash_format in ("int64", "bytes"):
        batch = make_batch(records, ts=12.25, data_parallel_rank=3,
                           block_hash_format=block_hash_format)
        decoded = decode_batch(encode_batch(batch))
        # msgpack has one array type: nested tuples come back as lists, so compare the
        # plain msgpack forms and spell the one nested case out.
        assert encode_batch(decoded) == encode_batch(batch)
        assert decoded.events[0].extra_keys == [(["img", 3],), None]
        assert decoded.events[1:] == batch.events[1:]
        assert decoded.data_parallel_rank == 3


def test_decoder_reads_fields_from_newer_producers():
    # A producer that knows a field we don't: the map key is skipped, not an error.
    class FutureBlockRemoved(msgspec.Struct, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None
        brand_new_field: int = 5

    payload = msgspec.msgpack.encode([1.0, [FutureBlockRemoved([1], "GPU")], 0])
    assert decode_batch(payload) == KVEventBatch(1.0, [BlockRemoved([1], "GPU")], 0)


def test_decode_rejects_garbage():
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\x01\x02\x03")
    with pytest.raises(TypeError):
        to_wire_event(object())  # type: ignore[arg-type]


def test_importing_the_package_does_not_load_pyzmq():
    # The engine imports prefixcache.events whether or not events are on.
    import subprocess
    import sys

    code = "import sys, prefixcache.events; sys.exit('zmq' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0
