"""``prefixcache replay`` end to end through the CLI's main()."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import sys
import threading

import pytest

from prefixcache.core import EVICTION_POLICIES
from prefixcache.entrypoints import replay_cmd
from prefixcache.entrypoints.cli import main
from prefixcache.sim import parallel_replays
from prefixcache.sim.parallel_replays import can_fork
from prefixcache.sim.trace import MAX_REQUEST_TOKENS
from tests.processes import run_with_reader_gone
from tests.sim.helpers import write_lines, write_trace_head


@pytest.fixture
def small_trace(tmp_path):
    """The first 200 requests of the Mooncake trace in data/."""
    return write_trace_head(tmp_path / "head.jsonl", 200)


def replay_to_json(trace, tmp_path, num_blocks: int, policies: str) -> dict:
    """Run ``prefixcache replay`` quietly at block size 512; returns its JSON output."""
    out = tmp_path / "out.json"
    code = main(["replay", str(trace), "--num-blocks", str(num_blocks), "--block-size",
                 "512", "--policy", policies, "--json", str(out), "--quiet"])
    assert code == 0
    return json.loads(out.read_text())


def test_single_replay_prints_a_table_and_writes_json(small_trace, tmp_path, capsys):
    payload = replay_to_json(small_trace, tmp_path, 2000, "lru,2q")
    text = capsys.readouterr().out
    assert "token hit rate" in text and "2q" in text and "not admitted" in text
    assert payload["num_requests"] == 200 and payload["block_size"] == 512
    runs = payload["runs"]
    assert [r["policy"] for r in runs] == ["lru", "2q"]
    for run in runs:
        assert run["num_hit_tokens"] / run["num_prompt_tokens"] == run["hit_rate"]
        assert run["num_requests"] == 200 and run["num_blocks"] == 2000
        assert run["requests_per_s"] > 0 and run["blocks_per_s"] > 0
        assert 0 < run["mean_usage"] <= run["peak_usage"] <= 1


def test_online_stands_for_every_online_policy_in_order_without_repeats(small_trace,
                                                                         tmp_path):
    runs = replay_to_json(small_trace, tmp_path, 500, "2q,online,belady")["runs"]
    policies = [run["policy"] for run in runs]
    assert policies == ["2q", "lru", "unhashed-first", "learned-reuse", "document-liveness",
                        "adaptive", "belady"]
    assert set(policies) == {*EVICTION_POLICIES, "belady"}


def test_adaptive_replay_shows_the_share_it_follows(small_trace, tmp_path, capsys):
    (run,) = replay_to_json(small_trace, tmp_path, 1000, "adaptive")["runs"]
    text = capsys.readouterr().out
    state = run["policy_state"]
    low_reuse = ", low-reuse content first" if state["low_reuse_first"] else ""
    assert (f"adaptive: protected share {state['protected_fraction']:.0%}{low_reuse}, "
            f"ghost {state['ghost_factor']}x at the end") in text
    followed = state["candidate_followed_shares"]
    assert sum(followed.values()) == pytest.approx(1, abs=1e-3)
    first = next(iter(followed))  # followed from the start, so for some of the requests
    assert f"adaptive over the replay: {state['switches']:,} switch" in text
    assert f"{first}: {followed[first]:.1%}" in text.split("adaptive over the replay:")[1]


def test_learned_reuse_replay_shows_what_it_learned(small_trace, tmp_path, capsys):
    lru, learned = replay_to_json(small_trace, tmp_path, 1000, "lru,learned-reuse")["runs"]
    text = capsys.readouterr().out
    assert "learned-reuse: new content by tokens generated" in text
    assert text.count("evicted first") == 1  # only the learned-reuse run has a table
    assert lru["policy_state"] is None
    rows = learned["policy_state"]["signatures"]
    assert rows and all(0 <= row["reused"] <= row["inserted"] for row in rows)
    # Each row covers the output lengths of its signature, and the trace's long
    # generations (>= 256 tokens) leave content that is evicted first.
    for row in rows:
        low, high = row["output_tokens"]
        assert low == high == 0 if row["signature"] == 0 else \
            (low, high) == (2 ** (row["signature"] - 1), 2 ** row["signature"] - 1)
    assert any(row["evicted_first"] for row in rows if row["output_tokens"][0] >= 256)


def test_document_liveness_replay_shows_its_model(small_trace, tmp_path, capsys):
    (run,) = replay_to_json(small_trace, tmp_path, 1000, "document-liveness")["runs"]
    text = capsys.readouterr().out
    assert "document-liveness: chance a document is asked about again" in text
    state = run["policy_state"]
    rows = state["classes"]
    assert [row["class"][0] for row in rows] == sorted((row["class"][0] for row in rows),
                                                       key=lambda kind: kind != "first")
    for row in rows:
        assert 0 <= row["continued"] <= row["states"] and 0 < row["estimated_p"] < 1
        kind, bits = row["class"]
        label = "generated" if kind == "first" else "prompt lengths vary by"
        low = 0 if bits == 0 else 2 ** (bits - 1)
        assert f"{label} {low}" in text
    # Every request with a full prompt block is one state of its document.
    assert sum(row["states"] for row in rows) <= 200
    assert state["requests_between_a_documents_requests"] > 1
    # And one of its conversation: as many states, fewer of them continued (a document
    # goes on whenever any of its conversations does, or a new one starts).
    conversations = state["conversations"]
    assert "document-liveness: chance a conversation goes on" in text
    conversation_rows = conversations["classes"]
    assert (sum(row["states"] for row in conversation_rows)
            == sum(row["states"] for row in rows))
    assert (sum(row["continued"] for row in conversation_rows)
            <= sum(row["continued"] for row in rows))


def test_sweep_writes_json_and_a_png(small_trace, tmp_path, capsys):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    code = main(["replay", str(small_trace), "--sweep", "1000,300", "--block-size", "256",
                 "--policy", "lru,unhashed-first,2q", "--json", str(out), "--plot", str(png),
                 "--quiet"])
    assert code == 0
    text = capsys.readouterr().out
    assert "belady" in text and "infinite" in text and "widest LRU->Belady gap" in text
    payload = json.loads(out.read_text())
    # Hit rates carry their unit: the row at 300 blocks ends with the infinite cache's.
    row = next(line for line in text.splitlines() if line.lstrip().startswith("300 "))
    assert row.endswith(f"{100 * payload['infinite_hit_rate']:.2f}%")
    assert payload["capacities_blocks"] == [300, 1000]
    assert payload["ordering_violations"] == []
    assert set(payload["policy_hit_rates"]) == {"lru", "unhashed-first", "2q"}
    assert len(payload["belady_hit_rates"]) == 2
    assert len(payload["runs"]) == 2 * 4
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not can_fork(), reason="workers are forked (POSIX only)")
@pytest.mark.parametrize("size", [["--sweep", "300,1000"], ["--num-blocks", "300"]])
def test_jobs_print_the_same_figures_as_one_process(small_trace, tmp_path, capsys, size):
    outputs = []
    for jobs in ("1", "3"):
        out = tmp_path / f"jobs-{jobs}.json"
        assert main(["replay", str(small_trace), *size, "--block-size", "256", "--policy",
                     "lru,2q,belady", "--jobs", jobs, "--json", str(out), "--quiet"]) == 0
        text = capsys.readouterr().out
        payload = json.loads(out.read_text())
        for run in payload["runs"]:
            for timing in ("replay_seconds", "requests_per_s", "blocks_per_s"):
                del run[timing]
        # The single replays' tables print their speed: compare the rest.
        outputs.append(([line for line in text.splitlines()
                         if not line.startswith(("replay time", "replay throughput"))],
                        payload))
    assert outputs[0] == outputs[1]


@pytest.mark.skipif(not can_fork(), reason="workers are forked (POSIX only)")
def test_a_killed_replay_worker_is_a_one_line_error(small_trace, capsys, monkeypatch):
    def killed(prepared, config, progress=None):
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(parallel_replays, "replay", killed)
    assert main(["replay", str(small_trace), "--sweep", "300,1000", "--block-size", "512",
                 "--jobs", "2", "--quiet"]) == 1
    assert capsys.readouterr().err == (
        "prefixcache replay: error: a replay's worker process was killed (out of memory? "
        "with fewer jobs, each has more)\n")


def test_sweep_capacities_as_shares_of_the_working_set(small_trace, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["replay", str(small_trace), "--sweep", "10%,50%,2.5%,500", "--block-size",
                 "512", "--policy", "lru,2q,adaptive", "--json", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    payload = json.loads(out.read_text())
    # The working set, counted from the file: each request's full 512-token blocks.
    full_blocks = set()
    for line in small_trace.read_text().splitlines():
        request = json.loads(line)
        full_blocks.update(request["hash_ids"][:request["input_length"] // 512])
    working_set = len(full_blocks)
    assert payload["working_set_blocks"] == working_set
    assert payload["capacities_blocks"] == sorted(
        {round(0.025 * working_set), round(0.1 * working_set), round(0.5 * working_set), 500})
    assert f"working set: {working_set:,} blocks" in text
    # Each online policy against lru, from the curves themselves.
    rates, belady = payload["policy_hit_rates"], payload["belady_hit_rates"]
    gaps = [b - a for a, b in zip(rates["lru"], belady, strict=True)]
    widest = gaps.index(max(gaps))
    for policy in ("2q", "adaptive"):
        figures = payload["versus_lru"][policy]
        closed = (rates[policy][widest] - rates["lru"][widest]) / gaps[widest]
        assert figures["fraction_of_widest_gap_closed"] == pytest.approx(closed)
        least = min(a - b for a, b in zip(rates[policy], rates["lru"], strict=True))
        assert figures["min_minus_baseline_points"] == pytest.approx(100 * least)
        assert (f"{policy} vs lru: closes {100 * closed:.1f} % of the widest gap; least "
                f"margin over the sweep {100 * least:+.2f} points") in text.splitlines()
    assert set(payload["versus_lru"]) == {"2q", "adaptive"}


def test_a_capacity_far_beyond_the_trace_is_cheap_and_exact(small_trace, tmp_path, capsys):
    """10**20 blocks would never fit in memory: the replay uses a pool of the trace's
    demand (tests/sim/test_replay.py checks that this is exact) and reports the capacity
    asked for; the hit rate is the infinite cache's."""
    out = tmp_path / "out.json"
    huge = str(10**20)
    assert main(["replay", str(small_trace), "--num-blocks", huge, "--block-size", "512",
                 "--json", str(out), "--quiet"]) == 0
    assert "100,000,000,000,000,000,000 blocks x 512 tokens" in capsys.readouterr().out
    (run,) = json.loads(out.read_text())["runs"]
    assert run["num_blocks"] == 10**20 and run["num_evictions"] == 0
    assert main(["replay", str(small_trace), "--sweep", f"1000,{huge}", "--block-size", "512",
                 "--json", str(out), "--quiet"]) == 0
    payload = json.loads(out.read_text())
    assert payload["capacities_blocks"] == [1000, 10**20]
    assert payload["policy_hit_rates"]["lru"][1] == payload["belady_hit_rates"][1] \
        == payload["infinite_hit_rate"] == run["hit_rate"]


