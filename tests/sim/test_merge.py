"""Merging traces (`prefixcache merge`): order of arrival, hash ids kept apart, the
command's files and errors."""

from __future__ import annotations

import json
import sys

import pytest

from prefixcache.entrypoints.cli import main
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.merge import merge_traces
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig, replay
from prefixcache.sim.trace import Trace, TraceRequest, format_line, load_trace, parse_line
from tests.sim.helpers import random_mooncake_trace, write_lines


def _mooncake(line_no: int, timestamp: float | None, hash_ids: tuple[int, ...]):
    return TraceRequest(line_no, 512 * len(hash_ids), 3, timestamp, hash_ids=hash_ids)


def _infinite_cache_hits(trace: Trace) -> int:
    prepared = prepare_trace(trace, TraceExpander(512))
    return replay(prepared, ReplayConfig(num_blocks=10**6)).num_hit_tokens


def _in_order_of_arrival(trace: Trace) -> Trace:
    """``trace`` with its requests sorted by timestamp, as merging leaves them."""
    return Trace(trace.path, sorted(trace.requests, key=lambda r: r.timestamp_ms))


def test_requests_are_merged_by_timestamp_with_ties_in_the_order_given():
    first = Trace("a", [_mooncake(1, 10.0, (0,)), _mooncake(2, 30.0, (1,))])
    second = Trace("b", [_mooncake(1, 30.0, (0,)), _mooncake(2, 10.0, (5,)),
                         _mooncake(3, 20.0, (2,))])
    merged = merge_traces([first, second])
    assert [(r.line_no, r.timestamp_ms, r.hash_ids) for r in merged] == [
        (1, 10.0, (0,)),  # a's first, then b's request at the same time
        (2, 10.0, (7,)),  # b's ids are moved past a's largest (1): 5 -> 7
        (3, 20.0, (4,)),
        (4, 30.0, (1,)),
        (5, 30.0, (2,)),
    ]


def test_shared_hash_ids_and_token_ids_are_kept_as_they_are():
    mooncake = Trace("a", [_mooncake(1, 0.0, (0, 1))])
    tokens = Trace("b", [TraceRequest(1, 3, 0, 5.0, token_ids=[7, 8, 9])])
    again = Trace("c", [_mooncake(1, 9.0, (0, 1))])
    kept = merge_traces([mooncake, tokens, again], shared_ids=True)
    assert [r.hash_ids for r in kept] == [(0, 1), None, (0, 1)]
    moved = merge_traces([mooncake, tokens, again])
    assert [r.hash_ids for r in moved] == [(0, 1), None, (2, 3)]
    assert list(moved[1].token_ids) == [7, 8, 9]


def test_no_block_is_shared_across_traces_unless_asked():
    """With an infinite cache, merged traces hit exactly as often as each alone; two
    copies of one trace with shared ids hit again on everything the copy repeats."""
    one, two = (_in_order_of_arrival(random_mooncake_trace(seed)) for seed in (1, 2))
    alone = _infinite_cache_hits(one) + _infinite_cache_hits(two)
    assert _infinite_cache_hits(Trace("m", merge_traces([one, two]))) == alone
    # random_mooncake_trace numbers both traces' ids from 0: kept, they collide.
    assert _infinite_cache_hits(Trace("m", merge_traces([one, two], shared_ids=True))) != alone
    copies = merge_traces([one, one], shared_ids=True)
    assert _infinite_cache_hits(Trace("m", copies)) > 2 * _infinite_cache_hits(one)


def test_align_starts_and_max_requests():
    late = Trace("a", [_mooncake(1, 1000.0, (0,)), _mooncake(2, 1500.0, (1,))])
    early = Trace("b", [_mooncake(1, 40.0, (0,)), _mooncake(2, 20.0, (1,))])
    aligned = merge_traces([late, early], align_starts=True, max_requests=3)
    assert [(r.timestamp_ms, r.hash_ids) for r in aligned] == [
        (0.0, (0,)), (0.0, (3,)), (20.0, (2,))]
    assert [r.line_no for r in aligned] == [1, 2, 3]


def test_a_request_without_timestamp_is_named():
    untimed = Trace("b.jsonl", [_mooncake(1, 0.0, (0,)), _mooncake(2, None, (1,))])
    with pytest.raises(ValueError, match=r"b\.jsonl:2: the request has no 'timestamp'"):
        merge_traces([Trace("a", [_mooncake(1, 0.0, (0,))]), untimed])


def test_ids_as_large_as_64_bits_are_merged_until_moving_them_would_pass_2_to_the_64():
    largest = 2**64 - 1  # a hash's external 64-bit form can be this
    top = Trace("top.jsonl", [_mooncake(1, 0.0, (largest,))])
    low = Trace("low.jsonl", [_mooncake(1, 1.0, (0, 1))])
    (alone,) = merge_traces([top])  # the first trace's ids stay as they are
    assert parse_line(format_line(alone), 1).hash_ids == (largest,)
    assert [r.hash_ids for r in merge_traces([low, low])] == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match=r"top\.jsonl: its ids, moved past the earlier "
                                         r"traces', would reach 2\*\*64 or more"):
        merge_traces([low, top])
    with pytest.raises(ValueError, match=r"low\.jsonl: its ids"):
        merge_traces([top, low])
    assert [r.hash_ids for r in merge_traces([low, top], shared_ids=True)] == [
        (largest,), (0, 1)]
    chats = Trace("chats.jsonl", [TraceRequest(1, 16, 0, 0.0, hash_ids=(1,), hash_block_size=16,
                                               session_fields=(("chat_id", largest),))])
    with pytest.raises(ValueError, match=r"chats\.jsonl: its ids"):
        merge_traces([chats, chats])
    # A trace may name larger ids (a replay takes them), but a merge does not write them.
    huge = parse_line(json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [2**70]}), 1)
    assert huge.hash_ids == (2**70,)
    with pytest.raises(ValueError, match=r"huge\.jsonl: it names ids of 2\*\*64 or more"):
        merge_traces([Trace("huge.jsonl", [huge])], shared_ids=True)


