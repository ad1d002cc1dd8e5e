"""Reading GGUF files: metadata as Python values, tensors as float32 numpy arrays.

Thin helpers over `gguf.GGUFReader` shared by the model loader and the tokenizer (which needs
no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import dequantize


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader` for `path`; FileNotFoundError naming the path if it is absent."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return gguf.GGUFReader(str(path))


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value metadata of a GGUF reader as Python values (str, int, float, bool,
    lists of those)."""
    return {name: _field_value(field) for name, field in reader.fields.items()}


def _field_value(field: Any) -> Any:
    value_type = field.types[0] if field.types else None
    # `field.data` indexes the parts that hold values; strings are raw utf-8 byte arrays.
    if value_type == gguf.GGUFValueType.ARRAY:
        item_type = field.types[-1]
        if item_type == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if value_type == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """float32 array of a GGUF tensor in its logical (row-major, PyTorch) shape."""
    # GGUF lists dimensions fastest-first; PyTorch wants them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # A plain ndarray view: per-row slicing of a np.memmap subclass is needlessly slow.
    raw = np.asarray(tensor.data)
    values = np.asarray(dequantize(raw, tensor.tensor_type), dtype=np.float32)
    if not values.flags.writeable:
        values = values.copy()  # unquantized tensors come back as views of the read-only map
    return values.reshape(shape)
