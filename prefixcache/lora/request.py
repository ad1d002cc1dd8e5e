"""`LoRARequest`: which adapter a request runs with, in vLLM's spelling (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter by name, integer id and folder, as vLLM's ``LoRARequest``.

    ``lora_name`` names the adapter: it goes into every KV block hash of the requests that
    use it (so two adapters never share cached KV) and is the ``model`` a server request
    asks for. ``lora_int_id`` (>= 1) is its number, carried in KV events as ``lora_id``.
    ``lora_path`` is a PEFT adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``). One name stands for one folder and one id for the
    engine's lifetime (until the adapter is removed): the engine refuses a name reused
    with another path or id.

    Raises ValueError for an empty name or path, or an id that is not an int >= 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string (the adapter folder), "
                             f"got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id
