"""Which weight-only quantized decode a model gets, and installing it.

`--quantization` (vLLM's spelling) takes:

- `none`: every step on the dense weights, exactly as without this module.
- `int4`: steps of at most `max_quantized_tokens` tokens multiply by 4-bit group-wise
  weights. For a GGUF file these are the file's own Q4_0/Q4_1 blocks, unchanged (the model
  computes what the file defines); other weights are rounded to Q4_1-style groups of 32.
  The output head uses the file's 4-bit blocks when it has them, else int8 per row with
  its leading logits recomputed from the dense weights (see `RescoredDecodeHead`; a Q8_0
  or float head rounded to 4 bits would lose more than the file's format does).
- `int8`: the same steps multiply by int8 weights with one scale per output row, rounded
  from the dense weights (for bfloat16 / Hugging Face models); the output head as above.
- `auto` (the default): `int4` for a GGUF file whose projections are 4-bit blocks, `int8`
  for another quantized GGUF file, `none` for float weights (a Hugging Face folder, an
  F32/F16/BF16 GGUF).

Larger steps (prefill) always use the dense weights, so the model keeps them too: the
quantized copies are extra memory, reported by `decode_weight_bytes`; the KV cache's own
budget is unaffected.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from prefixcache.config import DEFAULT_QUANTIZATION, QUANTIZATION_METHODS
from prefixcache.model.llama import FUSED_PROJECTIONS, LlamaForCausalLM
from prefixcache.model.quantized_linear import (
    DecodeQuantizedLinear,
    Int4GroupWeight,
    Int8ChannelWeight,
    QuantizedWeight,
    RescoredDecodeHead,
)

__all__ = ["DEFAULT_QUANTIZATION", "QUANTIZATION_METHODS", "quantize_for_decode"]
# Steps with at most this many tokens use the quantized weights. A dense matmul reading
# its weights from memory hardly slows with more rows, while the weight-only kernels'
# time grows about linearly. Over a whole model's weights (too large for the CPU caches,
# as in a real step) int4 still reads and computes faster than bfloat16 at 8 rows and
# loses from about 12; one layer's weights alone, kept hot in cache, would suggest a far
# lower limit that real steps do not show.
DEFAULT_MAX_QUANTIZED_TOKENS = 8
# An int8 output head recomputes this many leading logits per row from the dense weights:
# far more than greedy decoding or a usual top-k needs, and a negligible matmul next to the
# head's 49,152 rows (SmolLM2).
NUM_RESCORED_LOGITS = 64

# (q [N, K] in 0..15, scale [N, K / 32], zero [N, K / 32]): see `Int4GroupWeight`.
Int4Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def resolve_quantization(requested: str, *, has_q4_blocks: bool, is_quantized_file: bool) -> str:
    """The method `requested` means for a model: `auto` resolved, others checked.

    `has_q4_blocks`: the model is a GGUF file whose projections are Q4_0/Q4_1 blocks;
    `is_quantized_file`: a GGUF file with any quantized weights. Raises ValueError for a name
    not in `QUANTIZATION_METHODS`.
    """
    if not isinstance(requested, str) or requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {requested!r}"
        )
    if requested != "auto":
        return requested
    if has_q4_blocks:
        return "int4"
    return "int8" if is_quantized_file else "none"


def quantize_for_decode(
    model: LlamaForCausalLM,
    method: str,
    q4_blocks: Mapping[str, Int4Blocks] | None = None,
    max_quantized_tokens: int = DEFAULT_MAX_QUANTIZED_TOKENS,
) -> None:
    """Give every projection and the output head of `model` a quantized copy (in place).

    `method` is `int4` or `int8` (`none` changes nothing); `q4_blocks` maps Hugging Face
    weight names (`model.layers.0.self_attn.q_proj.weight`) to the file's own 4-bit blocks,
    used by `int4` wherever every part of a fused projection has them. The dense weights
    stay in place, shared, for steps of more than `max_quantized_tokens` tokens.
    Raises ValueError for an unknown method, or for `int4` on a weight without blocks whose
    input size is not a multiple of 32.
    """
    if method == "none":
        return
    if method not in ("int4", "int8"):
        raise ValueError(f"cannot quantize for decode with method {method!r}")
    if not isinstance(max_quantized_tokens, int) or max_quantized_tokens < 1:
        raise ValueError(
            f"max_quantized_tokens must be a positive int, got {max_quantized_tokens!r}"
        )
    q4_blocks = q4_blocks or {}
    for layer_index, layer in enumerate(model.model.layers):
        for module_path in _PROJECTIONS:
            parent_path, leaf = module_path.split(".")
            parent = layer.get_submodule(parent_path)
            linear = getattr(parent, leaf)
            prefix = f"model.layers.{layer_index}.{parent_path}."
            part_names = [f"{prefix}{part}.weight" for part in FUSED_PROJECTIONS.get(leaf, (leaf,))]
            blocks = _fused_blocks(q4_blocks, part_names) if method == "int4" else None
            if blocks is not None:
                quantized: QuantizedWeight = Int4GroupWeight(*blocks, group_size=32)
            elif method == "int4":
                quantized = Int4GroupWeight.from_float(linear.weight.detach())
            else:
                quantized = Int8ChannelWeight.from_float(linear.weight.detach())
            setattr(
                parent,
                leaf,
                DecodeQuantizedLinear(linear.weight, linear.bias, quantized, max_quantized_tokens),
            )
    head_name = (
        "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    )
    head_blocks = q4_blocks.get(head_name) if method == "int4" else None
    head_weight = model.output_weight
    if head_blocks is not None:
        # The file's own format: computed as the file defines it, nothing to correct.
        model.decode_lm_head = DecodeQuantizedLinear(
            head_weight, None, Int4GroupWeight(*head_blocks, group_size=32),
            max_quantized_tokens)
    else:
        model.decode_lm_head = RescoredDecodeHead(
            head_weight, Int8ChannelWeight.from_float(head_weight.detach()),
            max_quantized_tokens, min(NUM_RESCORED_LOGITS, head_weight.shape[0]))


def decode_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the quantized weight copies `quantize_for_decode` added (0 without)."""
    return sum(
        module.quantized.nbytes
        for module in model.modules()
        if isinstance(module, DecodeQuantizedLinear)
    )


def dense_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the model's parameters (the dense weights; tied ones counted once)."""
    return sum(param.numel() * param.element_size() for param in model.parameters())


def _fused_blocks(
    q4_blocks: Mapping[str, Int4Blocks], part_names: list[str]
) -> Int4Blocks | None:
    """The blocks of a fused projection, its parts' rows stacked in fusion order; None
    unless every part has blocks."""
    parts = [q4_blocks.get(name) for name in part_names]
    if any(part is None for part in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    q, scale, zero = (torch.cat(pieces, dim=0) for pieces in zip(*parts, strict=True))
    return q, scale, zero
