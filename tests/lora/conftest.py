"""Fixtures for the LoRA tests: the engine tests' tiny random Llama (a Hugging Face
folder) and two random, non-zero PEFT adapters for it, saved by peft itself.

- ``adapter_a``: every supported projection, r=8, lora_alpha=16 (scaling 2).
- ``adapter_b``: q, v and down only, r=4, lora_alpha=6 with rsLoRA (scaling 6 / 2 = 3).

peft initialises lora_B to zero (an adapter that changes nothing); both halves get random
values here so each adapter moves the logits and the greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.lora import LoRARequest
from tests.engine.conftest import tiny_model_dir  # noqa: F401 - the shared fixture

ADAPTER_A_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"]
ADAPTER_B_TARGETS = ["q_proj", "v_proj", "down_proj"]


def save_random_adapter(base, adapter_dir, *, targets, r, alpha, use_rslora=False,
                        seed=0, std=0.15):
    """Build a PEFT LoRA adapter with random A and B for `base` (a transformers model, or
    the folder of one; a model is changed in place by peft), save it to `adapter_dir` and
    return the folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    if not isinstance(base, torch.nn.Module):
        base = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                        use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(adapter_dir)
    return adapter_dir


@pytest.fixture(scope="session")
def adapter_a_dir(tiny_model_dir, tmp_path_factory):  # noqa: F811
    return save_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter-a"),
                               targets=ADAPTER_A_TARGETS, r=8, alpha=16, seed=1)


@pytest.fixture(scope="session")
def adapter_b_dir(tiny_model_dir, tmp_path_factory):  # noqa: F811
    return save_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter-b"),
                               targets=ADAPTER_B_TARGETS, r=4, alpha=6, use_rslora=True,
                               seed=2, std=0.2)


@pytest.fixture(scope="session")
def lora_a(adapter_a_dir):
    return LoRARequest("adapter-a", 1, str(adapter_a_dir))


@pytest.fixture(scope="session")
def lora_b(adapter_b_dir):
    return LoRARequest("adapter-b", 2, str(adapter_b_dir))
