"""One entry point for every supported model source.

`load_model(None)` loads the default SmolLM2 GGUF; a path ending in `.gguf` loads that file;
any other path is a Hugging Face model folder. `quantization` (see `model.quantization`)
adds quantized weight copies for steps with few tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.model.config import ModelArchConfig
from prefixcache.model.default_model import default_model_path
from prefixcache.model.gguf_file import is_q4_block_tensor, open_gguf, read_gguf_metadata
from prefixcache.model.llama import LlamaForCausalLM, load_hf_state_dict
from prefixcache.model.loader_gguf import (
    gguf_arch_config,
    iter_gguf_hf_tensors,
    iter_gguf_q4_blocks,
)
from prefixcache.model.loader_hf import load_hf_model
from prefixcache.model.quantization import (
    DEFAULT_MAX_QUANTIZED_TOKENS,
    quantize_for_decode,
    resolve_quantization,
)
from prefixcache.model.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: weights (eval mode, CPU), its architecture and tokenizer.

    `quantization` is the resolved method (`none`, `int8` or `int4`, never `auto`).
    """

    model: LlamaForCausalLM
    arch_config: ModelArchConfig
    tokenizer: Tokenizer
    path: Path
    quantization: str = "none"


# GGUF tensor types that hold plain floats; any other type is a quantized format.
_FLOAT_GGUF_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
# The GGUF names of the projections `int4` decode needs as 4-bit blocks.
_GGUF_PROJECTION_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                          "ffn_down")


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
    max_quantized_tokens: int = DEFAULT_MAX_QUANTIZED_TOKENS,
) -> LoadedModel:
    """Load model and tokenizer from `path` (default: the bundled SmolLM2-135M-Instruct).

    The dense weights are in `dtype`. `quantization` (`auto`, `none`, `int8`, `int4`; see
    `prefixcache.model.quantization`) adds quantized copies used by steps of at most
    `max_quantized_tokens` tokens. Raises ValueError for an unknown method.
    """
    path = default_model_path() if path is None else Path(path)
    if path.suffix == ".gguf":
        reader = open_gguf(path)  # parsed once for both weights and tokenizer
        metadata = read_gguf_metadata(reader)
        arch_config = gguf_arch_config(reader, metadata)
        projections = [t for t in reader.tensors
                       if t.name.split(".")[-2] in _GGUF_PROJECTION_KINDS]
        method = resolve_quantization(
            quantization,
            has_q4_blocks=bool(projections) and all(map(is_q4_block_tensor, projections)),
            is_quantized_file=any(t.tensor_type.name not in _FLOAT_GGUF_TYPES
                                  for t in reader.tensors),
        )
        model = LlamaForCausalLM.empty(arch_config)
        load_hf_state_dict(model, iter_gguf_hf_tensors(reader, arch_config))
        model = model.to(dtype).eval()
        q4_blocks = dict(iter_gguf_q4_blocks(reader, arch_config)) if method == "int4" else None
        quantize_for_decode(model, method, q4_blocks, max_quantized_tokens)
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
        return LoadedModel(model, arch_config, tokenizer, path, method)
    method = resolve_quantization(quantization, has_q4_blocks=False, is_quantized_file=False)
    model, arch_config = load_hf_model(path, dtype)
    quantize_for_decode(model, method, None, max_quantized_tokens)
    return LoadedModel(model, arch_config, Tokenizer.from_hf_dir(path), path, method)
