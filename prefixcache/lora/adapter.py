"""A LoRA adapter in memory and its loader from a PEFT folder.

A PEFT LoRA folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` (or the older
``adapter_model.bin``) with, for every adapted projection of every layer,
``...layers.<i>.<self_attn|mlp>.<module>.lora_A.weight`` [r, in_features] and
``...lora_B.weight`` [out_features, r]. The projection's output gains
``scaling * B @ A @ x``, with ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)``
under rsLoRA.

:func:`load_peft_adapter` checks the folder against the base model and folds ``scaling``
into B, so an adapter in memory is just ``(A, scaled B)`` per (layer, module).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixcache.lora.errors import LoRAError, LoRANotFoundError
from prefixcache.lora.request import LoRARequest
from prefixcache.model.config import ModelArchConfig

# The Hugging Face projections an adapter may target, by the block they sit in.
SUPPORTED_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj",
                            "gate_proj", "up_proj", "down_proj")
_ATTENTION_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
_WEIGHT_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[^.]+)?\.weight$"
)
# PEFT options that change what the weights mean; each is refused unless at this value.
_REFUSED_UNLESS = {
    "bias": ("none", "LoRA biases"),
    "use_dora": (False, "DoRA"),
    "fan_in_fan_out": (False, "fan_in_fan_out weights"),
    "layers_to_transform": (None, "layers_to_transform"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern)"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern)"),
    "modules_to_save": (None, "modules_to_save"),
}


@dataclass(frozen=True, slots=True, eq=False)
class LoRAAdapter:
    """One loaded adapter, compared and hashed by identity.

    ``weights[(layer_index, module)]`` is ``(A [r, in_features], B [out_features, r])``
    with the scaling already folded into B, in the model's dtype; every targeted module has
    weights in every layer. ``rank`` is the largest r."""

    lora_request: LoRARequest
    rank: int
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def lora_name(self) -> str:
        return self.lora_request.lora_name

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def module_shapes(arch_config: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every supported projection of `arch_config`."""
    hidden = arch_config.hidden_size
    q_size = arch_config.num_heads * arch_config.head_dim
    kv_size = arch_config.num_kv_heads * arch_config.head_dim
    intermediate = arch_config.intermediate_size
    return {
        "q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden),
        "o_proj": (hidden, q_size), "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate),
    }


def load_peft_adapter(lora_request: LoRARequest, arch_config: ModelArchConfig,
                      max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the PEFT folder of `lora_request` for a model of `arch_config`.

    Raises LoRANotFoundError for a missing folder, config or weights file, and LoRAError
    for anything else that makes it unusable: an unreadable config, a non-LoRA PEFT type,
    an unsupported option or target module, a rank above `max_lora_rank`, or weights whose
    names, layers or shapes do not fit the base model.
    """
    name = lora_request.lora_name
    folder = Path(lora_request.lora_path)
    if not folder.is_dir():
        raise LoRANotFoundError(name, f"no adapter folder at {folder}")
    config = _read_config(name, folder)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not _is_positive_int(rank) or not isinstance(alpha, int | float) \
            or isinstance(alpha, bool):
        raise LoRAError(name, f"adapter_config.json needs r (a positive int) and lora_alpha "
                              f"(a number), got r={rank!r}, lora_alpha={alpha!r}")
    if rank > max_lora_rank:
        raise LoRAError(name, f"rank {rank} exceeds max_lora_rank={max_lora_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_weights(name, folder)

    shapes = module_shapes(arch_config)
    num_layers = arch_config.num_layers
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unsupported: set[str] = set()
    for key, tensor in tensors.items():
        match = _WEIGHT_NAME.search(key)
        if match is None:
            raise LoRAError(name, f"weight {key} is not a LoRA weight of a supported "
                                  f"projection ({', '.join(SUPPORTED_TARGET_MODULES)})")
        layer_index, block, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in shapes or (block == "self_attn") != (module in _ATTENTION_MODULES):
            unsupported.add(module)
            continue
        if layer_index >= num_layers:
            raise LoRAError(name, f"weight {key} is for layer {layer_index}, but the base "
                                  f"model has {num_layers} layers")
        pairs.setdefault((layer_index, module), {})[half] = tensor
    if unsupported:
        raise LoRAError(name, f"unsupported target modules {', '.join(sorted(unsupported))} "
                              f"(supported: {', '.join(SUPPORTED_TARGET_MODULES)})")
    if not pairs:
        raise LoRAError(name, "the weights file holds no LoRA weights")

    target_modules = tuple(m for m in SUPPORTED_TARGET_MODULES
                           if any(module == m for _, module in pairs))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    largest_rank = 0
    for layer_index in range(num_layers):
        for module in target_modules:
            pair = pairs.get((layer_index, module), {})
            if "A" not in pair or "B" not in pair:
                missing = "lora_A" if "A" not in pair else "lora_B"
                raise LoRAError(name, f"layer {layer_index} {module} has no {missing} weight "
                                      "(every targeted module must be adapted in every layer)")
            lora_a, lora_b = pair["A"], pair["B"]
            out_features, in_features = shapes[module]
            module_rank = lora_a.shape[0]
            if lora_a.dim() != 2 or lora_b.dim() != 2 \
                    or tuple(lora_a.shape) != (module_rank, in_features) \
                    or tuple(lora_b.shape) != (out_features, module_rank):
                raise LoRAError(name, f"layer {layer_index} {module}: lora_A "
                                      f"{tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)} "
                                      f"do not fit the base model's {out_features}x"
                                      f"{in_features} projection with rank {module_rank}")
            if module_rank > max_lora_rank:
                raise LoRAError(name, f"rank {module_rank} exceeds "
                                      f"max_lora_rank={max_lora_rank}")
            largest_rank = max(largest_rank, module_rank)
            weights[(layer_index, module)] = (
                lora_a.to(dtype).contiguous(),
                (lora_b.double() * scaling).to(dtype).contiguous(),
            )
    return LoRAAdapter(lora_request, largest_rank, target_modules, weights)


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoRANotFoundError(name, f"no adapter_config.json in {folder}")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRAError(name, f"cannot read {path}: {error}") from error
    if not isinstance(config, dict):
        raise LoRAError(name, f"{path} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(name, f"peft_type {peft_type!r} is not LORA")
    for key, (allowed, what) in _REFUSED_UNLESS.items():
        value = config.get(key, allowed)
        if value != allowed and not (allowed is None and value in ([], {})) \
                and not (allowed == {} and value is None):
            raise LoRAError(name, f"{what} ({key}={value!r}) are not supported")
    target_modules = config.get("target_modules")
    if isinstance(target_modules, list):
        unsupported = sorted(set(target_modules) - set(SUPPORTED_TARGET_MODULES))
        if unsupported:
            raise LoRAError(name, f"unsupported target modules {', '.join(unsupported)} "
                                  f"(supported: {', '.join(SUPPORTED_TARGET_MODULES)})")
    return config


def _read_weights(name: str, folder: Path) -> dict[str, torch.Tensor]:
    safetensors_path = folder / "adapter_model.safetensors"
    bin_path = folder / "adapter_model.bin"
    try:
        if safetensors_path.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_path))
        if bin_path.is_file():
            tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict):
                raise LoRAError(name, f"{bin_path} does not hold a dict of tensors")
            return tensors
    except LoRAError:
        raise
    except Exception as error:  # noqa: BLE001 - a corrupt file fails in many ways
        raise LoRAError(name, f"cannot read the adapter weights: {error}") from error
    raise LoRANotFoundError(name, f"no adapter_model.safetensors in {folder}")


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
