"""Building an :class:`~prefixcache.engine.llm_engine.LLMEngine`'s parts from its
:class:`~prefixcache.engine.arg_utils.EngineArgs`: the model (loaded, or a loaded one
checked against the arguments), the number of KV blocks when none is given, and the KV
tier."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from prefixcache.config import DEFAULT_DTYPE, CacheConfig, ModelConfig, SchedulerConfig
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.engine.arg_utils import EngineArgs
from prefixcache.kv_tier import KVTier, open_backend
from prefixcache.model.loader import LoadedModel, load_model
from prefixcache.worker.kv_cache_memory import num_kv_blocks_for_memory
from prefixcache.worker.kv_transfer import kv_layout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_engine_model(engine_args: EngineArgs) -> tuple[LoadedModel, ModelConfig]:
    """The model ``engine_args`` names, loaded, and its config; see
    :meth:`~prefixcache.engine.llm_engine.LLMEngine.from_engine_args` for what is refused
    and raised."""
    model = engine_args.model
    if isinstance(model, LoadedModel):
        loaded = model
        if engine_args.quantization not in ("auto", model.quantization):
            raise ValueError(f"quantization {engine_args.quantization!r} does not match "
                             f"the loaded model's {model.quantization!r}; load the model "
                             "with it or leave quantization unset")
        model_config = ModelConfig(None, _dtype_of_loaded_model(model, engine_args.dtype),
                                   model.quantization)
    else:
        model_path = None if model is None else str(model)
        loaded = _load(model_path, engine_args.dtype or DEFAULT_DTYPE,
                       engine_args.quantization)
        model_config = ModelConfig(model_path, engine_args.dtype or DEFAULT_DTYPE,
                                   loaded.quantization)
    return loaded, model_config


def _dtype_of_loaded_model(loaded: LoadedModel, requested: str | None) -> str:
    """The dtype name of ``loaded``'s weights, which its KV cache must share; ValueError if
    ``requested`` names another or the weights are in a dtype the engine does not run."""
    weights_dtype = next(loaded.model.parameters()).dtype
    name = next((n for n, d in TORCH_DTYPES.items() if d == weights_dtype), None)
    if name is None:
        raise ValueError(f"the loaded model's weights are {weights_dtype}; the engine runs "
                         f"{' or '.join(TORCH_DTYPES)}")
    if requested is not None and requested != name:
        raise ValueError(f"dtype {requested!r} does not match the loaded model's {name} "
                         "weights; load the model in that dtype or leave dtype unset")
    return name


def _load(model_path: str | None, dtype: str, quantization: str) -> LoadedModel:
    """``load_model``, with every failure but a missing path reported as a ValueError that
    names the model (the loader's own messages may name only a field or a file format)."""
    if model_path is not None:
        path = Path(model_path)
        if path.is_file() and path.suffix != ".gguf":
            raise ValueError(f"{model_path} is neither a .gguf file nor a Hugging Face model "
                             "folder")
    try:
        return load_model(model_path, TORCH_DTYPES[dtype], quantization)
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - corrupt files fail in many ways
        name = model_path or "the default model"
        raise ValueError(f"cannot load {name}: {error}") from error


def default_num_kv_blocks(
    loaded_model: LoadedModel,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    dtype: torch.dtype,
) -> int:
    """Blocks that fit ``kv_cache_memory_bytes``, but no more than ``max_num_seqs``
    sequences at the model's full context could ever hold at once."""
    arch_config = loaded_model.arch_config
    by_memory = num_kv_blocks_for_memory(
        cache_config.kv_cache_memory_bytes, arch_config, cache_config.block_size, dtype
    )
    blocks_per_sequence = math.ceil(arch_config.max_position_embeddings / cache_config.block_size)
    return min(by_memory, scheduler_config.max_num_seqs * blocks_per_sequence)


def open_kv_tier(engine_args: EngineArgs, loaded_model: LoadedModel,
                 kv_cache_manager: KVCacheManager, dtype: torch.dtype) -> KVTier:
    """The KV tier ``engine_args.kv_tier`` names, keyed by this engine's KV layout."""
    hasher = kv_cache_manager.block_hasher
    layout = kv_layout(loaded_model.model, loaded_model.arch_config,
                       kv_cache_manager.block_size, dtype, hasher.hash_algo, hasher.none_hash)
    backend = open_backend(engine_args.kv_tier, max_bytes=engine_args.kv_tier_max_bytes,
                           timeout_s=engine_args.kv_tier_timeout)
    return KVTier(backend, layout, admission=engine_args.kv_tier_admission,
                  write_queue_bytes=engine_args.kv_tier_write_queue_bytes)
