"""The model's active adapters and the batched LoRA deltas of one step.

Up to ``max_loras`` adapters are *active*: their weights are stacked, per layer and per
projection of the model. The model's projections are fused (``qkv_proj`` holds q, k and
v; ``gate_up_proj`` holds gate and up), and share their input, so one matrix holds the A
of every active adapter and targeted part, and each part has its own B stack::

    A_t [in_features, C]     columns grouped by part, then by slot: C = sum of the ranks
    B_t[part] [C_part, out_part]   the scaled B of each slot targeting the part

Column c belongs to the adapter in slot ``column_slots[c]``. For a step whose tokens use
slots ``token_slots`` [T] (-1: the base model), each token must see only its own
adapter's columns, so with ``mask[t, c] = (token_slots[t] == column_slots[c])``::

    shrunk = (x @ A_t) * mask                              [T, C]
    out[:, part rows] += shrunk[:, part columns] @ B_t[part]

A few matmul-sized kernels per projection whatever the mix of adapters in the step; a
base-model token's mask row is all zeros, so its output is exactly the base model's.
Every token pays for the ranks of all active adapters (the mask zeroes the others).

That suits decode steps, whose tokens alternate between adapters one row at a time. A
step whose tokens come in long runs of one adapter (prefill chunks: a sequence's tokens
are consecutive rows) is computed per run instead, on row slices, with that adapter's own
weights only: no mask and no other adapter's ranks, a few more kernels per run. Runs of
base-model tokens are left untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixcache.lora.adapter import LoRAAdapter, module_shapes
from prefixcache.model.config import ModelArchConfig

# A step uses per-run deltas when its adapter runs average at least this many tokens:
# below it the extra kernels per run cost more than the mask path's wasted ranks.
MIN_TOKENS_PER_RUN = 32

# The model's projection -> the Hugging Face projections fused in it, in row order.
PROJECTION_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True, slots=True)
class LoRAPartStack:
    """One part's B stack within a projection: output rows `[out_start, out_end)`, columns
    `[column_start, column_end)` of the shrunk activations."""

    out_start: int
    out_end: int
    column_start: int
    column_end: int
    b_t: torch.Tensor  # [column_end - column_start, out_end - out_start]


@dataclass(frozen=True, slots=True)
class LoRAStack:
    """One layer's stacked weights for one projection (see the module docstring)."""

    a_t: torch.Tensor  # [in_features, C]
    parts: tuple[LoRAPartStack, ...]
    # For per-run deltas: slot -> (its A [in_features, C_slot], its parts, columns of C_slot).
    slot_to_stack: dict[int, tuple[torch.Tensor, tuple[LoRAPartStack, ...]]]


