"""Block hashing: hash functions, the seed ("none hash"), extra keys and the hash chain.

A block's hash is ``hash_fn((parent_hash, tuple(block_token_ids), extra_keys_or_None))``,
where the parent of block 0 is the *none hash* ``hash_fn(seed)``. Only full blocks are
hashed, and a request's chain is extended incrementally as tokens arrive
(:meth:`BlockHasher.extend_request`), never recomputed from the start.

Four algorithms are selectable by name:

``sha256`` (default)
    SHA-256 over our own compact encoding of the tuple (see :func:`_encode_compact`):
    ``"B" || u32 len(parent) || parent || u32 count || tokens as little-endian int64 ||
    extra``, where ``extra`` is one byte ``0`` for None or ``1`` followed by the pickled
    extra-key tuple. Every length is explicit, so the encoding is injective. It
    hashes the same tuple as vLLM's pickle-based ``sha256`` but is several times cheaper
    to build; like vLLM's, it is not meant to be reproduced outside prefixcache.
``sha256_cbor``
    SHA-256 over canonical CBOR (``cbor2.dumps(obj, canonical=True)``): reproducible across
    languages and equal to vLLM's ``sha256_cbor`` byte for byte.
``xxhash``
    xxh3-128 over pickle. Fast, not cryptographic.
``xxhash_cbor``
    xxh3-128 over canonical CBOR, equal to vLLM's ``xxhash_cbor``.

Seed resolution (:func:`resolve_hash_seed`): an explicit ``hash_seed`` wins, else the
``PYTHONHASHSEED`` environment variable, else for the sha256 algorithms the fixed string
``"vllm-none-hash"`` (so routers built for vLLM compute the same keys), and for the xxhash
algorithms a fresh random seed at each resolution — so per manager, as in vLLM — with a
warning: a predictable seed would let an attacker precompute collisions for a
non-cryptographic hash.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import secrets
import struct
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import cbor2

if TYPE_CHECKING:
    from prefixcache.core.request import Request

BlockHash = bytes
HashFn = Callable[[Any], bytes]

DEFAULT_HASH_ALGO = "sha256"
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
CRYPTOGRAPHIC_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})
# vLLM's fixed default seed; sharing it lets vLLM-aware routers reproduce our keys.
DEFAULT_HASH_SEED = "vllm-none-hash"

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
_COUNT = struct.Struct(">I")
# The head of a block encoding whose parent is a SHA-256 digest: every parent in a chain
# but (possibly) the first.
_SHA256_PARENT_HEAD = b"B" + _COUNT.pack(hashlib.sha256().digest_size)
_NO_EXTRA = b"\x00"
_HAS_EXTRA = b"\x01"


def _require_xxh3_128() -> Callable[[bytes], Any]:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - exercised by monkeypatching the import
        raise ImportError(
            "the xxhash prefix-caching hash algorithms need the optional 'xxhash' package: "
            "pip install 'prefixcache[xxhash]' (or: pip install xxhash)"
        ) from exc
    return xxhash.xxh3_128


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)


@lru_cache(maxsize=128)
def _int64_struct(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64: fixed width, so the count fixes the length.

    A precompiled ``struct`` packs a few times faster than ``array`` here, and the
    explicit byte order makes the encoding the same on every host.
    """
    try:
        return _int64_struct(len(token_ids)).pack(*token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers that fit in 64 bits: {exc}") from None


def _encode_compact(obj: Any) -> bytes:
    """The injective encoding behind ``sha256`` for a ``(parent, tokens, extra)`` tuple.

    Anything else (the seed string) is plainly pickled, as vLLM does, so our none hash
    equals vLLM's. A pickle starts with the protocol opcode 0x80, never with the ``B`` that
    starts a block encoding, so the two can never be confused.
    """
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is bytes:
        parent, token_ids, extra_keys = obj
        return b"".join(
            (
                b"B",
                _COUNT.pack(len(parent)),
                parent,
                _COUNT.pack(len(token_ids)),
                _encode_tokens(token_ids),
                _NO_EXTRA if extra_keys is None else _HAS_EXTRA + _pickle(extra_keys),
            )
        )
    return _pickle(obj)


def get_hash_fn(hash_algo: str) -> HashFn:
    """The generic ``obj -> digest`` function of an algorithm (used for the seed and tests).

    Raises ValueError for an unknown name, ImportError for xxhash without the package.
    """
    if hash_algo == "sha256":
        return lambda obj: hashlib.sha256(_encode_compact(obj)).digest()
    if hash_algo == "sha256_cbor":
        return lambda obj: hashlib.sha256(_cbor(obj)).digest()
    if hash_algo == "xxhash":
        xxh3_128 = _require_xxh3_128()
        return lambda obj: xxh3_128(_pickle(obj)).digest()
    if hash_algo == "xxhash_cbor":
        xxh3_128 = _require_xxh3_128()
        return lambda obj: xxh3_128(_cbor(obj)).digest()
    raise ValueError(
        f"unknown prefix-caching hash algorithm {hash_algo!r}; "
        f"choose one of {', '.join(HASH_ALGOS)}"
    )


def resolve_hash_seed(hash_algo: str, hash_seed: str | None = None) -> str:
    """The seed string this process uses for ``hash_algo`` (see the module docstring)."""
    if hash_seed is not None:
        return str(hash_seed)
    env_seed = os.environ.get("PYTHONHASHSEED")
    if env_seed is not None:
        return env_seed
    if hash_algo in CRYPTOGRAPHIC_HASH_ALGOS:
        return DEFAULT_HASH_SEED
    warnings.warn(
        f"prefix-caching hash algorithm {hash_algo!r} is not cryptographic and no hash_seed or "
        "PYTHONHASHSEED was given: using a random seed, so block hashes differ between "
        "managers and processes. Set hash_seed for reproducible hashes across replicas.",
        stacklevel=3,
    )
    return secrets.token_hex(16)


def block_hash_to_int64(block_hash: BlockHash) -> int:
    """vLLM's external 64-bit form of a block hash: its low 8 bytes, big-endian."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


class BlockHasher:
    """Computes chained block hashes for one algorithm and seed.

    Stateless apart from its configuration, so one instance serves every request of a
    manager. ``none_hash`` is the parent of every request's first block.
    """

    __slots__ = ("hash_algo", "hash_seed", "block_size", "hash_fn", "none_hash")

    def __init__(self, block_size: int, hash_algo: str = DEFAULT_HASH_ALGO,
                 hash_seed: str | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.hash_fn = get_hash_fn(hash_algo)
        self.hash_seed = resolve_hash_seed(hash_algo, hash_seed)
        self.none_hash: BlockHash = self.hash_fn(self.hash_seed)

    def hash_block_tokens(self, parent_hash: BlockHash | None, token_ids: Sequence[int],
                          extra_keys: tuple | None = None) -> BlockHash:
        """Hash one block; a None parent means the block starts the sequence."""
        if parent_hash is None:
            parent_hash = self.none_hash
        return self.hash_fn((parent_hash, tuple(token_ids), extra_keys))

    def hash_blocks(self, parent_hash: BlockHash | None, token_ids: Sequence[int],
                    extra_keys_per_block: Sequence[tuple | None] | None = None) -> list[BlockHash]:
        """Hash every full block of ``token_ids`` as a chain continuing ``parent_hash``.

        ``extra_keys_per_block[i]`` is block i's extra keys (None entries allowed). A
        trailing partial block is ignored.
        """
        block_size = self.block_size
        num_blocks = len(token_ids) // block_size
        parent = self.none_hash if parent_hash is None else parent_hash
        hashes: list[BlockHash] = []
        append = hashes.append
        if self.hash_algo == "sha256":
            # Encode all tokens once and slice per block: the hot path of every prompt.
            token_bytes = _encode_tokens(token_ids[: num_blocks * block_size])
            stride = 8 * block_size
            # The first parent is the caller's (any length); the rest are our digests.
            head = b"B" + _COUNT.pack(len(parent))
            count = _COUNT.pack(block_size)
            sha256 = hashlib.sha256
            join = b"".join
            for i in range(num_blocks):
                extra = None if extra_keys_per_block is None else extra_keys_per_block[i]
                tail = _NO_EXTRA if extra is None else _HAS_EXTRA + _pickle(extra)
                parent = sha256(
                    join((head, parent, count, token_bytes[i * stride:(i + 1) * stride], tail))
                ).digest()
                append(parent)
                head = _SHA256_PARENT_HEAD
            return hashes
        # The other algorithms encode the tuple whole. (Memoising each token's CBOR
        # encoding was tried: with a 150k-token vocabulary its dict lookups miss the CPU
        # cache and it ran 2x slower than cbor2 itself.)
        hash_fn = self.hash_fn
        for i in range(num_blocks):
            extra = None if extra_keys_per_block is None else extra_keys_per_block[i]
            start = i * block_size
            parent = hash_fn((parent, tuple(token_ids[start:start + block_size]), extra))
            append(parent)
        return hashes

    def extend_request(self, request: Request) -> None:
        """Append to ``request.block_hashes`` the hashes of its newly full blocks."""
        block_hashes = request.block_hashes
        block_size = self.block_size
        start_block = len(block_hashes)
        num_full_blocks = request.num_tokens // block_size
        if num_full_blocks <= start_block:
            return
        start = start_block * block_size
        token_ids = request.all_token_ids[start:num_full_blocks * block_size]
        extra = None
        if request.has_extra_keys:
            extra = [request.block_extra_keys(i, block_size)
                     for i in range(start_block, num_full_blocks)]
        parent = block_hashes[-1] if block_hashes else None
        block_hashes.extend(self.hash_blocks(parent, token_ids, extra))
