"""Adapters named on the command line (torch-free): ``serve --lora-modules`` and
``generate --lora`` take ``name=path``, or vLLM's JSON form
``{"name": ..., "path": ..., "base_model_name": ...}``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from prefixcache.lora.request import LoRARequest


def lora_module(text: str) -> LoRARequest:
    """argparse ``type=``: ``name=path`` or a JSON object, as a :class:`LoRARequest` with
    a placeholder ``lora_int_id`` of 1 (:func:`number_lora_modules` numbers them). A
    malformed value is a usage error naming it."""
    name, path, base_model_name = None, None, None
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
        if not isinstance(spec, dict):
            raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
        name, path = spec.get("name"), spec.get("path")
        base_model_name = spec.get("base_model_name")
    elif "=" in text:
        name, path = text.split("=", 1)
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(
            f"expected NAME=PATH or a JSON object with name and path, got {text!r}")
    if base_model_name is not None and not isinstance(base_model_name, str):
        raise argparse.ArgumentTypeError(f"base_model_name must be a string in {text!r}")
    return LoRARequest(name, 1, path, base_model_name)


def number_lora_modules(modules: Sequence[LoRARequest]) -> list[LoRARequest]:
    """The adapters of the command line with ids 1, 2, ... in order. Raises ValueError for
    a name given twice."""
    numbered, seen = [], set()
    for lora_int_id, module in enumerate(modules, start=1):
        if module.lora_name in seen:
            raise ValueError(f"LoRA adapter name {module.lora_name!r} is given twice")
        seen.add(module.lora_name)
        numbered.append(LoRARequest(module.lora_name, lora_int_id, module.lora_path,
                                    module.base_model_name))
    return numbered
