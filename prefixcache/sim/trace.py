"""Request traces: the three line formats a replay reads, parsed into
:class:`TraceRequest` (and written back by :func:`format_line`).

Formats, one JSON value per line (blank lines are ignored; the format is decided per line):

Mooncake
    ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`` — each
    hash id names one 512-token block of the prompt (:data:`MOONCAKE_BLOCK_SIZE`, or the
    reader's ``mooncake_block_size``: tools that write this format for other block sizes
    exist); equal ids mean equal content. There must be ``ceil(input_length / 512)`` ids
    (of that size): the last one covers the trailing partial block, if any.
    ``output_length`` defaults to 0; ``timestamp`` may be left out (None: the request has
    no arrival time, which timeline replays need).
Bailian (Alibaba's public Qwen serving traces)
    ``{"chat_id": c, "parent_chat_id": p, "timestamp": s, "input_length": n,
    "output_length": m, "type": t, "turn": k, "hash_ids": [...]}`` — the Mooncake fields,
    told apart by ``chat_id``, with two differences: each hash id names a 16-token block
    (:data:`BAILIAN_BLOCK_SIZE`), so there are ``ceil(input_length / 16)`` of them, and
    ``timestamp`` is in seconds. The other fields describe sessions, which a replay finds
    from the shared blocks themselves: they are kept as they are, to be written back.
Token ids
    A JSON list of token ids, or ``{"prompt_token_ids": [...]}`` with optional
    ``timestamp`` (ms) and ``output_length`` — a user's own tokenized log.

A line that is not valid JSON (including JSON nested too deeply to parse) or does not match
a format raises :class:`TraceFormatError` naming the file and line, unless ``skip_bad_lines``
is set: then the line is skipped and counted in :attr:`Trace.num_bad_lines`.

A request's prompt and its output are each at most :data:`MAX_REQUEST_TOKENS` tokens
(2**24 = 16,777,216); a longer one is a bad line. A replay builds token lists and block
tables as long as a request, so without a bound one short line could ask for terabytes.

Files are UTF-8, with or without a byte-order mark, and lines may end in ``\n``,
``\r\n`` or ``\r``; a line that is not UTF-8 is a bad line. The path ``-`` stands for
standard input (named ``<stdin>`` in messages).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.core import cdiv

MOONCAKE_BLOCK_SIZE = 512
BAILIAN_BLOCK_SIZE = 16
STDIN_PATH = "-"
STDIN_NAME = "<stdin>"
# The longest prompt, and the longest output, of one request: far beyond any model's
# context today, yet small enough that one request's lists and block table fit in memory.
MAX_REQUEST_TOKENS = 1 << 24
_TOKEN_ID_BOUND = 1 << 63  # token ids are hashed as signed 64-bit integers
_UINT32_BOUND = 1 << 32


def printable_path(path: str | Path) -> str:
    """``path`` as text that can be printed, drawn or written to JSON: bytes of the name
    that are not UTF-8 (kept by Python as lone surrogates) become U+FFFD."""
    return os.fsencode(path).decode("utf-8", errors="replace")


class TraceFormatError(ValueError):
    """A trace cannot be read: the message names the file and, if any, the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Exactly one of ``hash_ids`` (ids of ``hash_block_size``-token blocks: 512 in the
    Mooncake format, 16 in the Bailian one) and ``token_ids`` (token-id format) is set; a
    parsed line's ``token_ids`` is an ``array`` of unsigned integers. ``timestamp_ms`` is
    None when the line had no timestamp. ``session_fields`` are a Bailian line's fields
    that a replay does not read (``chat_id``, ``parent_chat_id``, ``type``, ``turn``, any
    others), in their order, so that :func:`format_line` writes the line back whole; a
    Bailian line always has some (its ``chat_id``), any other none.
    """

    line_no: int
    input_length: int
    output_length: int
    timestamp_ms: float | None
    hash_ids: tuple[int, ...] | None = None
    token_ids: Sequence[int] | None = None
    hash_block_size: int = MOONCAKE_BLOCK_SIZE
    session_fields: tuple[tuple[str, Any], ...] = ()


@dataclass(slots=True)
class Trace:
    """The parsed requests of one file, in file order, and how many lines were skipped.
    ``path`` names the file for people (:func:`printable_path`, or ``<stdin>``)."""

    path: str
    requests: list[TraceRequest] = field(default_factory=list)
    num_bad_lines: int = 0
    first_bad_line: str | None = None

    @property
    def has_timestamps(self) -> bool:
        return all(request.timestamp_ms is not None for request in self.requests)

    def skipped_lines_note(self) -> str | None:
        """What a command says on stderr about the lines it skipped, or None if none."""
        if not self.num_bad_lines:
            return None
        return (f"skipped {self.num_bad_lines} malformed line(s) of {self.path}; first: "
                f"{self.first_bad_line}")


def _is_int(value) -> bool:
    return type(value) is int  # bool is an int subclass but never a valid length or id


def _check_num_tokens(key: str, value: int) -> None:
    if value > MAX_REQUEST_TOKENS:
        raise ValueError(f"{key!r} must be at most {MAX_REQUEST_TOKENS:,} tokens (the "
                         f"limit per request), got {_brief(value)}")


def _num_tokens(obj: dict, key: str, default: int | None = None) -> int:
    """A token count: a non-negative integer up to :data:`MAX_REQUEST_TOKENS`."""
    if key not in obj:
        if default is None:
            raise ValueError(f"missing field {key!r}")
        return default
    value = obj[key]
    if not _is_int(value) or value < 0:
        raise ValueError(f"{key!r} must be a non-negative integer, got {_brief(value)}")
    _check_num_tokens(key, value)
    return value


def _brief(value) -> str:
    """``value`` for an error message: an integer too long to print usefully (or at all:
    ``repr`` refuses past 4,300 digits) is named by its size."""
    if _is_int(value) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def _timestamp(obj: dict, unit: str = "ms", ms_per_unit: int = 1) -> float | None:
    """The line's timestamp in ms, read in ``unit`` (``ms_per_unit`` ms each)."""
    value = obj.get("timestamp")
    if value is None:
        return None
    if type(value) in (int, float):
        try:
            timestamp = float(value) * ms_per_unit
        except OverflowError:  # an integer beyond the largest float is not finite either
            timestamp = math.inf
        if 0 <= timestamp < math.inf:
            return timestamp
        if ms_per_unit > 1 and 0 <= value <= sys.float_info.max:  # finite, but not in ms
            raise ValueError(f"'timestamp' {_brief(value)} {unit} is too large: in ms it "
                             "is beyond the largest finite number")
    raise ValueError(f"'timestamp' must be a finite non-negative number of {unit}, "
                     f"got {_brief(value)}")


