"""prefixcache: an LLM inference engine built around automatic prefix caching.

``from prefixcache import LLM, SamplingParams, RequestOutput, LoRARequest``. They are
imported lazily, so importing a torch-free part of the package (``prefixcache.core``, the
CLI's ``--help``) does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams"]

_NAME_TO_MODULE = {
    "LLM": "prefixcache.entrypoints.llm",
    "LoRARequest": "prefixcache.lora.request",
    "RequestOutput": "prefixcache.engine.outputs",
    "SamplingParams": "prefixcache.engine.sampling_params",
}

if TYPE_CHECKING:
    from prefixcache.engine.outputs import RequestOutput
    from prefixcache.engine.sampling_params import SamplingParams
    from prefixcache.entrypoints.llm import LLM
    from prefixcache.lora.request import LoRARequest


def __getattr__(name: str) -> Any:
    module_name = _NAME_TO_MODULE.get(name)
    if module_name is None:
        raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
