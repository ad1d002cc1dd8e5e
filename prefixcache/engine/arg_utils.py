"""The engine's options, declared once: :class:`EngineArgs` (and the server's KV events
options, :class:`KVEventsArgs`).

Every way to build an engine goes through :class:`EngineArgs`: ``LLM(**kwargs)``,
``LLMEngine.from_options(**kwargs)`` / ``from_engine_args``, ``prefixcache serve`` and
``prefixcache generate`` (``add_cli_args`` / ``from_cli_args``). A field declares the
option's default, help, flags (vLLM's spelling first) and check (see
:mod:`prefixcache.engine.option_fields`), so adding an option is adding a field here.

Torch-free: the commands import this to build their parsers.
"""

from __future__ import annotations

import argparse
from dataclasses import KW_ONLY, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixcache.arg_types import (
    byte_size,
    int_in_range,
    non_negative_int,
    positive_float,
    positive_int,
    size_text,
)
from prefixcache.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DTYPE,
    DEFAULT_EVICTION_POLICY,
    DEFAULT_HASH_ALGO,
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL_NAME,
    DEFAULT_OPTIMIZATION_LEVEL,
    DEFAULT_QUANTIZATION,
    DTYPES,
    EVICTION_POLICIES,
    HASH_ALGOS,
    OPTIMIZATION_LEVELS,
    QUANTIZATION_METHODS,
)
from prefixcache.core.eviction import describe_eviction_policies
from prefixcache.engine.option_fields import (
    DeclaredOptions,
    is_int64,
    is_non_negative_int,
    is_positive_int,
    is_str,
    option,
)
from prefixcache.kv_tier import (
    ADMISSION_POLICIES,
    DEFAULT_WRITE_QUEUE_BYTES,
    kv_tier_url_problem,
    unshareable_hash_seed_reason,
)

if TYPE_CHECKING:
    from prefixcache.model.loader import LoadedModel

MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# prefixcache.events.convert.BLOCK_HASH_FORMATS, not imported here: it loads msgspec.
BLOCK_HASH_FORMATS = ("int64", "bytes")


def kv_tier_url(text: str) -> str:
    """A ``--kv-tier`` value on the command line (checked, not connected to)."""
    problem = kv_tier_url_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text


def is_kv_tier_url(value: Any) -> bool:
    return isinstance(value, str) and kv_tier_url_problem(value) is None


def is_positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and 0 < value < float("inf")


def model_path(text: str) -> str:
    """A model path on the command line: not empty (the usual result of an unset shell
    variable; leaving the argument out is how to ask for the default model)."""
    if not text:
        raise argparse.ArgumentTypeError("empty path (leave it out for the default model)")
    return text