def _parse_token_ids(values, line_no: int, obj: dict | None) -> TraceRequest:
    """A token-id line: ``values`` are its ``prompt_token_ids`` (``obj``, the line's
    object), or the line itself, a bare list (``obj`` None)."""
    name = "a list of token ids" if obj is None else "'prompt_token_ids'"
    if not isinstance(values, list) or not values:
        raise ValueError(f"{name} must be a non-empty list of integers")
    if not all(_is_int(v) and 0 <= v < _TOKEN_ID_BOUND for v in values):
        raise ValueError(f"{name} must hold only non-negative integers below 2**63")
    _check_num_tokens("prompt_token_ids", len(values))
    output_length = 0 if obj is None else _num_tokens(obj, "output_length", 0)
    timestamp = None if obj is None else _timestamp(obj)
    # An array holds a token in 4 bytes (8 for ids past 32 bits): a tuple would hold a
    # pointer and, for most ids, a 28-byte int object.
    typecode = "I" if max(values) < _UINT32_BOUND else "Q"
    return TraceRequest(line_no, len(values), output_length, timestamp,
                        token_ids=array(typecode, values))


# The fields of a hash-id line that a replay reads; a Bailian line keeps its others.
_HASH_ID_LINE_FIELDS = frozenset(("timestamp", "input_length", "output_length", "hash_ids"))


