"""Reading traces: both formats, malformed lines, missing files."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

from prefixcache.sim.trace import MAX_REQUEST_TOKENS, TraceFormatError, load_trace, parse_line
from tests.data_paths import MOONCAKE_TRACE_PATH
from tests.sim.helpers import trace_prefix, write_lines


def test_vendored_trace_parses_as_mooncake():
    trace = trace_prefix(50)
    assert len(trace.requests) == 50
    first = trace.requests[0]
    assert (first.line_no, first.input_length, first.output_length) == (1, 40160, 6)
    assert first.hash_ids[:3] == (0, 1, 2) and len(first.hash_ids) == 79
    assert first.token_ids is None and first.timestamp_ms == 0.0
    assert trace.has_timestamps and trace.num_bad_lines == 0


def test_whole_vendored_trace_is_well_formed():
    trace = load_trace(MOONCAKE_TRACE_PATH)
    assert len(trace.requests) == 3993
    assert trace.num_bad_lines == 0


def test_token_id_formats(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        [1, 2, 3],
        "",
        {"prompt_token_ids": [4, 5], "timestamp": 7, "output_length": 3},
        {"prompt_token_ids": [6]},
    ])
    trace = load_trace(path)
    assert [list(r.token_ids) for r in trace.requests] == [[1, 2, 3], [4, 5], [6]]
    assert [r.line_no for r in trace.requests] == [1, 3, 4]
    assert [r.input_length for r in trace.requests] == [3, 2, 1]
    assert [r.output_length for r in trace.requests] == [0, 3, 0]
    assert [r.timestamp_ms for r in trace.requests] == [None, 7.0, None]
    assert not trace.has_timestamps


@pytest.mark.parametrize("text,reason", [
    ("{not json", "not valid JSON"),
    ('"a string"', "expected a JSON object"),
    ("[]", "non-empty list"),
    ('[1, "2"]', "non-negative integers"),
    ("[1, -2]", "non-negative integers"),
    ('{"foo": 1}', r"'hash_ids' \(Mooncake or Bailian format\) or 'prompt_token_ids'"),
    ('{"chat_id": 1, "input_length": 3}', r"'hash_ids' \(Mooncake or Bailian format\)"),
    ('{"hash_ids": [1]}', "missing field 'input_length'"),
    ('{"input_length": 600, "hash_ids": [1]}', "expected 2"),
    ('{"input_length": 0, "hash_ids": []}', "at least 1"),
    ('{"input_length": 10, "hash_ids": ["x"]}', "'hash_ids' must be"),
    ('{"input_length": 10, "hash_ids": [1], "timestamp": -1}', "'timestamp'"),
    ('{"input_length": 10, "hash_ids": [1], "timestamp": NaN}', "finite"),
    ('{"input_length": 10, "hash_ids": [1], "timestamp": Infinity}', "finite"),
    (f"[1, {2**63}]", "below 2\\*\\*63"),
    ('{"input_length": 10, "hash_ids": [1], "output_length": 1.5}', "'output_length'"),
    ('{"input_length": true, "hash_ids": [1]}', "'input_length'"),
    ('{"input_length": 16777217, "hash_ids": [1]}',
     "'input_length' must be at most 16,777,216 tokens"),
    ('{"input_length": 10, "hash_ids": [1], "output_length": 16777217}',
     "'output_length' must be at most 16,777,216 tokens"),
    (f'{{"input_length": 10, "hash_ids": [1], "output_length": {10**30}}}',
     "'output_length' must be at most .* got an integer of 100 bits"),
    (f'{{"prompt_token_ids": [1], "output_length": {10**12}}}',
     "'output_length' must be at most 16,777,216 tokens"),
    ('{"chat_id": 1, "input_length": 10, "hash_ids": [1], "timestamp": 1e306}',
     "'timestamp' 1e\\+306 s is too large: in ms"),
    ('[{"input_length": 10, "hash_ids": [1]}, {"input_length": 10, "hash_ids": [2]}]',
     "a JSON array of requests: a trace holds one request per line"),
    ('[1, {"x": 2}]', "a list of token ids must hold only"),
    ('{"chat_id": 1, "turn": NaN, "input_length": 10, "hash_ids": [1]}',
     "'turn' holds NaN or Infinity, which standard JSON cannot"),
    ('{"chat_id": 1, "meta": {"a": [1, -Infinity]}, "input_length": 10, "hash_ids": [1]}',
     "'meta' holds NaN or Infinity"),
    ('{"prompt_token_ids": [1, "x"]}', "'prompt_token_ids' must hold only"),
])
def test_bad_line_reasons(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_line(text, 1)


def test_bad_line_error_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [[1, 2], [3], "{oops", [4]])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:3: not valid JSON") as info:
        load_trace(path)
    assert "--skip-bad-lines" in str(info.value)


def test_skip_bad_lines_counts_them(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [[1, 2], "{oops", '{"x": 1}', [4]])
    trace = load_trace(path, skip_bad_lines=True)
    assert [list(r.token_ids) for r in trace.requests] == [[1, 2], [4]]
    assert trace.num_bad_lines == 2
    assert trace.first_bad_line.endswith("t.jsonl:2: not valid JSON (Expecting property name "
                                         "enclosed in double quotes at column 2)")


def test_a_json_error_names_the_column_on_the_line(tmp_path):
    line = '{"input_length": 512, "hash_ids": [1]'  # the closing brace is missing
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceFormatError, match=f"at column {len(line) + 1}\\)"):
        load_trace(path)


@pytest.mark.parametrize("start,kind,command", [
    (b"\x1f\x8b\x08\x00", "gzip", "gzip -dc"), (b"\x28\xb5\x2f\xfd\x00", "zstd", "zstd -dc"),
    (b"\xfd7zXZ\x00\x00", "xz", "xz -dc"), (b"BZh91AY", "bzip2", "bzip2 -dc"),
    (b"PK\x03\x04\x14", "zip", "unzip -p")])
def test_a_compressed_trace_says_how_to_decompress_it(tmp_path, start, kind, command):
    path = tmp_path / "t.jsonl.x"
    path.write_bytes(start + b"\x00\xff garbage\n{}\n")
    # Not a bad line to skip: every line of such a file would be one.
    with pytest.raises(TraceFormatError, match=f"t\\.jsonl\\.x: the file is {kind}-compressed: "
                                               f"decompress it first \\({command} FILE"):
        load_trace(path, skip_bad_lines=True)


@pytest.mark.parametrize("indent", [None, 2])
def test_a_trace_saved_as_one_json_array_says_how_to_convert_it(tmp_path, indent):
    requests = [{"input_length": 10, "hash_ids": [1]}, {"input_length": 10, "hash_ids": [2]}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(requests, indent=indent) + "\n")
    # Not a bad line to skip: every line of the file would be one.
    with pytest.raises(TraceFormatError, match=r"t\.json: the file is one JSON array of "
                                               r"requests; .* jq -c '\.\[\]' FILE"):
        load_trace(path, skip_bad_lines=True)
    path.write_text("".join(json.dumps(request) + "\n" for request in requests))
    assert len(load_trace(path).requests) == 2


def test_a_real_gzip_file_of_a_trace_is_named_compressed(tmp_path):
    import gzip
    with MOONCAKE_TRACE_PATH.open() as source:
        text = "".join(next(source) for _ in range(3))
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(text.encode()))
    with pytest.raises(TraceFormatError, match="gzip-compressed"):
        load_trace(path)


def test_missing_empty_and_binary_files(tmp_path):
    with pytest.raises(TraceFormatError, match="no such trace file"):
        load_trace(tmp_path / "absent.jsonl")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(write_lines(tmp_path / "empty.jsonl", ["", ""]))
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(write_lines(tmp_path / "bad.jsonl", ["{oops"]), skip_bad_lines=True)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(TraceFormatError, match=r"bin\.jsonl:1: not UTF-8 text \(invalid start "
                                               r"byte at byte 1\)"):
        load_trace(binary)


def test_max_requests(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [[1], [2], [3]])
    assert [list(r.token_ids) for r in load_trace(path, max_requests=2).requests] == [[1], [2]]


def test_a_line_nested_too_deeply_is_a_bad_line(tmp_path):
    deep = "[" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_line(deep, 1)
    path = write_lines(tmp_path / "t.jsonl", [[1, 2], deep, [3]])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: not valid JSON"):
        load_trace(path)
    trace = load_trace(path, skip_bad_lines=True)
    assert [list(r.token_ids) for r in trace.requests] == [[1, 2], [3]]
    assert trace.num_bad_lines == 1


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf[1, 2]\n[3]\n")
    assert [list(r.token_ids) for r in load_trace(path).requests] == [[1, 2], [3]]


def test_dash_reads_standard_input_as_utf8(monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbf[1, 2]\n{oops\n[3]\n"),
                             encoding="latin-1")  # the locale's choice must not matter
    monkeypatch.setattr(sys, "stdin", stdin)
    trace = load_trace("-", skip_bad_lines=True)
    assert [list(r.token_ids) for r in trace.requests] == [[1, 2], [3]]
    assert trace.path == "<stdin>" and trace.first_bad_line.startswith("<stdin>:2: ")
    assert not stdin.buffer.closed  # sys.stdin is still usable afterwards


@pytest.mark.parametrize("line", [
    {"input_length": 10, "hash_ids": [1], "timestamp": 10**400},
    {"prompt_token_ids": [1, 2], "timestamp": 10**400},
])
def test_a_timestamp_beyond_any_float_is_a_bad_line(tmp_path, line):
    path = write_lines(tmp_path / "t.jsonl", [line, [3]])
    with pytest.raises(TraceFormatError,
                       match=r"t\.jsonl:1: 'timestamp' must be a finite .* 1329 bits"):
        load_trace(path)
    trace = load_trace(path, skip_bad_lines=True)
    assert [list(r.token_ids) for r in trace.requests] == [[3]] and trace.num_bad_lines == 1


def test_a_request_at_the_token_limit_is_accepted():
    n = MAX_REQUEST_TOKENS
    request = parse_line(json.dumps({"input_length": n, "output_length": n,
                                     "hash_ids": list(range(n // 512))}), 1)
    assert (request.input_length, request.output_length) == (2**24, 2**24)


def test_a_line_that_is_not_utf8_is_a_bad_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"[1, 2]\n[3, \"\xe9\"]\n[4]\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: not UTF-8 text"):
        load_trace(path)
    trace = load_trace(path, skip_bad_lines=True)
    assert [list(r.token_ids) for r in trace.requests] == [[1, 2], [4]]
    assert trace.num_bad_lines == 1 and "t.jsonl:2: not UTF-8" in trace.first_bad_line


def test_a_trace_of_only_bad_lines_says_how_many_were_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xff\n{oops\n\n")
    with pytest.raises(TraceFormatError, match=r"no requests in the trace \(2 malformed line"
                                               r"\(s\) skipped; first: .*t\.jsonl:1: not UTF-8"):
        load_trace(path, skip_bad_lines=True)


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux's /proc")
def test_a_file_that_opens_but_cannot_be_read_is_an_error():
    with pytest.raises(TraceFormatError, match="/proc/self/mem: cannot read trace after "
                                               "line 0: Input/output error"):
        load_trace("/proc/self/mem")


def test_a_closed_standard_input_is_an_error(monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)  # what Python sets when fd 0 is closed
    with pytest.raises(TraceFormatError, match="<stdin>: standard input is closed"):
        load_trace("-")


@pytest.mark.parametrize("line_end", [b"\n", b"\r\n", b"\r"])
def test_lines_may_end_as_on_any_system(tmp_path, line_end):
    lines = [b'{"input_length": 8, "hash_ids": [1]}', b"",
             b'{"input_length": 8, "hash_ids": [2]}', b'{"input_length": 8']
    path = tmp_path / "t.jsonl"
    path.write_bytes(line_end.join(lines) + line_end)
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:4: "):  # numbered as written
        load_trace(path)
    trace = load_trace(path, skip_bad_lines=True)
    assert [r.hash_ids for r in trace.requests] == [(1,), (2,)]
    assert trace.num_bad_lines == 1


def test_progress_is_told_every_byte_read(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'[1, 2]\n\n{"input_length": 8, "hash_ids": [1]}\r\n[3]')
    sizes = []
    assert len(load_trace(path, progress=sizes.append).requests) == 3
    assert sum(sizes) == path.stat().st_size and len(sizes) == 4
