"""Narrow, validated configuration dataclasses for the engine.

Each component takes only the scalars it needs; these dataclasses exist so that the engine's
options are checked once, in one place, with messages that name the option. The scheduler's
own limits live in :class:`prefixcache.core.scheduler.SchedulerConfig` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.core.eviction import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES
from prefixcache.core.hashing import DEFAULT_HASH_ALGO, HASH_ALGOS
from prefixcache.core.scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    SchedulerConfig,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DTYPE",
    "DEFAULT_EVICTION_POLICY",
    "DEFAULT_HASH_ALGO",
    "DEFAULT_KV_CACHE_MEMORY_BYTES",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_QUANTIZATION",
    "DTYPES",
    "QUANTIZATION_METHODS",
    "EVICTION_POLICIES",
    "CacheConfig",
    "ModelConfig",
    "SchedulerConfig",
]

# 2 GiB of K/V: on the 24 GiB CPU machines this project targets it leaves ample room for
# the model, activations and the OS. For the default SmolLM2-135M in float32 (30 layers,
# 3 KV heads of 64) one 16-token block takes 720 KiB, so this holds ~2,900 blocks, i.e.
# ~46,000 tokens: 32 requests of 1,500 tokens with room to spare.
DEFAULT_KV_CACHE_MEMORY_BYTES = 2 * 1024**3

DTYPES = ("float32", "bfloat16")
DEFAULT_DTYPE = "float32"
DEFAULT_BLOCK_SIZE = 16
# Weight-only quantized decode (see prefixcache.model.quantization for what each means).
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4")
DEFAULT_QUANTIZATION = "auto"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and in which dtype.

    ``model`` is None (the default SmolLM2-135M-Instruct GGUF), a path to a ``.gguf`` file,
    or a Hugging Face model folder. ``dtype`` applies to the weights and the KV cache.
    ``quantization`` picks the weight-only quantized copies steps with few tokens use
    (one of ``QUANTIZATION_METHODS``).
    """

    model: str | None = None
    dtype: str = DEFAULT_DTYPE
    quantization: str = DEFAULT_QUANTIZATION

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.quantization, str) or (
            self.quantization not in QUANTIZATION_METHODS
        ):
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache and its prefix cache.

    The pool size is ``num_kv_blocks`` when given, otherwise as many blocks as fit in
    ``kv_cache_memory_bytes`` — capped at what ``max_num_seqs`` sequences of the model's full
    context could ever use, so a tiny model does not get millions of idle blocks.
    ``eviction_policy`` names the free-queue order that decides which cached block is
    evicted first (see :mod:`prefixcache.core.eviction`).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    hash_algo: str = DEFAULT_HASH_ALGO
    enable_kv_events: bool = False
    eviction_policy: str = DEFAULT_EVICTION_POLICY

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1
        ):
            raise ValueError(
                f"num_kv_blocks must be a positive integer or None, got {self.num_kv_blocks!r}"
            )
        if not isinstance(self.kv_cache_memory_bytes, int) or self.kv_cache_memory_bytes < 1:
            raise ValueError(
                "kv_cache_memory_bytes must be a positive integer, "
                f"got {self.kv_cache_memory_bytes!r}"
            )
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}"
            )
        # The isinstance check first: the registry is a dict, and a list is unhashable.
        if not isinstance(self.eviction_policy, str) or (
            self.eviction_policy not in EVICTION_POLICIES
        ):
            raise ValueError(
                f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                f"got {self.eviction_policy!r}"
            )
