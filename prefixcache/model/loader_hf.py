"""Load a Hugging Face model folder: config.json plus safetensors weights.

Weights come from `model.safetensors`, or from the shards listed in
`model.safetensors.index.json`, or failing both from every `*.safetensors` in the folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from prefixcache.model.config import ModelArchConfig
from prefixcache.model.json_file import read_json_object
from prefixcache.model.llama import LlamaForCausalLM, load_hf_state_dict

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_hf_arch_config(model_dir: str | Path) -> ModelArchConfig:
    """Parse `<model_dir>/config.json`; FileNotFoundError / ValueError name what is wrong."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder not found: {model_dir}")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"config.json not found in model folder {model_dir}")
    return ModelArchConfig.from_hf_config(read_json_object(config_path))


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a model folder, in load order; FileNotFoundError if none."""
    model_dir = Path(model_dir)
    index_path = model_dir / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no 'weight_map' object")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(path.name) for path in files if not path.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{SAFETENSORS_INDEX} in {model_dir} lists missing shard(s): {', '.join(missing)}"
            )
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no weights found in {model_dir}: expected model.safetensors, "
            f"{SAFETENSORS_INDEX} with shards, or *.safetensors files"
        )
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every file, one tensor in memory at a time."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


def load_hf_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Build the model described by a Hugging Face folder and load its weights.

    The returned model is in eval mode, on CPU, with parameters in `dtype`.
    """
    arch_config = read_hf_arch_config(model_dir)
    files = safetensors_files(model_dir)
    model = LlamaForCausalLM.empty(arch_config)
    load_hf_state_dict(model, iter_safetensors(files))
    return model.to(dtype).eval(), arch_config