def _parse_hash_ids(obj: dict, line_no: int, bailian: bool,
                    mooncake_block_size: int) -> TraceRequest:
    """A Mooncake line (ids of ``mooncake_block_size`` tokens), or with ``bailian`` a
    Bailian one (16-token ids, seconds)."""
    block_size = BAILIAN_BLOCK_SIZE if bailian else mooncake_block_size
    input_length = _num_tokens(obj, "input_length")
    if input_length < 1:
        raise ValueError("'input_length' must be at least 1")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise ValueError("'hash_ids' must be a list of non-negative integers")
    expected = cdiv(input_length, block_size)
    if len(hash_ids) != expected:
        # A Mooncake line may be a Bailian line that lost its chat_id, or name blocks of
        # another size: say which.
        if bailian:
            hint = ""
        elif (block_size != BAILIAN_BLOCK_SIZE
              and len(hash_ids) == cdiv(input_length, BAILIAN_BLOCK_SIZE)):
            hint = ("; a Bailian line (16-token blocks) has a 'chat_id', and a trace in "
                    "this format of 16-token ids needs --trace-block-size 16")
        else:
            hint = ("; if the trace's ids name blocks of another size, give that size "
                    "(--trace-block-size)")
        raise ValueError(
            f"{len(hash_ids)} hash_ids for input_length {input_length}: expected {expected} "
            f"(one per {block_size}-token block, the last one possibly partial){hint}"
        )
    output_length = _num_tokens(obj, "output_length", 0)
    if not bailian:
        return TraceRequest(line_no, input_length, output_length, _timestamp(obj),
                            hash_ids=tuple(hash_ids), hash_block_size=block_size)
    session_fields = tuple((key, value) for key, value in obj.items()
                           if key not in _HASH_ID_LINE_FIELDS)
    for key, value in session_fields:  # written back as they are: as JSON, then
        if not _is_standard_json(value):
            raise ValueError(f"{key!r} holds NaN or Infinity, which standard JSON cannot")
    return TraceRequest(line_no, input_length, output_length, _timestamp(obj, "s", 1000),
                        hash_ids=tuple(hash_ids), hash_block_size=block_size,
                        session_fields=session_fields)


def _is_standard_json(value) -> bool:
    """Whether ``value``, as read by ``json.loads``, holds no NaN or Infinity (which that
    reader accepts and standard JSON has not)."""
    if type(value) is float:
        return math.isfinite(value)
    if isinstance(value, list):
        return all(map(_is_standard_json, value))
    if isinstance(value, dict):
        return all(map(_is_standard_json, value.values()))
    return True


