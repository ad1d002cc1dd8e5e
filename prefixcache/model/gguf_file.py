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


# GGUF 4-bit block types whose values map exactly onto group-wise int4 with a scale and a
# zero point per block of 32: Q4_0 (`w = d * (q - 8)`) and Q4_1 (`w = d * q + m`).
_Q4_BLOCK_BYTES = {
    gguf.GGMLQuantizationType.Q4_0: 18,  # fp16 d, 16 bytes of nibbles
    gguf.GGMLQuantizationType.Q4_1: 20,  # fp16 d, fp16 m, 16 bytes of nibbles
}
Q4_BLOCK_SIZE = 32


def is_q4_block_tensor(tensor: Any) -> bool:
    """Whether `read_q4_blocks` can read this GGUF tensor."""
    return tensor.tensor_type in _Q4_BLOCK_BYTES


def read_q4_blocks(tensor: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 or Q4_1 tensor's own 4-bit values, unchanged: (q, scale, zero) with
    `weight = (q - 8) * scale + zero` exactly.

    q is uint8 [rows, cols] in 0..15; scale and zero are float32 [rows, cols // 32], one per
    block of 32 consecutive values of a row (Q4_1: scale = d, zero = m + 8 d, computed in
    float32 from the fp16 d and m; Q4_0: scale = d, zero = 0).
    """
    block_bytes = _Q4_BLOCK_BYTES.get(tensor.tensor_type)
    if block_bytes is None:
        raise ValueError(f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, not Q4_0/Q4_1")
    rows, cols = (int(d) for d in reversed(tensor.shape))
    blocks = np.asarray(tensor.data).reshape(rows, cols // Q4_BLOCK_SIZE, block_bytes)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., block_bytes - 16 :]
    # Byte j of a block holds value j in its low nibble and value j + 16 in its high one.
    q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = minimum + 8 * scale
    else:
        zero = np.zeros_like(scale)
    return q, scale, zero