@pytest.mark.parametrize("request_", [
    _mooncake(4, 12.0, (3, 4)),
    TraceRequest(4, 700, 0, 0.25, hash_ids=(1, 2)),
    TraceRequest(4, 3, 9, None, hash_ids=(1,)),
    TraceRequest(4, 3, 2, 7.0, token_ids=[1, 2, 2**40]),
])
def test_a_formatted_line_reads_back_as_the_same_request(request_):
    line = format_line(request_)
    parsed = parse_line(line, 4)
    assert (parsed.input_length, parsed.output_length, parsed.timestamp_ms,
            parsed.hash_ids) == (request_.input_length, request_.output_length,
                                 request_.timestamp_ms, request_.hash_ids)
    assert (None if parsed.token_ids is None else list(parsed.token_ids)) == (
        None if request_.token_ids is None else list(request_.token_ids))
    if request_.timestamp_ms == 12.0:
        assert '"timestamp": 12,' in line  # a whole number of ms stays an integer


def _synth(tmp_path, family: str, seed: int, num_requests: int):
    path = tmp_path / f"{family}.jsonl"
    assert main(["synth", family, "--seed", str(seed), "--num-requests", str(num_requests),
                 "-o", str(path)]) == 0
    return path


def test_merge_command_writes_a_trace_the_replayer_reads(tmp_path, capsys):
    chat, rag = _synth(tmp_path, "chat", 1, 60), _synth(tmp_path, "rag", 2, 40)
    out = tmp_path / "merged.jsonl"
    assert main(["merge", str(chat), str(rag), "--max-requests", "90", "-o", str(out)]) == 0
    assert capsys.readouterr().err.endswith(
        f"merged 90 requests from 2 traces into {out}\n")
    merged = load_trace(out)
    expected = merge_traces([load_trace(chat), load_trace(rag)], max_requests=90)
    assert [format_line(r) for r in merged.requests] == [format_line(r) for r in expected]
    times = [r.timestamp_ms for r in merged.requests]
    assert times == sorted(times)
    assert main(["replay", str(out), "--block-size", "512", "--num-blocks", "400",
                 "--quiet"]) == 0


def test_merge_to_standard_output_and_over_one_of_its_traces(tmp_path, capsys):
    chat, rag = _synth(tmp_path, "chat", 1, 20), _synth(tmp_path, "rag", 2, 20)
    capsys.readouterr()
    assert main(["merge", str(chat), str(rag)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 40 and all("hash_ids" in json.loads(line) for line in lines)
    assert captured.err == "merged 40 requests from 2 traces into -\n"
    # The traces are read whole before anything is written, so -o may name one of them.
    assert main(["merge", str(chat), str(rag), "-o", str(chat)]) == 0
    assert chat.read_text().splitlines() == lines


def test_merge_command_errors_are_one_line(tmp_path, capsys):
    good = write_lines(tmp_path / "good.jsonl", [
        {"timestamp": 0, "input_length": 10, "hash_ids": [0]}])
    untimed = write_lines(tmp_path / "untimed.jsonl", [[1, 2, 3]])
    bad = write_lines(tmp_path / "bad.jsonl", [
        "not json", {"timestamp": 5, "input_length": 10, "hash_ids": [0]}])
    missing = tmp_path / "missing.jsonl"
    for argv, message in [
        ([str(good), str(missing)], f"{missing}: no such trace file"),
        ([str(good), str(untimed)], f"{untimed}:1: the request has no 'timestamp'"),
        ([str(bad)], f"{bad}:1: not valid JSON"),
        ([str(good), "-o", str(tmp_path / "no" / "dir.jsonl")], "cannot write"),
    ]:
        assert main(["merge", *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("prefixcache merge: error: ") and message in err
        assert err.count("\n") == 1
    assert main(["merge", str(bad), str(good), "--skip-bad-lines"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2
    assert f"skipped 1 malformed line(s) of {bad}; first: {bad}:1" in captured.err
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", "-", "-"])
    assert exit_info.value.code == 2
    assert "standard input (-) can be read as one trace only" in capsys.readouterr().err


@pytest.mark.parametrize("tty,quiet,shown", [(True, False, True), (True, True, False),
                                             (False, False, False)])
def test_merge_shows_progress_only_on_a_terminal(tmp_path, capsys, monkeypatch, tty, quiet,
                                                 shown):
    chat, rag = _synth(tmp_path, "chat", 1, 30), _synth(tmp_path, "rag", 2, 30)
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    out = tmp_path / "merged.jsonl"
    assert main(["merge", str(chat), str(rag), "-o", str(out),
                 *(["--quiet"] if quiet else [])]) == 0
    err = capsys.readouterr().err
    assert ("reading" in err and "writing" in err and "60/60" in err) == shown
    assert err.endswith(f"merged 60 requests from 2 traces into {out}\n")