def parse_line(text: str, line_no: int,
               mooncake_block_size: int = MOONCAKE_BLOCK_SIZE) -> TraceRequest:
    """One non-blank line as a request, a Mooncake line's hash ids naming blocks of
    ``mooncake_block_size`` tokens. Raises ValueError saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        # The column on the line itself: the decoder counts its line end (still in
        # ``text``) as a line, and reports an error at the end of the text past it.
        end = len(text)
        while end and text[end - 1] in "\r\n":
            end -= 1
        raise ValueError(f"not valid JSON ({exc.msg} at column {min(exc.pos, end) + 1})"
                         ) from None
    except RecursionError:
        # The decoder recurses per level of nesting; no request is nested deeper than a
        # few levels, so such a line is malformed, not a reason to stop the replay.
        raise ValueError("not valid JSON (nested too deeply)") from None
    if isinstance(obj, list):
        if obj and isinstance(obj[0], dict):
            raise ValueError("a JSON array of requests: a trace holds one request per line "
                             "(JSON lines), not one array of them")
        return _parse_token_ids(obj, line_no, None)
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object or a list of token ids")
    if "hash_ids" in obj:
        return _parse_hash_ids(obj, line_no, "chat_id" in obj, mooncake_block_size)
    if "prompt_token_ids" in obj:
        return _parse_token_ids(obj["prompt_token_ids"], line_no, obj)
    raise ValueError("expected 'hash_ids' (Mooncake or Bailian format) or 'prompt_token_ids'")


_BYTE_ORDER_MARK = "\ufeff"


def load_trace(path: str | Path, skip_bad_lines: bool = False,
               max_requests: int | None = None,
               progress: Callable[[int], object] | None = None,
               mooncake_block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Parse a trace file, or standard input for ``-``; at most ``max_requests`` requests
    (all when None). ``progress``, if given, is called with the size of each line read
    (in bytes; in characters for a text stream without a byte buffer). Mooncake lines'
    hash ids name blocks of ``mooncake_block_size`` tokens.

    Raises :class:`TraceFormatError` for a missing or unreadable file (or a closed standard
    input), a bad line (unless ``skip_bad_lines``), or a trace with no requests.
    """
    if str(path) == STDIN_PATH:
        if sys.stdin is None:  # the process was started with file descriptor 0 closed
            raise TraceFormatError(f"{STDIN_NAME}: standard input is closed")
        # Its bytes, decoded here as UTF-8 whatever the locale says (a trace's encoding
        # does not depend on who pipes it in); a text stream without a byte buffer is
        # read as it is.
        return _read_trace(_counted(getattr(sys.stdin, "buffer", sys.stdin), progress),
                           STDIN_NAME, skip_bad_lines, max_requests, mooncake_block_size)
    path = Path(path)
    name = printable_path(path)
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise TraceFormatError(f"{name}: no such trace file") from None
    except OSError as exc:
        raise TraceFormatError(f"{name}: cannot open trace: {exc.strerror}") from None
    with handle:
        return _read_trace(_counted(handle, progress), name, skip_bad_lines, max_requests,
                           mooncake_block_size)


def trace_file_size(path: str | Path) -> int | None:
    """The size in bytes of the trace at ``path``, for a progress bar over reading it;
    None for standard input (``-``), for anything that is not a regular file, and for a
    path that cannot be looked at (:func:`load_trace` then says why)."""
    if str(path) == STDIN_PATH:
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def _counted(lines: Iterable[bytes | str],
             progress: Callable[[int], object] | None) -> Iterable[bytes | str]:
    """``lines``, reporting each one's size to ``progress`` as it is read."""
    if progress is None:
        return lines
    return _reporting(lines, progress)


def _reporting(lines: Iterable[bytes | str],
               progress: Callable[[int], object]) -> Iterator[bytes | str]:
    for line in lines:
        progress(len(line))
        yield line


