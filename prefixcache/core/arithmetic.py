"""Integer arithmetic shared by every layer that counts blocks."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for ``b > 0``: the blocks of ``b`` slots that hold ``a``
    tokens."""
    return -(-a // b)
