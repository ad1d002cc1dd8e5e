"""argparse ``type=`` converters shared by the subcommands and the declared options
(:mod:`prefixcache.engine.arg_utils`); standard library only, so any layer may use them.

Each raises ``argparse.ArgumentTypeError`` with a message naming the bad value, which
argparse turns into a usage error (exit code 2, no traceback).
"""

from __future__ import annotations

import argparse
import re

_SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
               "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def float_at_least(low: float):
    """A converter for a finite number >= ``low``."""
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low:g}, got {text}")
        return value
    return convert


def _shown(text: str) -> str:
    """``text`` as an error message shows it: whole up to 40 characters, else its start
    and its length (a message must not repeat a 5,000-character argument)."""
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text):,} characters)"


def int_in_range(low: int, high: int):
    """A converter for an integer in ``low .. high`` (both included)."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {_shown(text)!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low:,} to {high:,}, got "
                                             f"{_shown(text)}")
        return value
    return convert


def name_list(text: str) -> list[str]:
    """Comma-separated names as every command reads them: spaces around each stripped,
    empty ones ignored, repeats dropped (a policy named twice would be run twice and
    reported once), in order."""
    return list(dict.fromkeys(name for name in (part.strip() for part in text.split(","))
                              if name))


def utf8_text(text: str) -> str:
    """Text that is valid UTF-8. Python hands undecodable argv bytes over as lone
    surrogates (``surrogateescape``), which no tokenizer or JSON encoder accepts; the
    message shows the offending bytes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text: {raw!r}") from None
    return text


def file_path(text: str) -> str:
    """A file name, ``-`` for a standard stream where the option allows it: not empty
    (an empty name would be reported as the current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("empty file name")
    return text


def port(text: str) -> int:
    """A TCP port, 0 (pick a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535: {text!r}")
    return value


def byte_size(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5G"``, ``"1000000"`` -> a positive number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    number, unit = match.groups()
    value = int(float(number) * _SIZE_UNITS[(unit or "").lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def size_text(num_bytes: int) -> str:
    """``num_bytes`` as the largest binary unit that divides it (``2GiB``), as
    :func:`byte_size` reads it back."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)
