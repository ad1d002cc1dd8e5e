"""The synthetic workload families: deterministic, valid traces of the shapes they claim."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

import pytest

from prefixcache.entrypoints.cli import main
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.sweep import infinite_cache_hit_tokens
from prefixcache.sim.trace import MAX_REQUEST_TOKENS, load_trace
from prefixcache.sim.workloads import (
    WORKLOAD_FAMILIES,
    BlockIdInterner,
    MixtureWorkload,
    generate_requests,
    stream_requests,
    write_trace,
)
from prefixcache.sim.workloads.parameter_ranges import check_parameter
from tests.processes import REPO_ROOT, run_with_reader_gone

# Small prompts, so the token-id format stays small too.
SMALL = {
    "chat": {"system_prompt_tokens": 600, "user_tokens": 150, "output_tokens": 200},
    "rag": {"num_documents": 40, "document_tokens": 1200},
    "agent": {"tool_context_tokens": 1500, "observation_tokens": 300},
    "tenants": {"num_tenants": 30, "system_prompt_tokens": 700, "user_tokens": 200},
    "mixture": {},
}


def mooncake_lines(family: str, seed: int, num_requests: int) -> list[dict]:
    buffer = io.StringIO()
    write_trace(generate_requests(family, seed, num_requests, **SMALL[family]), buffer,
                "mooncake", seed)
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_same_seed_same_trace_other_seed_other_trace(family):
    assert mooncake_lines(family, 3, 120) == mooncake_lines(family, 3, 120)
    assert mooncake_lines(family, 3, 120) != mooncake_lines(family, 4, 120)


@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_both_formats_parse_and_share_the_same_blocks(family, tmp_path):
    requests = generate_requests(family, 1, 60, **SMALL[family])
    paths = {}
    for trace_format in ("mooncake", "token-ids"):
        paths[trace_format] = tmp_path / f"{trace_format}.jsonl"
        with paths[trace_format].open("w") as handle:
            write_trace(requests, handle, trace_format, 1)
    hits = {}
    for trace_format, path in paths.items():
        trace = load_trace(path)
        assert len(trace.requests) == 60
        assert [r.input_length for r in trace.requests] == [r.input_length for r in requests]
        timestamps = [r.timestamp_ms for r in trace.requests]
        assert timestamps == sorted(timestamps)
        hits[trace_format] = infinite_cache_hit_tokens(prepare_trace(trace,
                                                                      TraceExpander(512)))
    # Mooncake ids and real tokens describe the same sharing: the same full blocks hit.
    assert hits["mooncake"] == hits["token-ids"] > 0


def _by_stream(requests, kind: str):
    stream_to_requests = defaultdict(list)
    for request in requests:
        for stream, _ in request.segments:
            if stream[0] == kind:
                stream_to_requests[stream].append(request)
    return stream_to_requests


@pytest.mark.parametrize("family,kind", [("chat", "chat"), ("agent", "agent")])
def test_each_turn_extends_the_previous_prompt(family, kind):
    requests = generate_requests(family, 2, 400)
    interner = BlockIdInterner()
    request_to_ids = {id(r): interner.hash_ids(r.segments) for r in requests}
    num_extended = 0
    for turns in _by_stream(requests, kind).values():
        for previous, current in zip(turns, turns[1:], strict=False):
            assert current.segments[0] == previous.segments[0]  # same system / tools
            grown = current.segments[1][1] - previous.segments[1][1]
            assert grown > previous.output_length  # the answer and a new message
            assert current.timestamp_ms >= previous.timestamp_ms
            full = previous.input_length // 512
            assert request_to_ids[id(current)][:full] == request_to_ids[id(previous)][:full]
            num_extended += 1
    assert num_extended > 100


def test_rag_documents_follow_zipf_popularity():
    requests = generate_requests("rag", 5, 3000, num_documents=200, follow_up_probability=0)
    counts = Counter(r.segments[1][0] for r in requests)
    ranked = [count for _, count in counts.most_common()]
    assert ranked[0] > 10 * ranked[len(ranked) // 2]  # heavy head
    # Every prompt: the shared instruction prompt, a document, a question of its own.
    assert len({r.segments[0] for r in requests}) == 1
    assert len({r.segments[2][0] for r in requests}) == 3000


def test_tenants_open_with_their_own_system_prompt():
    requests = generate_requests("tenants", 5, 2000, num_tenants=50)
    tenant_to_lengths = defaultdict(set)
    for request in requests:
        (kind, tenant), length = request.segments[0]
        assert kind == "tenant-system"
        tenant_to_lengths[tenant].add(length)
    assert 10 < len(tenant_to_lengths) <= 50
    assert all(len(lengths) == 1 for lengths in tenant_to_lengths.values())


def test_popularity_drift_changes_the_favourites():
    requests = generate_requests("rag", 1, 4000, num_documents=300, zipf_s=1.2,
                                 follow_up_probability=0, popularity_drift_every=2000)
    first = Counter(r.segments[1][0] for r in requests[:2000]).most_common(1)[0][0]
    second = Counter(r.segments[1][0] for r in requests[2000:]).most_common(1)[0][0]
    assert first != second


def test_mixture_holds_every_family_in_shares_that_drift():
    requests = generate_requests("mixture", 1, 2000, num_phases=4)
    kinds = [Counter(r.segments[0][0][0] for r in requests[start:start + 500])
             for start in range(0, 2000, 500)]
    assert set().union(*kinds) == {"chat-system", "rag-system", "agent-tools",
                                   "tenant-system"}
    shares = [k["rag-system"] / 500 for k in kinds]
    assert max(shares) - min(shares) > 0.05


# SHA-256 of `prefixcache synth FAMILY --seed S --num-requests N [--param ...]` as the
# generators wrote them when the published figures were made: a change to how requests are
# drawn or written must not change a trace drawn from valid parameters.
PUBLISHED_TRACES = [
    ("chat", 1, 2000, {}, "mooncake",
     "17d588c8aaa04e638ff0c33638a57adfaf78d8136e8a12bcba65cfed299278da"),
    ("rag", 1, 2000, {}, "mooncake",
     "617d37a3065f6914c6d7f5c566eb09bb55c580fb90a248c40cbed93af9788778"),
    ("agent", 1, 2000, {}, "mooncake",
     "3c50c680a307ae74ddc4cc22bb281c5aa0a5d3392ad4228d5ff4ea40b67cd1da"),
    ("tenants", 1, 2000, {}, "mooncake",
     "1136bf8769b65ce1adddb52495fb3a11304f76cd9747b41bba9334942564245b"),
    ("mixture", 1, 2000, {}, "mooncake",
     "4f73b7ef5cc3228d16f2899bcae022529dd45f4c8e5d7c180a4d14b2278a9e94"),
    ("rag", 3, 2000, {"popularity_drift_every": 50, "num_documents": 200}, "mooncake",
     "5d09511b7fec753ba7384a15aca039020ea77114520115467649aa2c76b9b593"),
    ("tenants", 3, 2000, {"popularity_drift_every": 30}, "mooncake",
     "0f8667f44e6d56f9f9b152dcba87a67f7c373ecf6854e827710b0af49b22bbbb"),
    ("chat", 1, 300, {}, "token-ids",
     "708f1d8b401071c9cd25496fdc7f115d94b90fc8c26319f216d3614c17c1bcc9"),
]


@pytest.mark.parametrize("family,seed,num_requests,params,trace_format,sha256",
                         PUBLISHED_TRACES)
def test_traces_stay_byte_identical(family, seed, num_requests, params, trace_format,
                                    sha256):
    out = io.StringIO()
    write_trace(stream_requests(family, seed, num_requests, **params), out, trace_format,
                seed)
    assert hashlib.sha256(out.getvalue().encode()).hexdigest() == sha256


class SecondRequestDrawn(Exception):
    """Raised by a stream at the moment its second request is asked for."""


def test_synth_writes_each_request_as_it_is_drawn(monkeypatch):
    """The first request is on standard output before the second is drawn: nothing
    waits for the whole trace (``synth ... | head -1`` returns at once, and the trace is
    never held in memory whole)."""
    import prefixcache.sim.workloads as workloads

    real_stream_requests = workloads.stream_requests
    out = io.StringIO()
    written_before_second = []

    def stop_at_the_second(*args, **kwargs):
        requests = real_stream_requests(*args, **kwargs)
        yield next(requests)
        written_before_second.append(out.getvalue())
        raise SecondRequestDrawn

    monkeypatch.setattr(workloads, "stream_requests", stop_at_the_second)
    monkeypatch.setattr(sys, "stdout", out)
    with pytest.raises(SecondRequestDrawn):
        main(["synth", "mixture", "--seed", "1", "--num-requests", "10000000"])
    first = io.StringIO()
    write_trace(itertools.islice(stream_requests("mixture", 1, 10_000_000), 1), first,
                "mooncake", 1)
    assert written_before_second == [first.getvalue()]


def test_synth_command_writes_a_trace_the_replayer_reads(tmp_path, capsys):
    out = tmp_path / "chat.jsonl"
    assert main(["synth", "chat", "--seed", "1", "--num-requests", "50", "-o", str(out),
                 "--param", "max_turns=3"]) == 0
    assert len(load_trace(out).requests) == 50
    assert main(["replay", str(out), "--num-blocks", "100", "--block-size", "512",
                 "--quiet", "--json", str(tmp_path / "r.json")]) == 0


@pytest.mark.parametrize("failure,exit_code", [(KeyboardInterrupt, 130),
                                                (OSError(28, "No space left on device"), 1)])
def test_an_interrupted_synth_leaves_the_previous_file_whole(tmp_path, monkeypatch, capsys,
                                                             failure, exit_code):
    import prefixcache.sim.workloads as workloads

    real_write_trace = workloads.write_trace

    def write_half_then_fail(requests, handle, *args):
        real_write_trace(itertools.islice(requests, 25), handle, *args)
        handle.flush()
        raise failure

    out = tmp_path / "chat.jsonl"
    out.write_text("the previous trace\n")
    monkeypatch.setattr(workloads, "write_trace", write_half_then_fail)
    assert main(["synth", "chat", "--num-requests", "50", "-o", str(out)]) == exit_code
    assert out.read_text() == "the previous trace\n"
    assert [p.name for p in tmp_path.iterdir()] == ["chat.jsonl"]  # no partial file left
    monkeypatch.setattr(workloads, "write_trace", real_write_trace)
    assert main(["synth", "chat", "--num-requests", "50", "-o", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 50


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP"])
def test_a_synth_ended_by_a_signal_leaves_the_previous_file_whole(tmp_path, signum):
    """``timeout 60 prefixcache synth ...``, or a closed terminal: the process still ends
    by that signal, but with its temporary file removed."""
    out = tmp_path / "chat.jsonl"
    out.write_text("the previous trace\n")
    def default_handlers():  # as a shell gives them, whatever this test runs under (nohup)
        for name in ("SIGTERM", "SIGHUP"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)

    process = subprocess.Popen([sys.executable, "-m", "prefixcache", "synth", "chat",
                                "--num-requests", "10000000", "-o", str(out)], cwd=REPO_ROOT,
                               stderr=subprocess.DEVNULL, preexec_fn=default_handlers)
    try:
        # Once the temporary file has grown, the trace is being written into it.
        deadline = time.monotonic() + 60
        while not any(p.name.endswith(".partial") and p.stat().st_size > 100_000
                      for p in tmp_path.iterdir()):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        process.send_signal(getattr(signal, signum))
        assert process.wait(timeout=60) == -getattr(signal, signum)
    finally:
        process.kill()
        process.wait()
    assert out.read_text() == "the previous trace\n"
    assert [p.name for p in tmp_path.iterdir()] == ["chat.jsonl"]


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_signal_handlers_are_ours_only_while_a_trace_is_written(tmp_path):
    """While the temporary file exists, SIGTERM's handler (the default before) removes it
    first; SIGHUP, ignored here as under nohup, stays ignored; both are as they were
    after."""
    from prefixcache.entrypoints.trace_output import write_to_file

    previous = {signum: signal.signal(signum, handler) for signum, handler in
                ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGHUP, signal.SIG_IGN))}
    seen = {}

    def write(handle):
        handle.write("a line\n")
        seen.update({signum: signal.getsignal(signum) for signum in previous})

    try:
        write_to_file(str(tmp_path / "out.jsonl"), write)
        assert callable(seen[signal.SIGTERM]) and seen[signal.SIGHUP] is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert (tmp_path / "out.jsonl").read_text() == "a line\n"
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_an_output_name_as_long_as_the_file_system_allows_is_written(tmp_path):
    out = tmp_path / ("a" * 245 + ".jsonl")  # 251 bytes: the longest names are 255
    assert main(["synth", "chat", "--num-requests", "5", "-o", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 5
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_synth_through_a_symbolic_link_writes_the_file_it_names(tmp_path):
    target = tmp_path / "traces" / "chat.jsonl"
    target.parent.mkdir()
    target.write_text("the previous trace\n")
    link = tmp_path / "latest.jsonl"
    link.symlink_to(target)
    assert main(["synth", "chat", "--num-requests", "5", "-o", str(link)]) == 0
    assert link.is_symlink() and link.resolve() == target
    assert len(target.read_text().splitlines()) == 5
    assert sorted(p.name for p in target.parent.iterdir()) == ["chat.jsonl"]


def test_synth_output_file_gets_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        assert main(["synth", "chat", "--num-requests", "5", "-o",
                     str(tmp_path / "t.jsonl")]) == 0
    finally:
        os.umask(umask)
    assert (tmp_path / "t.jsonl").stat().st_mode & 0o777 == 0o644


def test_synth_over_an_existing_file_keeps_its_permissions(tmp_path):
    out = tmp_path / "private.jsonl"
    out.write_text("the previous trace\n")
    out.chmod(0o600)
    assert main(["synth", "chat", "--num-requests", "5", "-o", str(out)]) == 0
    assert out.stat().st_mode & 0o7777 == 0o600
    assert len(out.read_text().splitlines()) == 5


def test_synth_writes_a_writable_file_in_place_if_its_directory_refuses_a_new_file(
        tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    out = tmp_path / "chat.jsonl"
    out.write_text("the previous trace\n")
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert main(["synth", "chat", "--num-requests", "5", "-o", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 5
    # A new file has nothing to be written in place of: the error is reported.
    assert main(["synth", "chat", "--num-requests", "5", "-o",
                 str(tmp_path / "new.jsonl")]) == 1
    assert "cannot write" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["chat.jsonl"]


@pytest.mark.parametrize("tty,shown", [(True, True), (False, False)])
def test_synth_shows_progress_only_on_a_terminal(tmp_path, capsys, monkeypatch, tty, shown):
    import prefixcache.entrypoints.synth_cmd as synth_cmd

    monkeypatch.setattr(synth_cmd, "PROGRESS_DELAY_S", 0)  # as for a long generation
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    out = tmp_path / "chat.jsonl"
    assert main(["synth", "chat", "--num-requests", "300", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert ("generating" in err and "300/300" in err) == shown
    assert err.endswith(f"wrote 300 chat requests to {out}\n")
    if not shown:
        assert err == f"wrote 300 chat requests to {out}\n"


def _synth_process(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``prefixcache synth *args`` run as a real process; stderr captured as text."""
    return subprocess.run([sys.executable, "-m", "prefixcache", "synth", *args],
                          stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), **kwargs)