@dataclass(frozen=True)
class EngineArgs(DeclaredOptions):
    """Everything that configures an :class:`~prefixcache.engine.llm_engine.LLMEngine`,
    checked once on construction (ValueError naming the option); frozen, so it stays
    checked (``dataclasses.replace`` makes a checked copy).

    ``model`` is None (the default SmolLM2-135M-Instruct GGUF), a ``.gguf`` file, a
    Hugging Face model folder, or a :class:`~prefixcache.model.loader.LoadedModel`
    already in memory (shared, e.g., by engines compared side by side; it is not checked
    here, the loader says what is wrong with a path). ``dtype`` None means float32, or a
    loaded model's own weights' dtype. ``quantization`` (see
    :mod:`prefixcache.model.quantization`) gives steps with few tokens weight-only
    quantized copies of the weights, memory on top of the weights and outside the KV
    budget.

    The KV pool is ``num_kv_blocks`` blocks when given, else as many as fit in
    ``kv_cache_memory_bytes``, capped at what ``max_num_seqs`` full-context sequences
    could use. Each step computes at most ``max_num_batched_tokens`` tokens for at most
    ``max_num_seqs`` requests. ``seed`` seeds the sampling of requests without a seed of
    their own; ``hash_seed`` the prefix-cache block hashes (see
    :mod:`prefixcache.core.hashing`). ``enable_kv_events`` records KV cache events for
    ``LLMEngine.take_kv_events`` (``serve`` turns it on with ``--kv-events-endpoint``).
    ``optimization_level`` above 0 compiles decode steps (see
    :mod:`prefixcache.worker.compiled_decode`) and attends decodes with the C++ paged
    attention kernel (see :mod:`prefixcache.kernels.paged_attention`). ``enable_lora``
    lets requests run with LoRA adapters: at most ``max_loras`` distinct ones per step,
    each of rank at most ``max_lora_rank``, up to ``max_cpu_loras`` unused ones kept loaded (see
    :mod:`prefixcache.lora`).
    """

    CLI_GROUP = "engine"

    model: str | Path | LoadedModel | None = option(
        None, "--model", parse=model_path, metavar="PATH", default_text=DEFAULT_MODEL_NAME,
        help="Hugging Face model folder or .gguf file")
    _: KW_ONLY
    dtype: str | None = option(
        None, "--dtype", choices=DTYPES, default_text=DEFAULT_DTYPE,
        help="dtype of the weights and the KV cache")
    quantization: str = option(
        DEFAULT_QUANTIZATION, "--quantization", "-q", choices=QUANTIZATION_METHODS,
        help="weight-only quantized weights for steps of a few tokens (decode); prefill "
             "keeps the dense weights. auto: int4 from a 4-bit GGUF's own blocks (the "
             "default model), int8 for other quantized GGUFs, none for float weights; a "
             "loaded model keeps the quantization it was loaded with. On CPUs with "
             "AVX-512 VNNI these matmuls run on C++ kernels built on first use (about "
             "30 s, cached); PREFIXCACHE_QUANTIZED_GEMV=0 keeps PyTorch's")
    optimization_level: int = option(
        DEFAULT_OPTIMIZATION_LEVEL, "--optimization-level", "-O",
        accepts=lambda level: type(level) is int and level in OPTIMIZATION_LEVELS,
        wanted=f"one of {', '.join(map(str, OPTIMIZATION_LEVELS))}",
        parse=int_in_range(min(OPTIMIZATION_LEVELS), max(OPTIMIZATION_LEVELS)),
        metavar="LEVEL",
        help="0: eager PyTorch, starts at once. 1-3 (one level here, as vLLM spells them): "
             "also run decode steps through torch.compile and attend decodes with a C++ "
             "paged attention kernel that reads keys in place, faster per token; the "
             "first start builds the kernel (about 30 s), and every start compiles the "
             "decode graphs before serving, from seconds to minutes by model size "
             "(cached on disk for later starts); prefill, cascade and LoRA steps stay "
             "eager. Needs a C++ "
             "compiler; without one, decode stays eager with a warning")
    block_size: int = option(
        DEFAULT_BLOCK_SIZE, "--block-size", accepts=is_positive_int,
        wanted="a positive integer", parse=positive_int, help="tokens per KV block")
    enable_prefix_caching: bool = option(
        True, "--enable-prefix-caching", help="reuse cached KV blocks across requests")
    hash_algo: str = option(
        DEFAULT_HASH_ALGO, "--prefix-caching-hash-algo", choices=HASH_ALGOS,
        help="hash of the KV block keys (KV events publish them): the sha256 ones resist "
             "collisions, the xxhash ones are faster, the *_cbor ones equal vLLM's byte "
             "for byte")
    eviction_policy: str = option(
        DEFAULT_EVICTION_POLICY, "--eviction-policy", choices=tuple(EVICTION_POLICIES),
        help="which free cached block is evicted first when the KV pool needs room: "
             f"{describe_eviction_policies()} (see docs/eviction-policies.md)")
    num_kv_blocks: int | None = option(
        None, "--num-kv-blocks", "--num-gpu-blocks-override", accepts=is_positive_int,
        wanted="a positive integer", parse=positive_int, metavar="N",
        default_text="as many as --kv-cache-memory holds",
        help="KV pool size in blocks, overriding --kv-cache-memory")
    kv_cache_memory_bytes: int = option(
        DEFAULT_KV_CACHE_MEMORY_BYTES, "--kv-cache-memory", "--kv-cache-memory-bytes",
        accepts=is_positive_int, wanted="a positive integer", parse=byte_size,
        metavar="SIZE", default_text=size_text(DEFAULT_KV_CACHE_MEMORY_BYTES),
        help="memory for the KV pool, e.g. 512MiB; the pool never exceeds --max-num-seqs "
             "full-context sequences")
    max_num_seqs: int = option(
        DEFAULT_MAX_NUM_SEQS, "--max-num-seqs", accepts=is_positive_int,
        wanted="a positive integer", parse=positive_int, metavar="N",
        help="most requests running at once; more wait in a queue")
    max_num_batched_tokens: int = option(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, "--max-num-batched-tokens", accepts=is_positive_int,
        wanted="a positive integer", parse=positive_int, metavar="N",
        help="most tokens one step computes, prompt chunks and decodes together")
    enable_chunked_prefill: bool = option(
        True, "--enable-chunked-prefill",
        help="split prompts longer than a step's token budget over several steps; "
             "without it such a prompt is refused")
    seed: int | None = option(
        None, "--seed", accepts=is_int64, wanted="a signed 64-bit integer",
        parse=int_in_range(MIN_SEED, MAX_SEED),
        default_text="none, so those sample differently each time",
        help="seed for requests that bring no seed of their own")
    hash_seed: str | None = option(
        None, accepts=is_str, wanted="a string",
        help="seed of the prefix-cache block hashes")
    enable_kv_events: bool = option(
        False, help="record KV cache events for LLMEngine.take_kv_events")
    kv_tier: str | None = option(
        None, "--kv-tier", accepts=is_kv_tier_url,
        wanted="redis://HOST:PORT/DB or disk:/PATH", parse=kv_tier_url, metavar="URL",
        default_text="none, only the in-process cache",
        help="a second KV tier behind the block pool: redis://HOST:PORT/DB (Redis or "
             "Valkey, shared by every replica pointed at it) or disk:/PATH (a local "
             "directory that outlives restarts). Prefix blocks missing locally are loaded "
             "from it instead of recomputed; computed blocks are written to it in the "
             "background. Needs reproducible block hashes (see docs/kv-tier.md)")
    kv_tier_max_bytes: int | None = option(
        None, "--kv-tier-max-size", accepts=is_positive_int, wanted="a positive integer",
        parse=byte_size, metavar="SIZE", default_text="unbounded",
        help="bound a disk tier, e.g. 20GiB; least recently used blocks are deleted "
             "first (a Redis tier is bounded by the server's maxmemory)")
    kv_tier_admission: str = option(
        "always", "--kv-tier-admission", choices=ADMISSION_POLICIES,
        help="which computed blocks are written to the tier: always, or seen-twice (a "
             "block used a second time, so one-off prompts never reach it)")
    kv_tier_write_queue_bytes: int = option(
        DEFAULT_WRITE_QUEUE_BYTES, "--kv-tier-write-queue-size", accepts=is_positive_int,
        wanted="a positive integer", parse=byte_size, metavar="SIZE",
        default_text=size_text(DEFAULT_WRITE_QUEUE_BYTES),
        help="most bytes of blocks waiting to be written to the tier; past it, blocks "
             "are dropped (counted), never waited for")
    kv_tier_timeout: float = option(
        1.0, "--kv-tier-timeout", accepts=is_positive_number, wanted="a positive number",
        parse=positive_float, metavar="SECONDS",
        help="how long a tier call may take; a failure or timeout is a miss, and the "
             "tier is left alone for a few seconds")

    enable_lora: bool = option(
        False, "--enable-lora",
        help="serve LoRA adapters (PEFT folders) next to the base model; each request "
             "may name one")
    max_loras: int = option(
        DEFAULT_MAX_LORAS, "--max-loras", accepts=is_positive_int,
        wanted="a positive integer", parse=positive_int, metavar="N",
        help="most LoRA adapters one step runs; requests for further adapters wait")
    max_lora_rank: int = option(
        DEFAULT_MAX_LORA_RANK, "--max-lora-rank", accepts=is_positive_int,
        wanted="a positive integer", parse=positive_int, metavar="R",
        help="largest LoRA rank accepted; adapters of higher rank are refused")
    max_cpu_loras: int | None = option(
        None, "--max-cpu-loras", accepts=is_positive_int, wanted="a positive integer",
        parse=positive_int, metavar="N", default_text="--max-loras",
        help="LoRA adapters kept loaded in memory when no request uses them (least "
             "recently used dropped first, re-read from their folder when needed); at "
             "least --max-loras")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                             f"max_loras ({self.max_loras})")
        self._check_kv_tier()

    def _check_kv_tier(self) -> None:
        if self.kv_tier is None:
            if self.kv_tier_max_bytes is not None:
                raise ValueError("kv_tier_max_bytes (--kv-tier-max-size) needs a kv_tier")
            return
        if not self.enable_prefix_caching:
            raise ValueError("kv_tier (--kv-tier) needs prefix caching on")
        reason = unshareable_hash_seed_reason(self.hash_algo, self.hash_seed)
        if reason is not None:
            raise ValueError(reason)
        if self.kv_tier_max_bytes is not None and not self.kv_tier.startswith("disk:"):
            raise ValueError("kv_tier_max_bytes (--kv-tier-max-size) bounds a disk tier; "
                             "bound a Redis/Valkey tier with the server's maxmemory and "
                             "maxmemory-policy allkeys-lru")


