"""The architecture of a Llama-family decoder, as one narrow validated dataclass.

`ModelArchConfig` holds only what the model code reads. It is built from a Hugging Face
`config.json` (`from_hf_config`) or from GGUF metadata (`from_gguf_metadata`); anything the
model code cannot honour (an unknown architecture, a RoPE scaling type we do not implement,
sliding-window attention) is rejected here with a `ValueError` naming it, so a model never
loads and then silently computes something else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Hugging Face `model_type` / `architectures[0]` -> our family name.
HF_MODEL_TYPE_TO_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
HF_ARCHITECTURE_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# GGUF `general.architecture` values we load.
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

ROPE_SCALING_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How rotary frequencies are rescaled for long context.

    `rope_type` is "default" (no scaling), "linear" (every frequency divided by `factor`) or
    "llama3" (Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth blend
    between `low_freq_factor` and `high_freq_factor` wavelengths relative to
    `original_max_position_embeddings`).
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; "
                f"supported: {', '.join(ROPE_SCALING_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """Shapes and numerics of one decoder; every field is read by the model code.

    Invariants (checked on construction): all sizes positive, `num_heads` a multiple of
    `num_kv_heads` (grouped-query attention), `head_dim` even (RoPE rotates pairs).
    `qkv_bias` / `o_bias` say which attention projections carry a bias (Qwen2: q, k, v only);
    `qk_norm` adds a per-head RMSNorm on queries and keys before RoPE (Qwen3).
    `rope_freq_factors`, when set, divides each rotary frequency (GGUF Llama 3 files store
    their scaling this way, as a tensor, instead of as parameters).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported model family {self.family!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                f"expected head_dim/2 = {self.head_dim // 2}"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> ModelArchConfig:
        """Build from the parsed `config.json` of a Hugging Face model folder.

        Accepts both the classic layout (`rope_theta`, `rope_scaling`) and the newer
        `rope_parameters` dict written by transformers 5.
        """
        family = _hf_family(hf_config)
        if hf_config.get("use_sliding_window"):
            raise ValueError(f"{family}: sliding-window attention is not supported")
        num_heads = _require(hf_config, "num_attention_heads")
        hidden_size = _require(hf_config, "hidden_size")
        head_dim = hf_config.get("head_dim") or hidden_size // num_heads
        rope_params = dict(hf_config.get("rope_scaling") or {})
        rope_params.update(hf_config.get("rope_parameters") or {})
        rope_theta = rope_params.pop("rope_theta", None) or hf_config.get("rope_theta", 10000.0)
        attention_bias = bool(hf_config.get("attention_bias", False))
        if family == "qwen2":
            # Qwen2 always has q/k/v biases and never an o_proj bias; no config flag says so.
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = attention_bias
        eos = hf_config.get("eos_token_id")
        eos_token_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            family=family,
            vocab_size=_require(hf_config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require(hf_config, "intermediate_size"),
            num_layers=_require(hf_config, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=_rope_scaling_from_dict(rope_params),
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        *,
        tensor_names: frozenset[str] = frozenset(),
        rope_freq_factors: tuple[float, ...] | None = None,
        vocab_size: int | None = None,
    ) -> ModelArchConfig:
        """Build from GGUF key/value metadata (values already decoded to Python scalars).

        `tensor_names` tells whether an output head exists (absent -> tied embeddings) and
        whether Q/K/V biases are present; `vocab_size` falls back to the tokenizer's size
        when `<arch>.vocab_size` is absent.
        """
        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

        def key(name: str, default: Any = None, required: bool = False) -> Any:
            full = f"{arch}.{name}"
            if full not in metadata:
                if required:
                    raise ValueError(f"GGUF metadata is missing {full!r}")
                return default
            return metadata[full]

        hidden_size = int(key("embedding_length", required=True))
        num_heads = int(key("attention.head_count", required=True))
        head_dim = int(key("attention.key_length", hidden_size // num_heads))
        scaling_type = key("rope.scaling.type", "none")
        rope_scaling = RopeScaling()
        if scaling_type == "linear":
            rope_scaling = RopeScaling("linear", factor=float(key("rope.scaling.factor", 1.0)))
        elif scaling_type not in ("none", None):
            raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r}")
        n_vocab = key("vocab_size", vocab_size)
        if n_vocab is None:
            raise ValueError(f"GGUF metadata is missing {arch}.vocab_size and a vocabulary")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        has_bias = "blk.0.attn_q.bias" in tensor_names
        return cls(
            family=arch,
            vocab_size=int(n_vocab),
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length", required=True)),
            num_layers=int(key("block_count", required=True)),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            rope_freq_factors=rope_freq_factors,
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias=has_bias,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )


def _hf_family(hf_config: Mapping[str, Any]) -> str:
    model_type = hf_config.get("model_type")
    if model_type in HF_MODEL_TYPE_TO_FAMILY:
        return HF_MODEL_TYPE_TO_FAMILY[model_type]
    for architecture in hf_config.get("architectures") or ():
        if architecture in HF_ARCHITECTURE_TO_FAMILY:
            return HF_ARCHITECTURE_TO_FAMILY[architecture]
    named = model_type or (hf_config.get("architectures") or [None])[0]
    raise ValueError(
        f"unsupported model architecture {named!r}; "
        f"supported model_type values: {', '.join(HF_MODEL_TYPE_TO_FAMILY)}"
    )


def _require(hf_config: Mapping[str, Any], name: str) -> int:
    if name not in hf_config:
        raise ValueError(f"config.json is missing {name!r}")
    return int(hf_config[name])


def _rope_scaling_from_dict(params: Mapping[str, Any]) -> RopeScaling:
    # Older configs spell the key "type", newer ones "rope_type".
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "linear":
        return RopeScaling("linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    return RopeScaling(rope_type)  # raises the ValueError naming the type
