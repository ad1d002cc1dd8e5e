"""LoRA errors as types: the engine turns them into request refusals, the server into
HTTP statuses (a missing adapter is 404, anything else wrong with one is 400)."""

from __future__ import annotations


class LoRAError(ValueError):
    """Adapter ``lora_name`` cannot be used: ``message`` says why (a rank above
    ``max_lora_rank``, an unsupported target module, shapes that do not fit the base model,
    a name reused with another path, LoRA not enabled, ...). ``str()`` is
    ``"LoRA adapter '<name>': <message>"``."""

    def __init__(self, lora_name: str | None, message: str) -> None:
        super().__init__(lora_name, message)
        self.lora_name = lora_name
        self.message = message

    def __str__(self) -> str:
        if self.lora_name is None:
            return self.message
        return f"LoRA adapter {self.lora_name!r}: {self.message}"


class LoRANotFoundError(LoRAError):
    """No adapter of that name is loaded, or its folder (or weights file) does not exist."""