def _decode(line: bytes | str, line_no: int) -> str:
    """One line as text: UTF-8, decoded line by line so that one bad line is a bad line,
    not the end of the trace; a byte-order mark (editors on Windows start UTF-8 files
    with one) is dropped from the first."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start + 1})") from None
    if line_no == 1 and line.startswith(_BYTE_ORDER_MARK):
        line = line[1:]
    return line


def _universal_lines(lines: Iterable[bytes | str]) -> Iterator[bytes | str]:
    """A binary file's lines end at ``\n``: split them at ``\r`` and ``\r\n`` as well, as
    text mode would, so that a trace saved with old Mac line ends still has lines. (Text
    is left alone: ``str.splitlines`` would also split at separators JSON allows inside
    strings.)"""
    for line in lines:
        if isinstance(line, bytes) and b"\r" in line:
            yield from line.splitlines()
        else:
            yield line


def _read_trace(lines: Iterable[bytes | str], path: str, skip_bad_lines: bool,
                max_requests: int | None, mooncake_block_size: int) -> Trace:
    trace = Trace(path)
    line_no = 0
    try:
        for line_no, line in enumerate(_universal_lines(lines), start=1):
            if max_requests is not None and len(trace.requests) >= max_requests:
                break
            if line_no == 1:
                _check_first_line(line, path)
            try:
                text = _decode(line, line_no)
                if text.strip():
                    trace.requests.append(parse_line(text, line_no, mooncake_block_size))
            except (ValueError, KeyError, TypeError) as exc:
                reason = f"{path}:{line_no}: {exc}"
                if not skip_bad_lines:
                    raise TraceFormatError(
                        f"{reason} (use --skip-bad-lines to skip such lines)"
                    ) from None
                trace.num_bad_lines += 1
                if trace.first_bad_line is None:
                    trace.first_bad_line = reason
    except OSError as exc:  # opened, but reading failed (an I/O error, /proc/self/mem)
        raise TraceFormatError(f"{path}: cannot read trace after line {line_no}: "
                               f"{exc.strerror or exc}") from None
    if not trace.requests:
        skipped = (f" ({trace.num_bad_lines} malformed line(s) skipped; first: "
                   f"{trace.first_bad_line})" if trace.num_bad_lines else "")
        raise TraceFormatError(f"{path}: no requests in the trace{skipped}")
    return trace


# How compressed files begin, and the command that decompresses each to stdout.
_COMPRESSED_STARTS = ((b"\x1f\x8b", "gzip", "gzip -dc"),
                      (b"\x28\xb5\x2f\xfd", "zstd", "zstd -dc"),
                      (b"\xfd7zXZ\x00", "xz", "xz -dc"),
                      (b"BZh", "bzip2", "bzip2 -dc"),
                      (b"PK\x03\x04", "zip", "unzip -p"))


# How a file holding one JSON array of requests begins: its first request's object, on
# the first line (``json.dump``) or the next (``json.dump(..., indent=...)``).
_ARRAY_OF_OBJECTS_START = re.compile(r"\[\s*(\{|$)")
_FIRST_LINE_HEAD = 256


def _check_first_line(first_line: bytes | str, path: str) -> None:
    """A :class:`TraceFormatError` for a file that is no trace as a whole (not a bad line
    to skip: every line would be): compressed (saying how to decompress it), or one JSON
    array of requests rather than one request per line."""
    # Its start is enough (a token-id line can be hundreds of megabytes: not copied whole).
    head = first_line[:_FIRST_LINE_HEAD]
    if isinstance(head, bytes):
        for start, kind, command in _COMPRESSED_STARTS:
            if head.startswith(start):
                raise TraceFormatError(f"{path}: the file is {kind}-compressed: decompress "
                                       f"it first ({command} FILE > FILE.jsonl)")
        head = head.decode("utf-8", "replace")
    if _ARRAY_OF_OBJECTS_START.match(head.lstrip(_BYTE_ORDER_MARK).strip()):
        raise TraceFormatError(f"{path}: the file is one JSON array of requests; a trace "
                               "holds one request per line (JSON lines): convert it, e.g. "
                               "jq -c '.[]' FILE > FILE.jsonl")


def format_line(request: TraceRequest) -> str:
    """``request`` as one line of its format (no line end), which :func:`parse_line`
    reads back as an equal request (but for ``line_no``, and a Bailian timestamp, written
    in seconds, to within rounding). A timestamp that is a whole number of its unit is
    written as an integer; a request without one is written without. A Bailian request
    (one with session fields) is written with them first. A Mooncake request's ids are
    written as they are, whatever size of block they name: reading them back takes the
    same ``mooncake_block_size``."""
    bailian = request.hash_ids is not None and bool(request.session_fields)
    obj: dict = dict(request.session_fields) if bailian else {}
    if request.timestamp_ms is not None:
        timestamp = float(request.timestamp_ms) / (1000 if bailian else 1)
        obj["timestamp"] = int(timestamp) if timestamp.is_integer() else timestamp
    if request.hash_ids is not None:
        obj.update(input_length=request.input_length, output_length=request.output_length,
                   hash_ids=list(request.hash_ids))
    else:
        obj.update(prompt_token_ids=list(request.token_ids),
                   output_length=request.output_length)
    return json.dumps(obj)
