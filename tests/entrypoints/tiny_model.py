"""A tiny random Llama in a Hugging Face folder, built in milliseconds, for server tests.

Files: ``config.json`` (LlamaForCausalLM), ``model.safetensors`` (HF tensor names),
``tokenizer.json`` (byte-level BPE trained here on a fixed text, so it is reproducible)
and ``tokenizer_config.json`` (ChatML chat template, EOS ``<|im_end|>``).

Two choices make outputs stable under batching, so "batched == one at a time" tests test
the server and not float noise: the output head has large weights (logits spread over
tens of units, so no near-ties for argmax to flip on), and the EOS row of the head is zero
(logit 0, far below the greedy maximum), so greedy generation always runs to
``max_tokens`` and lengths are exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 384
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITION_EMBEDDINGS = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "A gentle breeze stirred the leaves as children laughed in the distance.",
    "Prefix caching reuses the key and value blocks of prompts that share a prefix.",
    "You are a helpful assistant. Answer the question about the document below.",
    "0123456789 hello world, tenants, salts, blocks, tokens and requests.",
]


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return tokenizer


def build_tiny_model(model_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model folder to ``model_dir`` (created) and return it."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE,
    }))
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE, "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "eos_token_id": eos_id, "torch_dtype": "float32",
    }))
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    head_dim = HIDDEN_SIZE // NUM_HEADS
    tensors = {"model.embed_tokens.weight": randn(vocab_size, HIDDEN_SIZE, std=1.0),
               "model.norm.weight": torch.ones(HIDDEN_SIZE)}
    lm_head = randn(vocab_size, HIDDEN_SIZE, std=1.0)
    lm_head[eos_id] = 0.0
    tensors["lm_head.weight"] = lm_head
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}."
        tensors.update({
            prefix + "self_attn.q_proj.weight": randn(NUM_HEADS * head_dim, HIDDEN_SIZE),
            prefix + "self_attn.k_proj.weight": randn(NUM_KV_HEADS * head_dim, HIDDEN_SIZE),
            prefix + "self_attn.v_proj.weight": randn(NUM_KV_HEADS * head_dim, HIDDEN_SIZE),
            prefix + "self_attn.o_proj.weight": randn(HIDDEN_SIZE, NUM_HEADS * head_dim),
            prefix + "mlp.gate_proj.weight": randn(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            prefix + "mlp.up_proj.weight": randn(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            prefix + "mlp.down_proj.weight": randn(HIDDEN_SIZE, INTERMEDIATE_SIZE),
            prefix + "input_layernorm.weight": torch.ones(HIDDEN_SIZE),
            prefix + "post_attention_layernorm.weight": torch.ones(HIDDEN_SIZE),
        })
    save_file({name: t.contiguous() for name, t in tensors.items()},
              str(model_dir / "model.safetensors"))
    return model_dir
