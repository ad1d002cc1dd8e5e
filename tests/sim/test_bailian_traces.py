"""Alibaba's Bailian trace format (16-token hash ids, timestamps in seconds): read, expanded
to the manager's hashes at block sizes below and above 16, replayed, written back, merged."""

from __future__ import annotations

import json
import random

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.entrypoints.cli import main
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.merge import merge_traces
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig, replay
from prefixcache.sim.trace import (
    BAILIAN_BLOCK_SIZE,
    MOONCAKE_BLOCK_SIZE,
    Trace,
    TraceRequest,
    format_line,
    load_trace,
    parse_line,
)
from tests.sim.helpers import mooncake_as_bailian, trace_prefix, write_lines


def bailian_line(chat_id: int, parent: int, seconds: float, input_length: int,
                 hash_ids: list[int], output_length: int = 20, turn: int = 1) -> dict:
    return {"chat_id": chat_id, "parent_chat_id": parent, "timestamp": seconds,
            "input_length": input_length, "output_length": output_length, "type": "text",
            "turn": turn, "hash_ids": hash_ids}


def random_bailian_lines(seed: int, num_requests: int = 80) -> list[dict]:
    """Sessions whose turns extend the previous turn's full blocks, under a few shared
    system prompts; each prompt's last block is partial, so its id is the request's own."""
    rng = random.Random(seed)
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    system_prompts = [new_ids(rng.randint(1, 6)) for _ in range(3)]
    sessions: list[tuple[int, list[int], int]] = []  # (chat id, full-block ids, turn)
    lines = []
    for chat_id in range(num_requests):
        if sessions and rng.random() < 0.6:
            index = rng.randrange(len(sessions))
            parent, full, turn = sessions[index]
            full = full + new_ids(rng.randint(0, 5))
        else:
            index, parent, turn = None, -1, 0
            full = rng.choice(system_prompts) + new_ids(rng.randint(0, 8))
        partial = rng.randint(1, BAILIAN_BLOCK_SIZE - 1)
        lines.append(bailian_line(chat_id, parent, 0.25 * chat_id,
                                  BAILIAN_BLOCK_SIZE * len(full) + partial,
                                  full + new_ids(1), rng.randint(0, 40), turn + 1))
        session = (chat_id, full, turn + 1)
        if index is None:
            sessions.append(session)
        else:
            sessions[index] = session
    return lines


def test_a_bailian_line_is_read_in_its_own_units():
    request = parse_line(json.dumps(bailian_line(159, -1, 61.114, 40, [7, 8, 9], 132)), 4)
    assert request.hash_block_size == BAILIAN_BLOCK_SIZE
    assert request.hash_ids == (7, 8, 9) and request.input_length == 40
    assert request.output_length == 132 and request.line_no == 4
    assert request.timestamp_ms == pytest.approx(61_114.0)
    # The same fields without a chat_id are a Mooncake line: 512-token ids, ms.
    mooncake = parse_line('{"timestamp": 61, "input_length": 40, "hash_ids": [7]}', 1)
    assert mooncake.hash_block_size == MOONCAKE_BLOCK_SIZE and mooncake.timestamp_ms == 61.0


@pytest.mark.parametrize("line,reason", [
    (bailian_line(1, -1, 0.5, 40, [1, 2]), r"2 hash_ids for input_length 40: expected 3 "
                                           r"\(one per 16-token block"),
    (bailian_line(1, -1, -0.5, 16, [1]), "'timestamp' must be a finite non-negative "
                                         "number of s"),
    # A Bailian line that lost its chat_id: the error says what it looks like.
    ({"timestamp": 0, "input_length": 40, "hash_ids": [1, 2, 3]},
     "expected 1 .* a Bailian line \\(16-token blocks\\) has a 'chat_id', and a trace in "
     "this format of 16-token ids needs --trace-block-size 16"),
])
def test_bad_bailian_lines_say_what_is_wrong(line, reason):
    with pytest.raises(ValueError, match=reason):
        parse_line(json.dumps(line), 1)


@pytest.mark.parametrize("block_size", [4, 16, 32, 48, 64, 512, 1024])
def test_block_hashes_equal_the_managers_own_below_and_above_16(block_size):
    trace = Trace("t", [parse_line(json.dumps(line), n)
                        for n, line in enumerate(random_bailian_lines(3, 30), start=1)])
    expander = TraceExpander(block_size)
    prepared = prepare_trace(trace, expander)
    manager = KVCacheManager(8, block_size, hash_seed=expander.hash_seed)
    for index, request in enumerate(trace.requests):
        tokens = expander.prompt_token_ids(request)
        assert len(tokens) == request.input_length
        live = Request(str(index), tokens)
        manager.get_computed_blocks(live)  # attaches the manager's hasher, which hashes
        assert live.block_hashes == expander.block_hashes(request) == prepared.block_hashes[index]
        assert len(live.block_hashes) == request.input_length // block_size