class LoRALayerStep:
    """The LoRA deltas of one layer for one step: the model calls :meth:`add` after each
    projection, with the projection's input and output."""

    __slots__ = ("stacks", "masks", "runs")

    def __init__(self, stacks: dict[str, LoRAStack],
                 masks: dict[str, torch.Tensor | None],
                 runs: list[tuple[int, int, int]] | None) -> None:
        """`runs`: (first row, end row, slot) of each run of one adapter's tokens, to
        compute per run; None to compute with `masks`."""
        self.stacks = stacks
        self.masks = masks
        self.runs = runs

    def add(self, projection: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` [T, out_features] plus each token's adapter delta for `projection`
        (``"qkv_proj"``, ``"o_proj"``, ``"gate_up_proj"`` or ``"down_proj"``), computed
        from the projection's input `x` [T, in_features]; `out` itself if no active
        adapter targets it. `out` is updated in place (a projection's fresh output) and
        returned."""
        stack = self.stacks.get(projection)
        if stack is None:
            return out
        if self.runs is not None:
            return self._add_per_run(stack, x, out)
        shrunk = x.to(stack.a_t.dtype) @ stack.a_t  # [T, C]
        mask = self.masks[projection]
        if mask is not None:
            shrunk = shrunk * mask
        shrunk = shrunk.to(out.dtype)
        for part in stack.parts:
            # [T, C_part] @ [C_part, out_part] added into the part's rows of the output.
            out[:, part.out_start:part.out_end].addmm_(
                shrunk[:, part.column_start:part.column_end], part.b_t.to(out.dtype))
        return out

    def _add_per_run(self, stack: LoRAStack, x: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
        for start, end, slot in self.runs:
            slot_stack = stack.slot_to_stack.get(slot)
            if slot_stack is None:  # this adapter leaves the projection alone
                continue
            a_t, parts = slot_stack
            shrunk = (x[start:end].to(a_t.dtype) @ a_t).to(out.dtype)  # [run, C_slot]
            for part in parts:
                out[start:end, part.out_start:part.out_end].addmm_(
                    shrunk[:, part.column_start:part.column_end], part.b_t.to(out.dtype))
        return out


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
        # Runs of one slot: rows where the slot changes start a new one.
        starts = [0, *(torch.nonzero(token_slots[1:] != token_slots[:-1]).view(-1) + 1)
                  .tolist()]
        ends = [*starts[1:], token_slots.shape[0]]
        runs = [(start, end, slot) for start, end, slot
                in zip(starts, ends, token_slots[starts].tolist(), strict=True) if slot >= 0]
        if sum(end - start for start, end, _ in runs) >= MIN_TOKENS_PER_RUN * len(runs):
            return LoRAStepBatch([LoRALayerStep(stacks, {}, runs)
                                  for stacks in self._layer_stacks])
        masks: dict[str, torch.Tensor | None] = {}
        for projection, column_slots in self._column_slots.items():
            if bool((column_slots == token_slots[0]).all()) \
                    and bool((token_slots == token_slots[0]).all()):
                masks[projection] = None  # one adapter, used by every token: all ones
            else:
                masks[projection] = (token_slots[:, None] == column_slots[None, :]).to(
                    self._layer_stacks[0][projection].a_t.dtype)  # [T, C]
        return LoRAStepBatch([LoRALayerStep(stacks, masks, None)
                              for stacks in self._layer_stacks])

    def _rebuild_stacks(self) -> None:
        shapes = module_shapes(self.arch_config)
        self._layer_stacks = [{} for _ in range(self.arch_config.num_layers)]
        self._column_slots = {}
        active = [(slot, adapter) for slot, adapter in enumerate(self.slot_adapters)
                  if adapter is not None]
        for projection, parts in PROJECTION_PARTS.items():
            # Per targeted part: (part, its output rows, its slots, their columns).
            layout = []
            column_slots: list[int] = []
            out_start = 0
            for part in parts:
                out_end = out_start + shapes[part][0]
                users = [(slot, adapter) for slot, adapter in active
                         if part in adapter.target_modules]
                if users:
                    column_start = len(column_slots)
                    for slot, adapter in users:
                        column_slots += [slot] * adapter.weights[(0, part)][0].shape[0]
                    layout.append((part, out_start, out_end, users, column_start,
                                   len(column_slots)))
                out_start = out_end
            if not column_slots:
                continue
            self._column_slots[projection] = torch.tensor(column_slots, dtype=torch.int64)
            for layer_index, stacks in enumerate(self._layer_stacks):
                a_blocks, part_stacks = [], []
                for part, start, end, users, column_start, column_end in layout:
                    weights = [adapter.weights[(layer_index, part)] for _, adapter in users]
                    a_blocks += [lora_a for lora_a, _ in weights]
                    b_t = torch.cat([lora_b for _, lora_b in weights], dim=1).t()
                    part_stacks.append(LoRAPartStack(start, end, column_start, column_end,
                                                     b_t.contiguous()))  # [C_part, out_part]
                stacks[projection] = LoRAStack(
                    a_t=torch.cat(a_blocks, dim=0).t().contiguous(),  # [in, C]
                    parts=tuple(part_stacks),
                    slot_to_stack=self._slot_stacks(layer_index, layout, active),
                )

    @staticmethod
    def _slot_stacks(layer_index: int, layout: list, active: list
                     ) -> dict[int, tuple[torch.Tensor, tuple[LoRAPartStack, ...]]]:
        """Each active slot's own A and part B stacks for one projection of one layer."""
        slot_to_stack = {}
        for slot, adapter in active:
            a_blocks, part_stacks, num_columns = [], [], 0
            for part, start, end, _, _, _ in layout:
                if part not in adapter.target_modules:
                    continue
                lora_a, lora_b = adapter.weights[(layer_index, part)]
                a_blocks.append(lora_a)
                part_stacks.append(LoRAPartStack(start, end, num_columns,
                                                 num_columns + lora_a.shape[0],
                                                 lora_b.t().contiguous()))
                num_columns += lora_a.shape[0]
            if a_blocks:
                slot_to_stack[slot] = (torch.cat(a_blocks, dim=0).t().contiguous(),
                                       tuple(part_stacks))
        return slot_to_stack
