"""A plain-PyTorch Llama-family decoder: Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3.

Tokens arrive packed - one [num_tokens] row per token, sequences back to back - so the dense
layers (projections, MLP, norms) run on the whole step's batch at once whatever mix of
prompts and decodes it holds. Only `PagedAttention` looks at the KV cache.

Parameter names follow Hugging Face's (`model.layers.N.self_attn...`) except two fusions done
at load time by `load_hf_state_dict`: q/k/v projections into `qkv_proj` and gate/up into
`gate_up_proj`, one matmul each instead of three and two.

LoRA: `forward` takes the step's adapter deltas (`prefixcache.lora.slots.LoRAStepBatch`,
None without adapters); each layer adds them right after each projection, whatever module
computes the projection, so every token gets its own adapter's delta.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.model.attention import PagedAttention
from prefixcache.model.attention_metadata import AttentionMetadata, KVCache
from prefixcache.model.config import ModelArchConfig
from prefixcache.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from prefixcache.lora.slots import LoRALayerStep, LoRAStepBatch


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics computed in float32 whatever the activation dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LlamaAttention(nn.Module):
    """Projections, optional Q/K norm and RoPE around one `PagedAttention`."""

    def __init__(self, config: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary  # shared by all layers; not a parameter
        self.attn = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim)

    def forward(
        self,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        lora: LoRALayerStep | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        if lora is not None:
            qkv = lora.add("qkv_proj", hidden, qkv)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)  # [T, heads, d]
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kv_heads, d]
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kv_heads, d]
        if self.q_norm is not None:
            query = self.q_norm(query)
            key = self.k_norm(key)
        query, key = self.rotary(metadata.positions, query, key)
        attended = self.attn(query, key, value, kv_cache, metadata)  # [T, heads * d]
        if lora is not None:
            return lora.add("o_proj", attended, self.o_proj(attended))
        return self.o_proj(attended)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor, lora: LoRALayerStep | None = None) -> torch.Tensor:
        if lora is None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate_up = lora.add("gate_up_proj", x, self.gate_up_proj(x))  # [T, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        activated = F.silu(gate) * up  # [T, intermediate]
        return lora.add("down_proj", activated, self.down_proj(activated))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        lora: LoRALayerStep | None = None,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), kv_cache, metadata, lora)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # One RoPE table for all layers, kept outside the module tree's parameters.
        rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            config.rope_freq_factors,
        )
        self.rotary = rotary
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head.

    `forward(input_ids, kv_caches, metadata, logits_indices)` computes one step for packed
    tokens and returns float32 logits only for the rows in `logits_indices` (the last token
    of each sequence that will sample), so a 2,000-token prefill never materialises
    2,000 x vocab logits.
    """

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def empty(cls, config: ModelArchConfig) -> LlamaForCausalLM:
        """A CPU model with uninitialised parameters, for loaders about to overwrite them all
        (skips the random initialisation of every weight)."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device="cpu")
        model.model.rotary.reset_tables()
        return model

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: LoRAStepBatch | None = None,
    ) -> torch.Tensor:
        """input_ids [T] int64; one KVCache per layer; logits_indices [N] int64; `lora`
        the step's adapter deltas, one entry per layer, or None for the base model alone.

        Returns [N, vocab_size] float32.
        """
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        lora_layers = lora.layers if lora is not None else [None] * len(kv_caches)
        for layer, kv_cache, lora_layer in zip(self.model.layers, kv_caches, lora_layers,
                                               strict=True):
            hidden = layer(hidden, kv_cache, metadata, lora_layer)
        hidden = self.model.norm(hidden[logits_indices])  # [N, hidden]
        return F.linear(hidden, self.output_weight).float()  # [N, vocab]


def load_hf_state_dict(
    model: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy weights named as in a Hugging Face checkpoint into `model`, fusing as needed.

    Raises ValueError naming any parameter left without a weight, any weight of the wrong
    shape, and any weight the model has no place for (a bias the config did not announce would
    otherwise be dropped silently). Only a tied model's `lm_head.weight` and saved rotary
    frequencies are skipped: both are derived, not learned, here.
    """
    config = model.config
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    # Where each HF projection lands inside a fused parameter: (fused name, row offset).
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    fused_rows = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", q_size),
        "v_proj": ("qkv_proj", q_size + kv_size),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", config.intermediate_size),
    }
    partial_rows: dict[str, int] = {}
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in named_tensors:
            parts = name.split(".")
            target, row_offset = name, None
            if len(parts) >= 2 and parts[-2] in fused_rows:
                fused, row_offset = fused_rows[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
            if target not in params:
                if name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and config.tie_word_embeddings
                ):
                    continue
                unexpected.append(name)
                continue
            param = params[target]
            if row_offset is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"weight {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                loaded.add(target)
                continue
            rows = tensor.shape[0]
            expected = (rows, *param.shape[1:])
            if tuple(tensor.shape) != expected or row_offset + rows > param.shape[0]:
                raise ValueError(f"weight {name} has unexpected shape {tuple(tensor.shape)}")
            param[row_offset : row_offset + rows].copy_(tensor)
            partial_rows[target] = partial_rows.get(target, 0) + rows
            if partial_rows[target] == param.shape[0]:
                loaded.add(target)
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected weight(s): {shown}")
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")
