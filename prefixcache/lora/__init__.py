"""LoRA adapters: loading PEFT folders (:mod:`.adapter`), the engine's registry of names
and loaded weights (:mod:`.registry`), the model's active slots and batched per-token
deltas (:mod:`.slots`). ``LoRARequest`` and the errors are torch-free; the rest is loaded
on first use."""

from __future__ import annotations

from prefixcache.lora.errors import LoRAError, LoRANotFoundError
from prefixcache.lora.request import LoRARequest

__all__ = ["LoRAError", "LoRANotFoundError", "LoRARequest"]