def test_ids_name_16_tokens_and_differ_from_mooncake_ids():
    expander = TraceExpander(16)
    first = TraceRequest(1, 40, 0, 0.0, hash_ids=(5, 6, 9), hash_block_size=16)
    second = TraceRequest(2, 48, 0, 0.0, hash_ids=(5, 6, 7), hash_block_size=16)
    tokens = expander.prompt_token_ids(first)
    assert tokens[:32] == expander.token_block(5, 16) + expander.token_block(6, 16)
    assert tokens[32:] != expander.token_block(9, 16)[:8]  # a partial block is the line's
    # Two prompts naming the same first ids share those blocks, and only those.
    assert expander.block_hashes(second)[:2] == expander.block_hashes(first)
    assert expander.token_block(5, 16) != expander.token_block(5)[:16]
    # At 512 tokens a block joins 32 ids: a prompt of fewer full ids has no full block.
    assert TraceExpander(512).block_hashes(second) == []


def test_a_mooncake_id_and_a_bailian_id_of_one_number_share_nothing():
    expander = TraceExpander(16)
    mooncake = TraceRequest(1, 512, 0, 0.0, hash_ids=(5,))
    bailian = TraceRequest(2, 512, 0, 0.0, hash_ids=tuple(range(5, 37)), hash_block_size=16)
    first, second = expander.block_hashes(mooncake), expander.block_hashes(bailian)
    assert len(first) == len(second) == 32 and not set(first) & set(second)
    # Either order of expanding them gives the same hashes.
    assert TraceExpander(16).block_hashes(bailian) == second


def test_a_block_size_that_neither_divides_nor_is_a_multiple_of_16_is_refused():
    request = TraceRequest(3, 40, 0, 0.0, hash_ids=(1, 2, 3), hash_block_size=16)
    with pytest.raises(ValueError, match="neither divides nor is a multiple of the "
                                         "trace's 16-token blocks \\(line 3\\); choose such "
                                         "as 4, 8, 16 or 32$"):
        TraceExpander(24).block_hashes(request)
    # Every size suggested fits: for 100-token ids, 512 (a Mooncake multiple) would not.
    odd = TraceRequest(4, 300, 0, 0.0, hash_ids=(1, 2, 3), hash_block_size=100)
    with pytest.raises(ValueError, match="choose such as 25, 50, 100 or 200$"):
        TraceExpander(512).block_hashes(odd)
    for block_size in (25, 50, 100, 200):
        TraceExpander(block_size).block_hashes(odd)


@pytest.mark.parametrize("block_size", [8, 16, 48, 64])
def test_a_replay_hits_what_the_same_prompts_as_token_ids_hit(tmp_path, block_size):
    lines = random_bailian_lines(7)
    trace = load_trace(write_lines(tmp_path / "bailian.jsonl", lines))
    expander = TraceExpander(block_size)
    as_token_ids = Trace("t", [
        TraceRequest(r.line_no, r.input_length, r.output_length, r.timestamp_ms,
                     token_ids=expander.prompt_token_ids(r)) for r in trace.requests])
    for num_blocks in (40, 200, 10_000):
        for policy in ("lru", "adaptive"):
            config = ReplayConfig(num_blocks=num_blocks, policy=policy)
            ours = replay(prepare_trace(trace, TraceExpander(block_size)), config)
            theirs = replay(prepare_trace(as_token_ids, TraceExpander(block_size)), config)
            assert ours.num_hit_tokens == theirs.num_hit_tokens
    # The sessions do share: a large cache hits.
    assert ours.num_hit_tokens > 0


def test_a_timeline_replay_reads_seconds(tmp_path):
    lines = [bailian_line(0, -1, 2.0, 40, [1, 2, 3], 10),
             bailian_line(1, 0, 3.5, 56, [1, 2, 4, 5], 10, 2)]
    trace = load_trace(write_lines(tmp_path / "b.jsonl", lines))
    assert [r.timestamp_ms for r in trace.requests] == [2000.0, 3500.0]
    result = replay(prepare_trace(trace, TraceExpander(16)),
                    ReplayConfig(num_blocks=100, timeline=True))
    assert result.num_hit_tokens == 32  # the second prompt's first two blocks


