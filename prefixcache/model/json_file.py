"""The JSON files of a Hugging Face model folder (``config.json``, ``tokenizer_config.json``,
``model.safetensors.index.json``): each must hold one JSON object.

A broken file is reported naming it: ``json``'s own messages (``Expecting ',' delimiter:
line 2 column 1``) say neither which file nor what it should be, and a file holding a list
would otherwise fail later as ``'list' object has no attribute 'get'``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises ValueError naming ``path`` if it is not UTF-8, not valid JSON, or valid JSON
    but not an object; OSError (FileNotFoundError, ...) as opening it raises it.
    """
    try:
        with path.open(encoding="utf-8") as f:
            value = json.load(f)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start} cannot be "
                         "decoded)") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {_json_kind(value)}")
    return value


def _json_kind(value: Any) -> str:
    # In JSON's words: a list is an array, a dict an object.
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):  # before int: True is an int
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "null"
