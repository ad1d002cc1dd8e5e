"""LoRASlots: slot replacement order and each token's delta, on hand-made adapters."""

from __future__ import annotations

import pytest
import torch

from prefixcache.lora import LoRARequest
from prefixcache.lora.adapter import LoRAAdapter, module_shapes
from prefixcache.lora.slots import LoRASlots
from tests.model.helpers import tiny_arch_config


def random_adapter(config, name, lora_int_id, targets, rank, seed):
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_layers):
        for module in targets:
            out_features, in_features = module_shapes(config)[module]
            weights[(layer, module)] = (
                torch.randn(rank, in_features, generator=generator),
                torch.randn(out_features, rank, generator=generator),
            )
    return LoRAAdapter(LoRARequest(name, lora_int_id, f"/{name}"), rank, tuple(targets),
                       weights)


@pytest.fixture
def config():
    return tiny_arch_config()


def test_least_recently_used_slot_is_replaced(config):
    a, b, c = (random_adapter(config, n, i + 1, ["q_proj"], 2, i)
               for i, n in enumerate("abc"))
    slots = LoRASlots(config, max_loras=2)
    assert slots.activate([a, b]) == {a: 0, b: 1}
    assert slots.activate([b]) == {b: 1}
    assert slots.activate([c]) == {c: 0}  # a was used least recently
    assert slots.activate([b, c]) == {b: 1, c: 0}
    assert slots.num_slot_loads == 3
    with pytest.raises(ValueError, match="more than max_loras=2"):
        slots.activate([a, b, c])


@pytest.mark.parametrize("run_length", [1, 40])
@torch.inference_mode()
def test_each_token_gets_its_own_adapters_delta(config, run_length):
    """Tokens alternating between adapters (the mask path) and in long runs of one
    adapter (the per-run path) get the same, exact deltas."""
    a = random_adapter(config, "a", 1, ["q_proj", "v_proj", "gate_proj", "down_proj"], 3, 0)
    b = random_adapter(config, "b", 2, ["k_proj", "up_proj", "o_proj"], 2, 1)
    slots = LoRASlots(config, max_loras=3)
    adapter_to_slot = slots.activate([a, b])
    token_adapters = [t for t in [a, None, b, b, a, None] for _ in range(run_length)]
    token_slots = torch.tensor([-1 if t is None else adapter_to_slot[t]
                                for t in token_adapters])
    step = slots.step_batch(token_slots)
    assert (step.layers[0].runs is not None) == (run_length == 40)
    shapes = module_shapes(config)
    parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "o_proj": ["o_proj"],
             "gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}
    generator = torch.Generator().manual_seed(7)
    for layer_index, layer in enumerate(step.layers):
        for projection, modules in parts.items():
            in_features = shapes[modules[0]][1]
            out_features = sum(shapes[m][0] for m in modules)
            x = torch.randn(len(token_adapters), in_features, generator=generator)
            out = torch.randn(len(token_adapters), out_features, generator=generator)
            result = layer.add(projection, x, out.clone())
            for row, adapter in enumerate(token_adapters):
                expected = out[row].clone()
                offset = 0
                for module in modules:
                    rows = shapes[module][0]
                    if adapter is not None and module in adapter.target_modules:
                        lora_a, lora_b = adapter.weights[(layer_index, module)]
                        expected[offset:offset + rows] += lora_b @ (lora_a @ x[row])
                    offset += rows
                torch.testing.assert_close(result[row], expected, rtol=1e-5, atol=1e-5)
                if adapter is None:
                    assert torch.equal(result[row], out[row])  # exactly the base output
