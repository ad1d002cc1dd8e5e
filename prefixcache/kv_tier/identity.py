"""What makes two processes' KV bytes for one block hash mean the same: the tier's
fingerprint, and the check that block hashes are reproducible at all.

A key in the tier is ``fingerprint + block hash``. The block hash already covers the
tokens and the extra keys (cache salt, LoRA, multimodal items) of the whole prefix; the
fingerprint covers everything else that changes the bytes: the weights, the KV dtype, the
layer and head geometry, the block size, the byte layout of a block, and the hash
function and seed the block hashes were made with. Two engines agreeing on all of it can
share blocks; any difference gives disjoint keys.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

from prefixcache.core.hashing import CRYPTOGRAPHIC_HASH_ALGOS

# Bumped whenever the byte layout of a block's payload changes (see
# prefixcache.worker.kv_transfer): old values then simply stop matching.
KV_LAYOUT_VERSION = 1


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything but the block hash that fixes a block's KV bytes (see the module
    docstring). ``model_digest`` identifies the weights (a digest of their bytes),
    ``none_hash`` the hash algorithm and its seed (the parent hash of every first block)."""

    model_digest: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    hash_algo: str
    none_hash: str
    dtype_size: int
    layout_version: int = KV_LAYOUT_VERSION

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's payload: K and V of every layer."""
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype_size)

    def fingerprint(self) -> bytes:
        """A 32-byte digest of every field (canonical JSON, sorted keys)."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).digest()


def unshareable_hash_seed_reason(hash_algo: str, hash_seed: str | None) -> str | None:
    """Why blocks hashed with ``hash_algo`` and ``hash_seed`` cannot be shared through a
    tier, or None when they can.

    The xxhash algorithms draw a fresh random seed per process when no seed is given (see
    :mod:`prefixcache.core.hashing`), so no other process, nor this one after a restart,
    would ever compute the same keys: a tier would store blocks nobody can find."""
    if hash_seed is not None or os.environ.get("PYTHONHASHSEED") is not None:
        return None
    if hash_algo in CRYPTOGRAPHIC_HASH_ALGOS:
        return None
    return (f"--kv-tier needs block hashes that every replica computes alike, but "
            f"{hash_algo!r} without a hash seed uses a random seed in each process. Use "
            f"--prefix-caching-hash-algo sha256 or sha256_cbor, or give every replica the "
            f"same hash_seed (or PYTHONHASHSEED)")
