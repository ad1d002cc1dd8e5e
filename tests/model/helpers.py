"""Shared builders for model and worker tests: tiny random models and step helpers."""

from __future__ import annotations

import torch

from prefixcache.model.config import ModelArchConfig, RopeScaling
from prefixcache.model.llama import LlamaForCausalLM
from prefixcache.worker.model_runner import ModelRunner

TINY_VOCAB_SIZE = 96


def tiny_arch_config(**overrides) -> ModelArchConfig:
    """A 2-layer GQA model (4 query heads sharing 2 KV heads) with Llama 3 RoPE scaling."""
    fields = dict(
        family="llama",
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=80,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(
            "llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        max_position_embeddings=256,
    )
    fields.update(overrides)
    return ModelArchConfig(**fields)


def randomize_vectors(module: torch.nn.Module, seed: int = 0) -> None:
    """Give every 1-D parameter (norm weights, biases) random values around 1.

    Fresh models start with norms at exactly 1 and biases at 0, which would hide a norm or a
    bias that is never applied; random values make each of them change the logits.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() == 1:
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.copy_(1.0 + 0.2 * noise)


def tiny_model(seed: int = 0, **overrides) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """A randomly initialised float32 model of `tiny_arch_config(**overrides)`."""
    config = tiny_arch_config(**overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    randomize_vectors(model, seed)
    return model.eval(), config


def random_token_ids(num_tokens: int, seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


@torch.inference_mode()
def all_position_logits(runner: ModelRunner, sequence) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] for every token of one ScheduledSequence."""
    inputs = runner.build_step_inputs([sequence])
    every_row = torch.arange(len(sequence.token_ids))
    return runner.model(inputs.input_ids, runner.kv_caches, inputs.metadata, every_row)
