"""The model's active adapters and the batched LoRA deltas of one step.

Up to ``max_loras`` adapters are *active*: their weights are stacked, per layer and per
projection of the model, into one pair of matrices. The model's projections are fused
(``qkv_proj`` holds q, k and v; ``gate_up_proj`` holds gate and up), so an adapter's
columns for a fused projection are its parts' A rows side by side, and its B is block
diagonal, each part's B placed at that part's output rows::

    A_t [in_features, C]    the A of every active adapter and targeted part, transposed
    B_t [C, out_features]   their scaled B, each block at its part's rows, zero elsewhere

where C is the sum of the ranks. Column c belongs to the adapter in slot
``column_slots[c]``. For a step whose tokens use slots ``token_slots`` [T] (-1: the base
model), each token must see only its own adapter's columns, so with
``mask[t, c] = (token_slots[t] == column_slots[c])``::

    out += ((x @ A_t) * mask) @ B_t

Three matmul-sized kernels per projection whatever the mix of adapters in the step, in
prefill (T rows) and decode alike; a base-model token's mask row is all zeros, so its
output is exactly the base model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixcache.lora.adapter import LoRAAdapter, module_shapes
from prefixcache.model.config import ModelArchConfig

# The model's projection -> the Hugging Face projections fused in it, in row order.
PROJECTION_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True, slots=True)
class LoRAStack:
    """One layer's stacked weights for one projection (see the module docstring)."""

    a_t: torch.Tensor  # [in_features, C]
    b_t: torch.Tensor  # [C, out_features]


class LoRALayerStep:
    """The LoRA deltas of one layer for one step: the model calls :meth:`add` after each
    projection, with the projection's input and output."""

    __slots__ = ("stacks", "masks")

    def __init__(self, stacks: dict[str, LoRAStack],
                 masks: dict[str, torch.Tensor | None]) -> None:
        self.stacks = stacks
        self.masks = masks

    def add(self, projection: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` [T, out_features] plus each token's adapter delta for `projection`
        (``"qkv_proj"``, ``"o_proj"``, ``"gate_up_proj"`` or ``"down_proj"``), computed
        from the projection's input `x` [T, in_features]; `out` itself if no active
        adapter targets it. Returns a new tensor: `out` may be a view the caller keeps."""
        stack = self.stacks.get(projection)
        if stack is None:
            return out
        shrunk = x.to(stack.a_t.dtype) @ stack.a_t  # [T, C]
        mask = self.masks[projection]
        if mask is not None:
            shrunk = shrunk * mask
        return torch.addmm(out, shrunk.to(out.dtype), stack.b_t.to(out.dtype))


@dataclass(frozen=True, slots=True)
class LoRAStepBatch:
    """Per-step LoRA inputs of the model: one :class:`LoRALayerStep` per layer."""

    layers: list[LoRALayerStep]


class LoRASlots:
    """`max_loras` slots of active adapters for a model of `arch_config` (see the module
    docstring). :meth:`activate` puts a step's adapters in slots, replacing the least
    recently used others; :meth:`step_batch` builds the step's deltas."""

    def __init__(self, arch_config: ModelArchConfig, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.arch_config = arch_config
        self.max_loras = max_loras
        self.slot_adapters: list[LoRAAdapter | None] = [None] * max_loras
        self._slot_last_used = [0] * max_loras
        self._num_activations = 0
        self.num_slot_loads = 0  # adapters put into a slot (stacks rebuilt each time)
        self._layer_stacks: list[dict[str, LoRAStack]] = []
        self._column_slots: dict[str, torch.Tensor] = {}

    def activate(self, adapters: Sequence[LoRAAdapter]) -> dict[LoRAAdapter, int]:
        """Make every adapter of `adapters` (distinct) active; returns each one's slot.
        Raises ValueError if they are more than `max_loras` (the scheduler never runs more
        at once)."""
        if len(adapters) > self.max_loras:
            raise ValueError(f"a step uses {len(adapters)} LoRA adapters, more than "
                             f"max_loras={self.max_loras}")
        self._num_activations += 1
        adapter_to_slot = {adapter: slot for slot, adapter in enumerate(self.slot_adapters)
                           if adapter is not None}
        wanted_slots = {adapter_to_slot[a] for a in adapters if a in adapter_to_slot}
        changed = False
        for adapter in adapters:
            if adapter in adapter_to_slot:
                continue
            # An empty slot if any, else the least recently used one this step does not use.
            free_slots = [s for s in range(self.max_loras) if s not in wanted_slots]
            slot = min(free_slots, key=lambda s: (self.slot_adapters[s] is not None,
                                                  self._slot_last_used[s]))
            self.slot_adapters[slot] = adapter
            adapter_to_slot[adapter] = slot
            wanted_slots.add(slot)
            self.num_slot_loads += 1
            changed = True
        for adapter in adapters:
            self._slot_last_used[adapter_to_slot[adapter]] = self._num_activations
        if changed:
            self._rebuild_stacks()
        return {adapter: adapter_to_slot[adapter] for adapter in adapters}

    def step_batch(self, token_slots: torch.Tensor) -> LoRAStepBatch:
        """The deltas for a step whose token t uses slot `token_slots[t]` ([T] int64, -1
        for the base model); the slots must hold what :meth:`activate` last returned."""
        masks: dict[str, torch.Tensor | None] = {}
        for projection, column_slots in self._column_slots.items():
            if bool((column_slots == token_slots[0]).all()) \
                    and bool((token_slots == token_slots[0]).all()):
                masks[projection] = None  # one adapter, used by every token: all ones
            else:
                masks[projection] = (token_slots[:, None] == column_slots[None, :]).to(
                    self._layer_stacks[0][projection].a_t.dtype)  # [T, C]
        return LoRAStepBatch([LoRALayerStep(stacks, masks) for stacks in self._layer_stacks])

    def _rebuild_stacks(self) -> None:
        shapes = module_shapes(self.arch_config)
        self._layer_stacks = [{} for _ in range(self.arch_config.num_layers)]
        self._column_slots = {}
        for projection, parts in PROJECTION_PARTS.items():
            part_rows: dict[str, tuple[int, int]] = {}
            offset = 0
            for part in parts:
                part_rows[part] = (offset, offset + shapes[part][0])
                offset += shapes[part][0]
            out_features = offset
            column_slots: list[int] = []
            for slot, adapter in enumerate(self.slot_adapters):
                if adapter is None:
                    continue
                for part in parts:
                    if part in adapter.target_modules:
                        column_slots += [slot] * adapter.weights[(0, part)][0].shape[0]
            if not column_slots:
                continue
            self._column_slots[projection] = torch.tensor(column_slots, dtype=torch.int64)
            for layer_index, stacks in enumerate(self._layer_stacks):
                a_blocks, b_blocks = [], []
                for adapter in self.slot_adapters:
                    if adapter is None:
                        continue
                    for part in parts:
                        if part not in adapter.target_modules:
                            continue
                        lora_a, lora_b = adapter.weights[(layer_index, part)]
                        block = lora_b.new_zeros(out_features, lora_b.shape[1])
                        start, end = part_rows[part]
                        block[start:end] = lora_b
                        a_blocks.append(lora_a)
                        b_blocks.append(block)
                stacks[projection] = LoRAStack(
                    a_t=torch.cat(a_blocks, dim=0).t().contiguous(),  # [in, C]
                    b_t=torch.cat(b_blocks, dim=1).t().contiguous(),  # [C, out]
                )