def test_a_line_is_written_back_whole():
    line = {"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 40,
            "output_length": 80, "type": "search", "turn": 2, "hash_ids": [1, 2, 3],
            "extra": {"kept": True}}
    request = parse_line(json.dumps(line), 7)
    assert json.loads(format_line(request)) == line
    assert parse_line(format_line(request), 7) == request
    # Without session fields it is a Mooncake line of 16-token ids, read back as such.
    mooncake_16 = TraceRequest(1, 40, 0, 0.0, hash_ids=(1, 2, 3), hash_block_size=16)
    assert "chat_id" not in json.loads(format_line(mooncake_16))
    assert parse_line(format_line(mooncake_16), 1, mooncake_block_size=16) == mooncake_16


def test_merged_traces_keep_their_sessions_and_blocks_apart(tmp_path):
    first = load_trace(write_lines(tmp_path / "a.jsonl", random_bailian_lines(1, 30)))
    second = load_trace(write_lines(tmp_path / "b.jsonl", random_bailian_lines(2, 30)))
    merged = merge_traces([first, second])
    assert len(merged) == 60
    chats = [dict(r.session_fields)["chat_id"] for r in merged]
    assert len(set(chats)) == 60  # both traces number their chats from 0
    by_chat = {dict(r.session_fields)["chat_id"]: r for r in merged}
    for request in merged:
        parent = dict(request.session_fields)["parent_chat_id"]
        if parent != -1:  # a follow-up still extends its parent's full blocks
            parent_ids = by_chat[parent].hash_ids[:-1]
            assert request.hash_ids[:len(parent_ids)] == parent_ids
    # No block is shared across the traces: the merge hits what the two hit alone.
    infinite = ReplayConfig(num_blocks=100_000)

    def hits(requests):
        return replay(prepare_trace(Trace("t", requests), TraceExpander(16)),
                      infinite).num_hit_tokens

    assert hits(merged) == hits(first.requests) + hits(second.requests) > 0
    shared = merge_traces([first, first], shared_ids=True)
    assert {dict(r.session_fields)["chat_id"] for r in shared} == set(range(30))


def test_a_parent_before_the_trace_is_moved_past_too(tmp_path):
    # A window cut from a longer trace: line 1's parent, chat 10, is not in it.
    first = load_trace(write_lines(tmp_path / "a.jsonl", [
        bailian_line(3, 10, 0.0, 20, [1, 2], turn=4)]))
    second = load_trace(write_lines(tmp_path / "b.jsonl", [
        bailian_line(0, -1, 1.0, 20, [1, 2]), bailian_line(1, 0, 2.0, 36, [1, 5, 6], turn=2)]))
    merged = [dict(r.session_fields) for r in merge_traces([first, second])]
    assert [(f["chat_id"], f["parent_chat_id"]) for f in merged] == [(3, 10), (11, -1),
                                                                      (12, 11)]


def test_replay_and_merge_commands(tmp_path):
    path = write_lines(tmp_path / "b.jsonl", random_bailian_lines(2, 60))
    assert main(["replay", str(path), "--num-blocks", "300", "--quiet",
                 "--json", str(tmp_path / "out.json")]) == 0
    figures = json.loads((tmp_path / "out.json").read_text())
    assert figures["runs"][0]["num_requests"] == 60
    assert figures["runs"][0]["hit_rate"] > 0
    merged = tmp_path / "m.jsonl"
    assert main(["merge", str(path), str(path), "-o", str(merged), "--quiet"]) == 0
    lines = [json.loads(line) for line in merged.read_text().splitlines()]
    assert len(lines) == 120 and all("chat_id" in line for line in lines)
    assert load_trace(merged).requests[0].hash_block_size == BAILIAN_BLOCK_SIZE


@pytest.mark.parametrize("block_size", [16, 512])
def test_the_shared_trace_spelt_in_16_token_ids_hits_the_same(block_size):
    mooncake = trace_prefix(120)
    bailian = Trace("bailian", [mooncake_as_bailian(r) for r in mooncake.requests])
    for policy, num_blocks in (("lru", 40 * 512 // block_size),
                               ("2q", 300 * 512 // block_size)):
        config = ReplayConfig(num_blocks=num_blocks, policy=policy)
        ours = replay(prepare_trace(bailian, TraceExpander(block_size)), config)
        theirs = replay(prepare_trace(mooncake, TraceExpander(block_size)), config)
        assert ours.num_hit_tokens == theirs.num_hit_tokens > 0
        assert ours.num_evictions == theirs.num_evictions
