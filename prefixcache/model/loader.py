"""One entry point for every supported model source.

`load_model(None)` loads the default SmolLM2 GGUF; a path ending in `.gguf` loads that file;
any other path is a Hugging Face model folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.model.config import ModelArchConfig
from prefixcache.model.default_model import default_model_path
from prefixcache.model.gguf_file import open_gguf, read_gguf_metadata
from prefixcache.model.llama import LlamaForCausalLM, load_hf_state_dict
from prefixcache.model.loader_gguf import gguf_arch_config, iter_gguf_hf_tensors
from prefixcache.model.loader_hf import load_hf_model
from prefixcache.model.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: weights (eval mode, CPU), its architecture and tokenizer."""

    model: LlamaForCausalLM
    arch_config: ModelArchConfig
    tokenizer: Tokenizer
    path: Path


def load_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load model and tokenizer from `path` (default: the bundled SmolLM2-135M-Instruct)."""
    path = default_model_path() if path is None else Path(path)
    if path.suffix == ".gguf":
        reader = open_gguf(path)  # parsed once for both weights and tokenizer
        metadata = read_gguf_metadata(reader)
        arch_config = gguf_arch_config(reader, metadata)
        model = LlamaForCausalLM.empty(arch_config)
        load_hf_state_dict(model, iter_gguf_hf_tensors(reader, arch_config))
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
        return LoadedModel(model.to(dtype).eval(), arch_config, tokenizer, path)
    model, arch_config = load_hf_model(path, dtype)
    return LoadedModel(model, arch_config, Tokenizer.from_hf_dir(path), path)
