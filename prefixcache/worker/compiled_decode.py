"""torch.compile for decode steps (``--optimization-level`` 1 and up; 0, the default, is
eager PyTorch throughout).

A decode step of a small model is a few hundred small ops - norms, RoPE, residual adds,
activations - between the weight-only matmuls. On CPU each eager op pays a dispatch and a
pass over its activations. Inductor fuses the elementwise ops into generated C++ loops and
calls the same ATen kernels for the matmuls and attention, so a compiled step computes the
same function with fewer passes; fusion may round differently from eager in the last bits.

Only steps made of decodes alone (with the paged attention kernel, also short chunks after
context, which it attends with the decodes), without cascade groups and without LoRA
deltas, are compiled. Their inputs differ only in sizes (how many rows, the longest run of
keys, whether rows are padded), which the compiled code takes as dynamic, so a few graphs
serve every such step. Other prefill chunks, cascade attention and LoRA run eagerly: a
request never waits for a compile of a rare step shape.

The engine compiles every graph before serving (`ModelRunner.compile_decode_steps`: one
for a single token, one for a few, one past the quantized layers' row limit; the number of
sequences and the context length never specialize a graph), which takes longer the larger
the model; Inductor keeps compiled code in its on-disk cache, so later starts reuse it. If compiling
fails (no C++ compiler, an unsupported op), the error is logged once and every step runs
eagerly from then on: the engine keeps serving.
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from prefixcache.model.attention_metadata import AttentionMetadata
from prefixcache.model.llama import LlamaForCausalLM
from prefixcache.model.quantized_linear import DecodeQuantizedLinear

if TYPE_CHECKING:
    from prefixcache.lora.slots import LoRAStepBatch

logger = logging.getLogger(__name__)


class CompiledDecode:
    """The model's forward, compiled, for the steps `is_compilable` accepts."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        # Dynamo re-checks every module attribute the graph read on every call: over a
        # millisecond per step for a 30-layer model, a tenth of a small model's decode
        # step. The modules never change after loading (LoRA steps run eagerly), so only
        # the inputs are guarded. Dynamo keeps compiled graphs per code object, so each
        # instance compiles its own copy of the code: without module guards, a graph of
        # one model must never be found for another model in the same process.
        own_code = _run_model.__code__.replace()
        step = types.FunctionType(own_code, _run_model.__globals__, "decode_step")
        compiled_step = torch.compile(
            step, dynamic=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self._compiled: Callable[..., torch.Tensor] | None = functools.partial(
            _call_with_free_batch_sizes, compiled_step, model)
        self._has_run = False
        self._all_graphs_compiled = False
        self._model = model

    def step_sizes_to_compile(self, max_step_tokens: int) -> list[int]:
        """Token counts of steps that together compile every graph that compilable steps
        of up to ``max_step_tokens`` tokens use: Dynamo gives a step of one token its own
        graph, and each weight-only quantized layer switches to the dense weight above its
        limit of rows, so 1, 2 and (quantized models) one past that limit."""
        sizes = {1, 2}
        for module in self._model.modules():
            if isinstance(module, DecodeQuantizedLinear):
                sizes.add(module.max_quantized_tokens + 1)
        return sorted(size for size in sizes if size <= max_step_tokens)

    def mark_all_graphs_compiled(self) -> None:
        """Called once every graph steps will need exists (`step_sizes_to_compile` ran)
        and steps differ only in sizes: from then on a step checks only the guards that
        choose among the graphs. A step that would need another graph is compiled fully
        guarded, and every guard is checked from then on."""
        self._all_graphs_compiled = self._has_run

    @staticmethod
    def is_compilable(metadata: AttentionMetadata, lora: LoRAStepBatch | None) -> bool:
        """Decode-path rows only (no chunk attended on its own), no cascade group, no LoRA
        delta."""
        return (not metadata.chunks and not metadata.decode_shared_prefixes
                and lora is None)

    def run(self, eager: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``eager(*args)``, computed by the compiled forward while compiling works.

        If the compiled call raises, the step runs through ``eager``: when that succeeds,
        the failure was the compiler's (logged once; eager from now on); when it raises
        too, the step itself is at fault and its error propagates as without compiling.
        """
        if self._compiled is None:
            return eager(*args)
        try:
            if self._all_graphs_compiled:
                try:
                    # Every graph exists: pick among them by the guards that tell them
                    # apart, skipping the rest (a millisecond per step at 30 layers).
                    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                        return self._compiled(*args)
                except RuntimeError as exc:
                    if "Recompilation" not in str(exc):
                        raise
                    # A step shape the startup compile did not cover: compile it, fully guarded.
                    logger.warning("a decode step needs a graph not compiled at startup; "
                                   "compiling it, and checking every guard from now on")
                    self._all_graphs_compiled = False
            if self._has_run:
                return self._compiled(*args)
            # The first call compiles: say so, since the step waits for it.
            logger.info("compiling decode steps (torch.compile, -O); this step waits")
            start = time.perf_counter()
            logits = self._compiled(*args)
            self._has_run = True
            logger.info("decode steps compiled in %.1f s", time.perf_counter() - start)
            return logits
        except Exception as exc:  # noqa: BLE001 - told apart by the eager rerun below
            logits = eager(*args)
            logger.warning("torch.compile of decode steps failed, running eagerly from "
                           "now on: %s: %s", type(exc).__name__, exc)
            self._compiled = None
            return logits


def _run_model(model: LlamaForCausalLM, *args: Any) -> torch.Tensor:
    return model(*args)


def _call_with_free_batch_sizes(
    compiled_step: Callable[..., torch.Tensor],
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    kv_caches: list,
    metadata: AttentionMetadata,
    logits_indices: torch.Tensor,
    *rest: Any,
) -> torch.Tensor:
    _free_batch_sizes(metadata, logits_indices)
    return compiled_step(model, input_ids, kv_caches, metadata, logits_indices, *rest)


def _free_batch_sizes(metadata: AttentionMetadata, logits_indices: torch.Tensor) -> None:
    """Keep the number of sequences and the paged kernel's block table width out of the
    compiled graph's guards.

    Nothing branches on them (only the kernel, an opaque operator, reads the batch, and
    logits are taken for however many rows are asked), so their sizes can be unbacked
    symbols that Dynamo never specializes: otherwise one sequence (a size of 1) and
    several would take separate graphs, and Dynamo could tie a block table's width to an
    unrelated size equal to it at the first trace, recompiling as the context grows.
    """
    torch._dynamo.decorators.mark_unbacked(logits_indices, 0)
    batch = metadata.decode_paged
    if batch is not None:
        torch._dynamo.decorators.mark_unbacked(batch.block_tables, 0)
        torch._dynamo.decorators.mark_unbacked(batch.block_tables, 1)
        torch._dynamo.decorators.mark_unbacked(batch.query_start, 0)
        torch._dynamo.decorators.mark_unbacked(batch.seq_lens, 0)