@dataclass(frozen=True)
class KVEventsArgs(DeclaredOptions):
    """The server's KV cache events (vLLM-compatible, over ZMQ): ``AsyncLLM`` publishes
    every engine step's events on ``kv_events_endpoint`` when it is set.

    ``data_parallel_rank`` is this replica's rank among the engines behind one router:
    stamped into every batch and applied to both endpoints (see
    :func:`prefixcache.events.endpoint.endpoint_for_rank`)."""

    CLI_GROUP = "KV cache events (vLLM-compatible ZMQ)"

    kv_events_endpoint: str | None = option(
        None, "--kv-events-endpoint", accepts=is_str, wanted="a string", metavar="E",
        help="publish KV events on this PUB endpoint, e.g. tcp://127.0.0.1:5557")
    kv_events_replay_endpoint: str | None = option(
        None, "--kv-events-replay-endpoint", accepts=is_str, wanted="a string",
        metavar="E", help="answer replay requests on this ROUTER endpoint")
    kv_events_topic: str = option(
        "", "--kv-events-topic", accepts=is_str, wanted="a string", metavar="TOPIC",
        default_text="empty",
        help="first frame of every message, for subscribers to filter on")
    kv_events_block_hash_format: str = option(
        "int64", "--kv-events-block-hash-format", choices=BLOCK_HASH_FORMATS,
        help="block hashes as vLLM's 64-bit integers (the digest's low 8 bytes, "
             "big-endian) or as raw digests")
    data_parallel_rank: int = option(
        0, "--data-parallel-rank", accepts=is_non_negative_int,
        wanted="a non-negative integer", parse=non_negative_int, metavar="R",
        help="this replica's rank among the engines behind one router; stamped into "
             "every KV event batch and added to the port of the KV event endpoints "
             "(ipc/inproc paths get a _dpR suffix), so replicas on one host can be "
             "started with the same flags")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("a KV events replay endpoint needs --kv-events-endpoint too")

    @property
    def enabled(self) -> bool:
        return self.kv_events_endpoint is not None


def config_from(engine_args: EngineArgs, config_cls: type, **values: Any) -> Any:
    """A narrow config (``CacheConfig``, ``SchedulerConfig``) filled from the engine
    arguments of the same names (``values`` first): the configs restate no option."""
    for config_field in fields(config_cls):
        if config_field.name not in values:
            values[config_field.name] = getattr(engine_args, config_field.name)
    return config_cls(**values)