@pytest.mark.skipif(not os.path.exists("/dev/stdout"), reason="needs /dev/stdout")
def test_synth_to_dev_stdout_writes_into_the_pipe_it_names():
    """``synth ... -o /dev/stdout | cat``: /dev/stdout is then a pipe, written as named."""
    result = _synth_process(["chat", "--num-requests", "3", "-o", "/dev/stdout"],
                            stdout=subprocess.PIPE)
    assert result.returncode == 0, result.stderr
    assert [line["input_length"] > 0 for line in map(json.loads, result.stdout.splitlines())
            ] == [True] * 3
    assert result.stderr == "wrote 3 chat requests to /dev/stdout\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("num_requests", ["10", "3000"])  # within the buffer, and beyond
def test_synth_to_a_full_standard_output_fails_with_one_line(num_requests):
    with open("/dev/full", "w") as full:
        result = _synth_process(["chat", "--num-requests", num_requests], stdout=full)
    assert result.returncode == 1
    assert result.stderr == ("prefixcache synth: error: cannot write standard output: "
                             "No space left on device\n")


def test_synth_to_a_closed_standard_output_fails_with_one_line():
    command = shlex.join([sys.executable, "-m", "prefixcache", "synth", "chat",
                          "--num-requests", "10"]) + " >&-"
    result = subprocess.run(["sh", "-c", command], stderr=subprocess.PIPE, text=True,
                            timeout=120, cwd=REPO_ROOT,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 1
    assert result.stderr == ("prefixcache synth: error: cannot write standard output: "
                             "it is closed\n")


def test_synth_to_a_reader_that_goes_away_exits_quietly():
    result = run_with_reader_gone(["synth", "chat", "--num-requests", "3000"], timeout=120)
    assert (result.returncode, result.stderr) == (141, "")


@pytest.mark.parametrize("argv,message", [
    (["synth", "chat", "--num-requests", "5", "--param", "nope=1"], "no parameter 'nope'"),
    (["synth", "chat", "--num-requests", "5", "--param", "think_time_s=x"], "must be float"),
    (["synth", "rag", "--num-requests", "5", "--param", "num_documents=0"],
     "num_documents must be between 1 and 1,000,000, got 0"),
    # Values no generator can draw with (an overflow, a division by zero, a draw that
    # never ends): each is refused by its range before drawing starts.
    (["synth", "rag", "--num-requests", "5", "--param", "zipf_s=1e12"],
     "zipf_s must be between 0 and 10"),
    (["synth", "agent", "--num-requests", "5", "--param", "mean_tool_time_s=inf"],
     "mean_tool_time_s must be between"),
    (["synth", "chat", "--num-requests", "5", "--param", "think_time_sigma=nan"],
     "think_time_sigma must be between 0 and 10, got nan"),
    (["synth", "mixture", "--num-requests", "5", "--param", "share_concentration=nan"],
     "share_concentration must be between"),
    (["synth", "tenants", "--num-requests", "5", "--param", "follow_up_probability=1.5"],
     "follow_up_probability must be between 0 and 1"),
    (["synth", "chat"], "--num-requests is required"),
    # A drift reshuffles every document or tenant: drifts this frequent would cost each
    # request a shuffle of far more than MAX_DRIFTING_ITEMS_PER_REQUEST items.
    (["synth", "rag", "--num-requests", "100", "--param", "num_documents=1000000",
      "--param", "popularity_drift_every=1"],
     "rag: with num_documents=1,000,000, popularity_drift_every must be 0 or at least "
     "10,000"),
    (["synth", "tenants", "--num-requests", "100", "--param", "num_tenants=1000000",
      "--param", "popularity_drift_every=9999"],
     "popularity_drift_every must be 0 or at least 10,000"),
    (["synth", "mixture", "--num-requests", "5", "--param", "popularity_drift_every=14"],
     "mixture's rag: with num_documents=1,500, popularity_drift_every must be 0 or at "
     "least 15"),
    (["synth", "rag", "--num-requests", "5", "--param", "zipf_s=1.2", "--param",
      "zipf_s=0.9"], "--param zipf_s is given twice"),
])
def test_synth_command_rejects_bad_input_clearly(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("param,message", [
    ("zipf_s=" + "x" * 5000, "zipf_s must be float, got 'xxxx"),
    ("num_documents=" + "9" * 4000, "num_documents must be between 1 and 1,000,000, got 9999"),
    ("n" * 5000 + "=1", "rag has no parameter 'nnnn"),
])
def test_a_long_bad_value_is_quoted_short(param, message, capsys):
    assert main(["synth", "rag", "--num-requests", "5", "--param", param]) == 2
    err = capsys.readouterr().err
    assert message in err and "characters)" in err
    assert len(err) < 400


def test_a_long_parameter_without_a_value_is_quoted_short(capsys):
    with pytest.raises(SystemExit):
        main(["synth", "rag", "--num-requests", "5", "--param", "n" * 5000])
    err = capsys.readouterr().err
    assert "expected NAME=VALUE, got 'nnnn" in err and len(err) < 800


@pytest.mark.parametrize("num_requests", ["0", "10000001", "99999999999999999999999999"])
def test_synth_refuses_a_request_count_out_of_range_as_a_usage_error(num_requests, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["synth", "chat", "--num-requests", num_requests])
    assert exit_info.value.code == 2
    assert f"must be 1 to 10,000,000, got {num_requests}" in capsys.readouterr().err


def test_generate_requests_refuses_more_than_its_bound():
    with pytest.raises(ValueError, match="between 1 and 10,000,000, got 10000001"):
        generate_requests("chat", 1, 10_000_001)


@pytest.mark.parametrize("family,params", [
    ("rag", {"num_documents": 1000, "popularity_drift_every": 10}),  # the bound itself
    ("tenants", {"num_tenants": 1_000_000, "popularity_drift_every": 10_000}),
    ("mixture", {"popularity_drift_every": 15}),
    # As docs/benchmarks.md's traces L and T8 use them.
    ("rag", {"num_documents": 5000, "zipf_s": 1.1, "popularity_drift_every": 600}),
    ("tenants", {"num_tenants": 1000, "zipf_s": 0.9, "popularity_drift_every": 500}),
])
def test_drifts_within_the_bound_are_allowed(family, params):
    assert len(generate_requests(family, 1, 30, **params)) == 30


def test_synth_refuses_requests_too_long_to_replay_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "rag.jsonl"
    assert main(["synth", "rag", "--num-requests", "20", "--param", "output_tokens=10000000",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert ("rag: request 1 (counting from 0) has input_length 5,481 and output_length "
            "17,348,671, over the 16,777,216 tokens per request that prefixcache replay "
            "reads" in err)
    assert err.endswith("too long for the replayer; lower output_tokens\n")
    assert list(tmp_path.iterdir()) == []  # no partial trace, no temporary file


def test_prompts_grown_past_the_replay_limit_name_what_to_lower():
    with pytest.raises(ValueError, match=r"rag: request \d+ .* lower document_tokens, "
                                         r"system_prompt_tokens, question_tokens, "
                                         r"follow_up_probability$"):
        generate_requests("rag", 1, 100, question_tokens=5_000_000,
                          follow_up_probability=1)


def test_a_request_exactly_at_the_replay_limit_is_kept(monkeypatch):
    import prefixcache.sim.workloads as workloads

    requests = generate_requests("rag", 1, 50)
    longest = max(max(r.input_length, r.output_length) for r in requests)
    assert longest <= MAX_REQUEST_TOKENS
    monkeypatch.setattr(workloads, "MAX_REQUEST_TOKENS", longest)
    assert generate_requests("rag", 1, 50) == requests
    monkeypatch.setattr(workloads, "MAX_REQUEST_TOKENS", longest - 1)
    with pytest.raises(ValueError, match="too long for the replayer"):
        generate_requests("rag", 1, 50)


def test_synth_help_names_every_family(capsys):
    with pytest.raises(SystemExit):
        main(["synth", "--help"])
    text = capsys.readouterr().out
    assert all(family in text for family in WORKLOAD_FAMILIES)


@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_every_parameter_has_a_range_that_holds_its_default(family):
    workload = WORKLOAD_FAMILIES[family]()
    numbers = {f.name: getattr(workload, f.name) for f in dataclasses.fields(workload)
               if isinstance(getattr(workload, f.name), int | float)}
    assert numbers
    for name, default in numbers.items():
        check_parameter(name, default)  # KeyError for a parameter without a range


@pytest.mark.parametrize("family,params,lengths", [
    ("chat", {"max_context_tokens": 100}, "system_prompt_tokens or first_message_tokens"),
    ("agent", {"tool_context_tokens": 60_000}, "tool_context_tokens or task_tokens"),
])
def test_parameters_that_leave_no_room_for_a_prompt_stop_with_a_clear_error(
        family, params, lengths):
    with pytest.raises(ValueError, match=f"prompts in a row would pass max_context_tokens.*"
                                         f"lower {lengths}"):
        generate_requests(family, 1, 10, **params)


def test_a_mixture_whose_share_draws_all_underflow_shares_evenly():
    class Underflowing(random.Random):
        def gammavariate(self, alpha, beta):
            return 0.0

    requests = list(MixtureWorkload(share_concentration=0.01).stream(200, Underflowing(1)))
    assert len(requests) == 200