def test_plot_format_follows_the_extension_and_is_png_without_one(small_trace, tmp_path,
                                                                  monkeypatch):
    from prefixcache.sim import report

    no_extension = tmp_path / "curve"
    assert main(["replay", str(small_trace), "--sweep", "100", "--block-size", "512",
                 "--policy", "lru", "--no-belady", "--plot", str(no_extension),
                 "--quiet"]) == 0
    assert no_extension.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "curve.png").exists()
    assert report.plot_format("a/b.PDF") == "pdf"
    # pgf needs a TeX system to write: without one it is not offered.
    monkeypatch.setattr(report.shutil, "which", lambda name: None)
    assert "pgf" not in report.plot_formats() and "svg" in report.plot_formats()
    with pytest.raises(ValueError, match="cannot draw a plot as 'pgf'"):
        report.plot_format("curve.pgf")


def test_timeline_mode(small_trace, capsys):
    assert main(["replay", str(small_trace), "--num-blocks", "3000", "--block-size", "512",
                 "--timeline", "--decode-tokens-per-s", "5", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "timeline" in text and "mean wait" in text


def test_token_id_trace(tmp_path, capsys):
    path = write_lines(tmp_path / "t.jsonl", [list(range(40)), list(range(30)) + [99]])
    assert main(["replay", str(path), "--num-blocks", "16", "--block-size", "8",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^hit tokens +24$", out, re.M)  # the second hits three 8-token blocks


def test_dash_replays_a_trace_from_standard_input(small_trace, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(small_trace.read_bytes())))
    assert main(["replay", "-", "--num-blocks", "2000", "--block-size", "512",
                 "--quiet"]) == 0
    from_stdin = capsys.readouterr().out
    assert main(["replay", str(small_trace), "--num-blocks", "2000", "--block-size", "512",
                 "--quiet"]) == 0
    from_file = capsys.readouterr().out
    hit_rate = re.compile(r"^token hit rate .*$", re.M)
    assert re.search(r"^requests +200$", from_stdin, re.M)
    assert hit_rate.search(from_stdin).group() == hit_rate.search(from_file).group()


def test_clear_errors(tmp_path, capsys):
    missing = tmp_path / "absent.jsonl"
    assert main(["replay", str(missing), "--num-blocks", "8"]) == 1
    err = capsys.readouterr().err
    assert "no such trace file" in err and "Traceback" not in err

    bad = write_lines(tmp_path / "bad.jsonl", [[1, 2, 3], "{oops", [4, 5]])
    assert main(["replay", str(bad), "--num-blocks", "8", "--block-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:2: not valid JSON" in err and "Traceback" not in err

    assert main(["replay", str(bad), "--num-blocks", "8", "--block-size", "2",
                 "--skip-bad-lines", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 malformed line" in captured.err
    assert re.search(r"^requests +2$", captured.out, re.M)

    deep = write_lines(tmp_path / "deep.jsonl", [[1, 2, 3], "[" * 100_000])
    assert main(["replay", str(deep), "--num-blocks", "8", "--block-size", "2",
                 "--skip-bad-lines", "--quiet"]) == 0
    assert "deep.jsonl:2: not valid JSON (nested too deeply)" in capsys.readouterr().err

    assert main(["replay", str(bad), "--num-blocks", "8", "--timeline", "--skip-bad-lines"]) == 1
    assert "needs a 'timestamp'" in capsys.readouterr().err

    huge = write_lines(tmp_path / "huge.jsonl", [
        {"input_length": 10, "output_length": 10**30, "hash_ids": [1]},
        {"input_length": 10, "output_length": 10**10, "hash_ids": [1]},
        [1, 2, 3]])
    assert main(["replay", str(huge), "--num-blocks", "8", "--no-decode-slots"]) == 1
    err = capsys.readouterr().err
    assert "huge.jsonl:1: 'output_length' must be at most 16,777,216" in err
    assert main(["replay", str(huge), "--num-blocks", "8", "--block-size", "2",
                 "--no-decode-slots", "--skip-bad-lines", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "skipped 2 malformed line" in captured.err
    assert re.search(r"^requests +1$", captured.out, re.M)

    mooncake = write_lines(tmp_path / "m.jsonl", [
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}])
    assert main(["replay", str(mooncake), "--num-blocks", "8", "--block-size", "100"]) == 1
    assert "does not divide" in capsys.readouterr().err


def test_running_out_of_memory_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    def replay(*args, **kwargs):
        raise MemoryError
    # Every replay of the command goes through replay_all.
    monkeypatch.setattr(parallel_replays, "replay", replay)
    path = write_lines(tmp_path / "t.jsonl", [[1, 2]])
    assert main(["replay", str(path), "--num-blocks", "8", "--quiet"]) == 1
    assert capsys.readouterr().err == ("prefixcache replay: error: out of memory (the inputs "
                                       "need more memory than this machine has)\n")


def test_closed_or_unreadable_standard_streams_and_files_are_one_line_errors(tmp_path, capsys,
                                                                             monkeypatch):
    path = write_lines(tmp_path / "t.jsonl", [[1, 2]])
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stdin", None)  # what Python sets when fd 0 is closed
        assert main(["replay", "-", "--num-blocks", "8"]) == 1
    assert capsys.readouterr().err == ("prefixcache replay: error: <stdin>: standard input "
                                       "is closed\n")
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", None)
        assert main(["replay", str(path), "--num-blocks", "8"]) == 1
    assert capsys.readouterr().err == ("prefixcache replay: error: standard output is "
                                       "closed: nowhere to print the figures\n")
    if os.path.exists("/proc/self/mem"):  # opens, but reading it fails
        assert main(["replay", "/proc/self/mem", "--num-blocks", "8"]) == 1
        assert "cannot read trace after line 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--num-blocks", "0"], "must be 1 to"),
    (["--sweep", "10,x"], "not an integer"),
    (["--sweep", "10,0%"], "must be a finite number > 0"),
    (["--sweep", "x%"], "not a number"),
    (["--sweep", ","], "give at least one capacity"),
    (["--num-blocks", "8", "--policy", "mru"], "unknown policy 'mru'"),
    (["--num-blocks", "8", "--sweep", "8"], "not allowed with"),
    ([], "one of the arguments --num-blocks --sweep is required"),
    (["--num-blocks", "8", "--plot", "x.png"], "--plot needs --sweep"),
    (["--num-blocks", "8", "--decode-tokens-per-s", "5"], "applies to --timeline only"),
    (["--num-blocks", "8", "--timeline", "--decode-tokens-per-s", "1e-320"],
     "must be a finite number >= 0.001, got 1e-320"),
    (["--sweep", "8", "--no-belady", "--policy", "belady"], "nothing to replay"),
    (["--sweep", "8", "--plot", "curve.foo"], "cannot draw a plot as 'foo'"),
    (["--sweep", "8", "--jobs", "0"], "must be >= 1"),
])
def test_usage_errors(tmp_path, capsys, argv, message):
    path = write_lines(tmp_path / "t.jsonl", [[1, 2]])
    with pytest.raises(SystemExit) as info:
        main(["replay", str(path), *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_explains_formats_and_modes(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help lines wrap anywhere
    for phrase in ("Mooncake", "prompt_token_ids", "--timeline", "Belady", "--sweep",
                   "--kv-bytes-per-token", "--skip-bad-lines", "rejected", "standard input",
                   "the format follows the extension", f"{MAX_REQUEST_TOKENS:,} tokens",
                   "- writes them to standard output"):
        assert phrase in text


def test_unwritable_outputs_fail_before_the_replay(small_trace, tmp_path, capsys):
    existing = tmp_path / "old.json"
    existing.write_text("keep me")
    cases = [
        (["--json", str(tmp_path)], "--json: cannot write", "Is a directory"),
        (["--json", str(tmp_path / "no" / "x.json")], "--json: cannot write",
         "No such file"),
        (["--plot", str(tmp_path / "no" / "x.png")], "--plot: cannot write", "No such file"),
    ]
    for extra, message, reason in cases:
        assert main(["replay", str(small_trace), "--sweep", "100,200", "--block-size", "512",
                     "--quiet", *extra]) == 1
        captured = capsys.readouterr()
        assert message in captured.err and reason in captured.err
        assert captured.out == ""  # failed before replaying anything
    # a probe that passes leaves no new file behind and an existing one untouched
    fresh = tmp_path / "fresh.json"
    for good in (existing, fresh):
        assert main(["replay", str(small_trace), "--sweep", "100", "--block-size", "512",
                     "--quiet", "--json", str(good), "--plot", str(tmp_path / "no" / "x.png"),
                     ]) == 1
    assert existing.read_text() == "keep me" and not fresh.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_json_to_a_named_pipe_is_not_probed(tmp_path, capsys):
    """Probing a FIFO by opening and closing it would end its reader's input before the
    JSON came (or wait for a reader): its reader must get the JSON whole."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    path = write_lines(tmp_path / "t.jsonl", [[1, 2]])
    exit_codes = []

    def run_replay():
        try:
            exit_codes.append(main(["replay", str(path), "--num-blocks", "16", "--quiet",
                                    "--json", str(fifo)]))
        finally:
            # Were the replay to end without writing the FIFO, the read below would wait
            # for a writer forever: open it once more, which ends a waiting read.
            with contextlib.suppress(OSError):  # no reader waiting: nothing to release
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    replay = threading.Thread(target=run_replay)
    replay.start()
    received = fifo.read_text()
    if not received:  # a probe ended the input; read again so that the replay can finish
        fifo.read_text()
    replay.join()
    assert exit_codes == [0]
    assert json.loads(received)["runs"][0]["num_blocks"] == 16
    fifo.chmod(0o444)
    if not os.access(fifo, os.W_OK):  # root may write anyway
        assert main(["replay", str(path), "--num-blocks", "16", "--json", str(fifo)]) == 1
        assert "--json: cannot write" in capsys.readouterr().err


def test_outputs_that_would_overwrite_the_trace_or_each_other_are_refused(small_trace,
                                                                         tmp_path, capsys):
    original = small_trace.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(small_trace)
    png_named_trace = tmp_path / "trace.png"  # a plot path must have an image extension
    png_named_trace.write_bytes(original)
    out = tmp_path / "out.png"
    cases = [
        (small_trace, ["--num-blocks", "8", "--json", str(small_trace)], "--json",
         "the trace"),
        (small_trace, ["--num-blocks", "8", "--json", str(link)], "--json", "the trace"),
        (small_trace, ["--num-blocks", "8", "--json",
                       str(tmp_path / ".." / tmp_path.name / small_trace.name)],
         "--json", "the trace"),
        (png_named_trace, ["--sweep", "8", "--plot", str(png_named_trace)], "--plot",
         "the trace"),
        (small_trace, ["--sweep", "8", "--json", str(out), "--plot", str(out)], "--plot",
         "--json"),
    ]
    for trace, extra, name, victim in cases:
        with pytest.raises(SystemExit) as info:
            main(["replay", str(trace), "--block-size", "512", "--quiet", *extra])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {name} " in err and f"is the same file as {victim}" in err
        assert "Traceback" not in err
    assert small_trace.read_bytes() == png_named_trace.read_bytes() == original
    assert not out.exists()


def test_a_reader_that_goes_away_stops_the_command_quietly(small_trace):
    """``replay ... | head -3``: once the pipe is closed, exit 141 (128 + SIGPIPE) with
    nothing on stderr — no BrokenPipeError, none again at interpreter exit."""
    result = run_with_reader_gone(
        ["replay", str(small_trace), "--sweep", "100,200", "--block-size", "512",
         "--no-belady", "--quiet"], timeout=120)
    assert result.stderr == ""
    assert result.returncode == 141


def test_json_is_strict_and_not_written_if_a_figure_is_not_finite(tmp_path, capsys,
                                                                  monkeypatch):
    real_replay = parallel_replays.replay

    def replay(*args, **kwargs):
        result = real_replay(*args, **kwargs)
        result.mean_usage = float("nan")
        return result
    monkeypatch.setattr(parallel_replays, "replay", replay)
    path = write_lines(tmp_path / "t.jsonl", [[1, 2]])
    out = tmp_path / "out.json"
    assert main(["replay", str(path), "--num-blocks", "8", "--quiet", "--json", str(out)]) == 1
    assert "--json: Out of range float values are not JSON compliant" in capsys.readouterr().err
    assert not out.exists()


def test_json_dash_writes_the_json_alone_to_standard_output(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_lines(tmp_path / "t.jsonl", [list(range(40)), list(range(30)) + [99]])
    assert main(["replay", str(path), "--num-blocks", "16", "--block-size", "8", "--json", "-",
                 "--quiet"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["runs"][0]["num_hit_tokens"] == 24
    assert re.search(r"^hit tokens +24$", captured.err, re.M)  # the table, out of the way
    assert not (tmp_path / "-").exists()


def test_json_dash_with_standard_error_closed_keeps_the_table_out_of_the_json(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)  # as when started with ``2>&-``
    path = write_lines(tmp_path / "t.jsonl", [[1, 2]])
    assert main(["replay", str(path), "--num-blocks", "16", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["num_blocks"] == 16


def test_probing_a_dangling_link_leaves_no_file_behind(tmp_path):
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "missing.json")
    assert replay_cmd._why_not_writable(str(link)) is None
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
    assert link.is_symlink() and not link.exists()


def test_json_to_a_pipe_whose_reader_goes_away_stops_quietly(tmp_path, capsys, monkeypatch):
    """``--json /dev/stdout | head -1``: the reader can leave after the table, while the
    JSON is written to its own handle on the pipe; that stops quietly too (exit 141)."""
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")
    def open_output(path, mode="r", *args, **kwargs):  # the JSON's; not the probe's "ab"
        return ClosedPipe() if mode == "w" else open(path, mode, *args, **kwargs)
    monkeypatch.setattr(replay_cmd, "open", open_output, raising=False)
    path = write_lines(tmp_path / "t.jsonl", [[1, 2]])
    assert main(["replay", str(path), "--num-blocks", "16", "--quiet",
                 "--json", str(tmp_path / "out.json")]) == 141
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("tty,quiet,shown", [(True, False, True), (True, True, False),
                                             (False, False, False)])
def test_progress_bar_only_on_a_terminal_and_not_with_quiet(small_trace, capsys, monkeypatch,
                                                            tty, quiet, shown):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    argv = ["replay", str(small_trace), "--num-blocks", "2000", "--block-size", "512"]
    assert main(argv + (["--quiet"] if quiet else [])) == 0
    err = capsys.readouterr().err
    assert ("hashing" in err and "replaying" in err and "200/200" in err) == shown
    assert ("reading" in err) == shown  # the trace's bytes, before anything else
    if not shown:
        assert err == ""


def test_a_trace_path_that_is_not_utf8_names_the_plot_and_the_json(tmp_path, capsys):
    path = write_lines(tmp_path / os.fsdecode(b"t\xff.jsonl"), [[1, 2, 3, 4], [1, 2, 3, 5]])
    out, plot = tmp_path / "out.json", tmp_path / "curve.svg"
    assert main(["replay", str(path), "--sweep", "2,4", "--block-size", "2", "--quiet",
                 "--json", str(out), "--plot", str(plot)]) == 0
    assert json.loads(out.read_text())["trace"] == str(tmp_path / "t\ufffd.jsonl")
    assert "t\ufffd.jsonl: 2 requests" in plot.read_text(encoding="utf-8")  # the title


def test_discarding_a_closed_standard_output_is_a_no_op(monkeypatch):
    from prefixcache.entrypoints.cli import discard_stdout

    monkeypatch.setattr(sys, "stdout", None)  # as when started with ``>&-``
    discard_stdout()  # must not raise: there is nothing buffered to discard
