"""The suite benchmark: its check of ``adaptive`` against its candidate orders followed
alone, its replay modes, and its handling of inputs it cannot use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import eviction_suite
from benchmarks.eviction_suite import (
    ADAPTIVE_VARIANTS,
    QUICK_FRACTIONS,
    REGISTERED,
    ReplayMode,
    best_candidate_figures,
    combine,
    evaluate,
    sweep_adaptive_with,
)
from prefixcache.core import EVICTION_POLICIES
from prefixcache.core.eviction.adaptive import CANDIDATES, AdaptiveFreeBlockQueue, Candidate
from prefixcache.entrypoints.cli import main as cli_main
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.parallel_replays import can_fork
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.sweep import sweep
from prefixcache.sim.trace import format_line, load_trace
from prefixcache.sim.workloads import generate_requests, write_trace
from tests.processes import REPO_ROOT
from tests.sim.helpers import bailian_line_of, mooncake_as_bailian, write_lines


def test_best_candidate_at_the_widest_gap_and_adaptive_shortfall():
    capacities = [10, 20, 40]
    lru, belady = [0.10, 0.20, 0.30], [0.30, 0.50, 0.40]  # gap widest at 20 blocks
    candidates = {"a": [0.15, 0.26, 0.30], "b": [0.12, 0.29, 0.36]}
    adaptive = [0.15, 0.27, 0.33]
    figures = best_candidate_figures(capacities, lru, belady, adaptive, candidates)
    assert figures["candidate"] == "b"
    assert figures["fraction_of_gap_closed"] == pytest.approx(0.3)
    # Short of the best candidate by 2 points at 20 blocks and 3 at 40: the most is 3.
    assert figures["max_adaptive_shortfall_points"] == pytest.approx(3.0)
    assert figures["max_adaptive_shortfall_at_blocks"] == 40


def test_no_shortfall_when_adaptive_is_never_below_the_best_candidate():
    figures = best_candidate_figures([10, 20], [0.1, 0.2], [0.5, 0.5], [0.3, 0.4],
                                     {"a": [0.3, 0.35], "b": [0.2, 0.4]})
    assert figures["max_adaptive_shortfall_points"] == 0.0
    assert figures["max_adaptive_shortfall_at_blocks"] is None


def test_the_shortfall_is_zero_not_negative_when_adaptive_is_ahead_everywhere():
    figures = best_candidate_figures([10, 20], [0.1, 0.2], [0.5, 0.5], [0.4, 0.45],
                                     {"a": [0.3, 0.35], "b": [0.2, 0.4]})
    assert figures["max_adaptive_shortfall_points"] == 0.0
    assert figures["max_adaptive_shortfall_at_blocks"] is None


@pytest.fixture(scope="module")
def chat_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("suite") / "chat.jsonl"
    with path.open("w") as handle:
        write_trace(generate_requests("chat", 3, 250), handle, "mooncake", 3)
    return load_trace(path)


def test_a_candidate_alone_is_adaptive_that_never_switches(chat_trace):
    prepared = prepare_trace(chat_trace, TraceExpander(512))
    candidate = CANDIDATES[-1]
    followed = []

    class Recording(AdaptiveFreeBlockQueue):
        def _follow(self, candidate):
            followed.append(candidate)
            super()._follow(candidate)

    EVICTION_POLICIES["adaptive"] = Recording
    try:
        sweep_adaptive_with(prepared, [20, 60], {"candidates": (candidate,)})
        assert set(followed) == {candidate}
        assert Recording.candidates == CANDIDATES  # the override is undone
        followed.clear()
        sweep(prepared, [20, 60], ["adaptive"], with_belady=False)
        assert len(set(followed)) > 1  # the registered candidates: it does switch here
    finally:
        EVICTION_POLICIES["adaptive"] = AdaptiveFreeBlockQueue


def test_suite_reports_every_candidate_alone_and_the_best(chat_trace):
    figures = evaluate(chat_trace, QUICK_FRACTIONS, ["lru", "adaptive"], [],
                       candidates_alone=True)
    alone = figures["candidates_alone"]
    assert list(alone) == [candidate.label for candidate in CANDIDATES]
    best = figures["best_candidate_alone"]
    assert best["fraction_of_gap_closed"] == max(
        entry["fraction_of_gap_closed"] for entry in alone.values())
    assert alone[best["candidate"]]["fraction_of_gap_closed"] == best["fraction_of_gap_closed"]
    assert AdaptiveFreeBlockQueue.candidates == CANDIDATES
    assert "candidates_alone" not in evaluate(chat_trace, QUICK_FRACTIONS,
                                              ["lru", "adaptive"], [])


@pytest.mark.parametrize("mode", [ReplayMode(concurrency=8), ReplayMode(timeline=True)])
def test_every_replay_of_a_mode_overlaps_requests_as_the_replayer_does(chat_trace, mode):
    figures = evaluate(chat_trace, QUICK_FRACTIONS, ["lru", "adaptive"], ["ghost-2"],
                       candidates_alone=True, mode=mode)
    prepared = prepare_trace(chat_trace, TraceExpander(512))
    capacities = figures["capacities_blocks"]
    direct = sweep(prepared, capacities, ["lru", "adaptive"], concurrency=mode.concurrency,
                   timeline=mode.timeline)
    assert figures["policy_hit_rates"] == {
        policy: [round(rate, 5) for rate in rates]
        for policy, rates in direct.policy_to_hit_rates.items()}
    assert figures["belady_hit_rates"] == [round(r, 5) for r in direct.belady_hit_rates]
    # The variants and the candidates alone are replayed in the same mode.
    ghost_2 = sweep_adaptive_with(prepared, capacities, ADAPTIVE_VARIANTS["ghost-2"], mode=mode)
    assert figures["adaptive_by_variant"]["ghost-2"]["hit_rates"] == [
        round(rate, 5) for rate in ghost_2]
    label = CANDIDATES[-1].label
    alone = sweep_adaptive_with(prepared, capacities, {"candidates": (CANDIDATES[-1],)},
                                mode=mode)
    assert figures["candidates_alone"][label]["hit_rates"] == [round(r, 5) for r in alone]
    # Overlapping requests change what hits: the mode is not ignored.
    one_at_a_time = evaluate(chat_trace, QUICK_FRACTIONS, ["lru", "adaptive"], [])
    assert one_at_a_time["policy_hit_rates"] != figures["policy_hit_rates"]


def test_the_output_names_the_replay_mode(capsys):
    _, output, _ = run_main(capsys, [*TINY_RUN, "--concurrency", "4"])
    assert output["mode"] == "sequential, concurrency 4, decode slots reserved"
    _, output, _ = run_main(capsys, [*TINY_RUN, "--timeline"])
    assert output["mode"] == "timeline, decode slots reserved"
    _, output, _ = run_main(capsys, TINY_RUN)
    assert output["mode"] == "sequential, concurrency 1, decode slots reserved"


@pytest.mark.skipif(not can_fork(), reason="workers are forked (POSIX only)")
def test_suite_figures_are_the_same_with_replays_in_workers(chat_trace, chat_figures):
    # A variant's class overrides reach the workers, which are forked after they are set.
    in_workers = json.loads(json.dumps(evaluate(
        chat_trace, QUICK_FRACTIONS, ["lru", "adaptive"], ["ghost-2"], jobs=3)))
    untimed = [{key: value for key, value in figures.items()
                if key not in ("replay_seconds", "adaptive_over_lru_replay_time")}
               for figures in (in_workers, chat_figures)]
    assert untimed[0] == untimed[1]
    variants = chat_figures["adaptive_by_variant"]
    assert variants["ghost-2"]["hit_rates"] != variants[REGISTERED]["hit_rates"]


SETTINGS = {"block_size": 512, "mode": "sequential", "capacity_fractions_of_working_set":
            list(QUICK_FRACTIONS), "adaptive_shadow_entries": 128, "lofo_variants": [],
            "candidates_alone": False}


def write_output(path, traces, **settings):
    path.write_text(json.dumps({**SETTINGS, **settings, "traces": traces}))
    return path


@pytest.fixture(scope="module")
def chat_figures(chat_trace):
    """One trace's figures as the suite reports them."""
    return json.loads(json.dumps(evaluate(chat_trace, QUICK_FRACTIONS, ["lru", "adaptive"],
                                          ["ghost-2"])))


@pytest.mark.parametrize("content,message", [
    (b"\x93 not text", "not UTF-8 text"),
    (b"{not json", "not JSON"),
    (b'{"a": 1}', "not an output of this script"),
    (b"[1, 2]", "not an output of this script"),
])
def test_combine_refuses_a_file_that_is_not_an_output(tmp_path, content, message):
    path = tmp_path / "part.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        combine([path])
    with pytest.raises(ValueError, match="cannot read it .No such file"):
        combine([tmp_path / "missing.json"])


def test_combine_refuses_outputs_that_differ_or_name_a_trace_twice(tmp_path, chat_figures):
    a = write_output(tmp_path / "a.json", {"chat": chat_figures})
    b = write_output(tmp_path / "b.json", {"rag": chat_figures}, lofo_variants=["ghost-2"])
    with pytest.raises(ValueError, match="measured with different lofo_variants"):
        combine([a, b])
    c = write_output(tmp_path / "c.json", {"chat": chat_figures})  # the same name
    with pytest.raises(ValueError, match="the same trace in more than one: chat"):
        combine([a, c])
    random = {"family": "chat", "seed": 1, "parameters": {}}
    d = write_output(tmp_path / "d.json", {"random-01-chat": {**chat_figures, **random}})
    with_2q = {**chat_figures, **random, "policy_hit_rates": {
        **chat_figures["policy_hit_rates"], "2q": chat_figures["belady_hit_rates"]}}
    e = write_output(tmp_path / "e.json", {"random-02-chat": with_2q})
    with pytest.raises(ValueError, match="random traces replayed with different policies"):
        combine([d, e])


def test_combine_summarises_the_traces_of_every_output(tmp_path, capsys, chat_figures):
    a = write_output(tmp_path / "a.json", {"chat": chat_figures}, lofo_variants=["ghost-2"])
    b = write_output(tmp_path / "b.json", {"rag": chat_figures}, lofo_variants=["ghost-2"])
    assert combine([a, b]) == 0
    output = json.loads(capsys.readouterr().out)
    assert list(output["summary"]) == list(output["leave_one_out"]) == ["chat", "rag"]


def without(figures: dict, *path: str) -> dict:
    """``figures`` (copied) without the key at ``path``."""
    figures = json.loads(json.dumps(figures))
    inner = figures
    for key in path[:-1]:
        inner = inner[key]
    del inner[path[-1]]
    return figures


@pytest.mark.parametrize("make_traces,settings,message", [
    (lambda f: {}, {}, "no traces"),
    (lambda f: {"a": 5}, {}, "trace 'a': not an object"),
    (lambda f: {"a": {}}, {}, "trace 'a': no widest_gap, min_adaptive_minus_lru_points"),
    (lambda f: {"a": f, "b": without(f, "widest_gap")}, {}, "trace 'b': no widest_gap"),
    (lambda f: {"a": without(f, "widest_gap", "adaptive_fraction_of_gap_closed")}, {},
     "no adaptive_fraction_of_gap_closed"),
    (lambda f: {"a": {**f, "belady_hit_rates": [0.5]}}, {}, "one per capacity"),
    (lambda f: {"a": {**f, "belady_hit_rates": "0.5"}}, {}, "not a list of hit rates"),
    (lambda f: {"a": without(f, "adaptive_by_variant", "ghost-2")},
     {"lofo_variants": ["ghost-2"]}, "variant 'ghost-2'"),
    (lambda f: {"a": f}, {"lofo_variants": "ghost-2"}, "lofo_variants is not a list"),
])
def test_combine_refuses_an_output_without_what_the_summary_reads(
        tmp_path, chat_figures, make_traces, settings, message):
    path = write_output(tmp_path / "part.json", make_traces(chat_figures), **settings)
    with pytest.raises(ValueError, match=f"part.json: not an output of this script .*{message}"):
        combine([path])


def test_combine_refuses_an_output_without_its_settings(tmp_path, chat_figures):
    path = tmp_path / "part.json"
    path.write_text(json.dumps({"traces": {}}))
    with pytest.raises(ValueError, match="no block_size, mode, .*candidates_alone"):
        combine([path])


@pytest.mark.parametrize("argv,message", [
    (["--policies", "lru,adaptive,nope"], "unknown online policy nope"),
    (["--policies", "lru,adaptive,belady"], "unknown online policy belady"),
    (["--policies", "lru,adaptive,dead-first"], "unknown online policy dead-first"),
    (["--seed", "-1"], "argument --seed: must be >= 0"),
    (["--trace", "{five}", "--trace-block-size", "100"],
     "--trace-block-size 100: the suite replays at 512-token blocks"),
    (["--trace", "{bad}", "--families", ""], "bad.jsonl:6: not valid JSON"),
    (["--shadow-entries", "0"], "must be >= 1"),
    (["--combine", "{missing}"], "cannot read it"),
    (["--combine", "{no_figures}"], "no_figures.json: not an output of this script"),
    (["--trace", "{empty}", "--families", ""], "no requests in the trace"),
    (["--trace", "{tmp}"], "Is a directory"),
    (["--families", "", "--trace", ""], "nothing to measure"),
    (["--families", " ,", "--trace", "", "--random-traces", "0"], "nothing to measure"),
    (["--families", "", "--trace", "", "--random-merges", "0"], "nothing to measure"),
    (["--random-merges", "1", "--random-families", "chat,chat"],
     "--random-merges needs two different --random-families"),
    (["--random-merges", "-1"], "--random-merges at least 0"),
    (["--trace", "", "--split-trace", "3"], "--split-trace 3 needs a trace to split"),
    (["--trace", "{five}", "--split-trace", "6"], "the trace has only 5 requests"),
    (["--num-requests", "10000001"], "--num-requests must be 1 to 10,000,000"),
    (["--num-requests", "0"], "--num-requests must be 1 to 10,000,000"),
    (["--concurrency", "0"], "must be >= 1"),
    (["--concurrency", "2", "--timeline"], "not allowed with argument"),
    (["--families", "", "--trace", "{untimed}", "--timeline"], "needs a 'timestamp'"),
])
def test_bad_arguments_end_in_a_usage_error_before_any_replay(tmp_path, monkeypatch, capsys,
                                                               argv, message):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "untimed.jsonl").write_text("[1, 2, 3]\n")
    with (tmp_path / "five.jsonl").open("w") as handle:
        write_trace(generate_requests("chat", 3, 5), handle, "mooncake", 3)
    write_output(tmp_path / "no_figures.json", {"a": {}})
    (tmp_path / "bad.jsonl").write_text((tmp_path / "five.jsonl").read_text() + "{oops\n")
    argv = [arg.format(missing=tmp_path / "missing.json", empty=tmp_path / "empty.jsonl",
                       five=tmp_path / "five.jsonl", tmp=tmp_path, bad=tmp_path / "bad.jsonl",
                       untimed=tmp_path / "untimed.jsonl",
                       no_figures=tmp_path / "no_figures.json") for arg in argv]

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed before the usage error")

    monkeypatch.setattr(eviction_suite, "sweep", no_replay)
    with pytest.raises(SystemExit) as exit_info:
        eviction_suite.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:")
    assert " error: " in err.splitlines()[-1]
    assert message in err.splitlines()[-1]


def test_skip_bad_lines_measures_the_trace_without_them(tmp_path, capsys):
    path = tmp_path / "five.jsonl"
    with path.open("w") as handle:
        write_trace(generate_requests("chat", 3, 5), handle, "mooncake", 3)
    _, clean, _ = run_main(capsys, ["--families", "", "--trace", str(path), "--quick",
                                    "--lofo-variants", ""])
    with path.open("a") as handle:
        handle.write("{oops\n")
    _, output, err = run_main(capsys, ["--families", "", "--trace", str(path), "--quick",
                                       "--lofo-variants", "", "--skip-bad-lines"])
    assert f"skipped 1 malformed line(s) of {path}; first: {path}:6:" in err
    figures, clean_figures = output["traces"]["five"], clean["traces"]["five"]
    assert (figures["num_bad_lines"], clean_figures["num_bad_lines"]) == (1, 0)
    for key in ("capacities_blocks", "policy_hit_rates", "belady_hit_rates",
                "infinite_hit_rate"):
        assert figures[key] == clean_figures[key]


def test_a_trace_split_into_as_many_parts_as_requests_is_measured(tmp_path, capsys):
    path = tmp_path / "five.jsonl"
    with path.open("w") as handle:
        write_trace(generate_requests("chat", 3, 5), handle, "mooncake", 3)
    _, output, err = run_main(capsys, ["--families", "", "--trace", str(path), "--quick",
                                       "--split-trace", "5", "--lofo-variants", ""])
    assert [t["num_requests"] for t in output["traces"].values()] == [1] * 5
    # Progress on stderr, a line per part as it is done.
    assert err.splitlines() == [f"five-{part}/5: done" for part in range(1, 6)]
    _, output, err = run_main(capsys, ["--families", "", "--trace", str(path), "--quick",
                                       "--lofo-variants", ""])
    assert list(output["traces"]) == ["five"]
    assert err == "five: done\n"


def test_ctrl_c_ends_in_exit_130_and_a_line_not_a_traceback(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eviction_suite, "sweep", interrupted)
    assert eviction_suite.main(TINY_RUN) == 130
    assert capsys.readouterr() == ("", "interrupted\n")


def test_a_closed_stdout_ends_quietly_in_exit_141(tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone, as after ``| head -c1``
    try:
        result = subprocess.run(
            [sys.executable, str(REPO_ROOT / "benchmarks" / "eviction_suite.py"), *TINY_RUN],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
            cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    finally:
        os.close(write_end)
    assert result.returncode == 141
    assert result.stderr == "chat: done\n"  # the progress, and no traceback


#: A run of seconds: one small family, three capacities, no variants.
TINY_RUN = ["--families", "chat", "--trace", "", "--num-requests", "100", "--quick",
            "--lofo-variants", ""]


def run_main(capsys, argv):
    """``main(argv)``'s exit code, parsed stdout, and stderr."""
    exit_code = eviction_suite.main(argv)
    out, err = capsys.readouterr()
    return exit_code, json.loads(out), err


def test_policies_are_read_with_spaces_and_repeats(capsys):
    exit_code, output, _ = run_main(
        capsys, [*TINY_RUN, "--policies", " lru, adaptive,lru,,adaptive "])
    assert exit_code == 0
    assert list(output["traces"]["chat"]["policy_hit_rates"]) == ["lru", "adaptive"]


@pytest.mark.parametrize("variant, reach", [("ghost-2", 2), ("ghost-4", 4)])
def test_one_reach_variants_change_only_the_reach(variant, reach):
    """A one-reach variant is every segment order of the registered set at that reach,
    each once, and the liveness order as registered: it differs from the registered
    candidates in the reach alone."""
    candidates = ADAPTIVE_VARIANTS[variant]["candidates"]
    segment_orders = [c for c in candidates if not c.liveness]
    assert all(c.ghost_factor == reach for c in segment_orders)
    assert ({(c.protected_fraction, c.low_reuse_first) for c in segment_orders}
            == {(c.protected_fraction, c.low_reuse_first) for c in CANDIDATES
                if not c.liveness})
    assert len(segment_orders) == len({(c.protected_fraction, c.low_reuse_first)
                                       for c in segment_orders})
    assert [c for c in candidates if c.liveness] == [c for c in CANDIDATES if c.liveness]
    assert Candidate(0.0, False, liveness=True) in candidates


@pytest.mark.parametrize("variant", sorted(set(ADAPTIVE_VARIANTS) - {REGISTERED}))
def test_every_variant_changes_a_setting_the_policy_has(variant):
    """A variant overrides only class attributes ``adaptive`` has, each with a value
    other than the registered one: a variant that changed nothing would be reported
    beside the registered policy as if it were another design."""
    adaptive_class = EVICTION_POLICIES["adaptive"]
    overrides = ADAPTIVE_VARIANTS[variant]
    assert overrides
    for name, value in overrides.items():
        assert hasattr(adaptive_class, name), name
        assert getattr(adaptive_class, name) != value, name


def test_random_merges_take_the_pairs_of_families_in_turn():
    specs = eviction_suite.random_merge_specs(4, ["chat", "rag", "chat", "agent"], seed=5)
    assert [name for name, _ in specs] == ["merge-01-chat+rag", "merge-02-chat+agent",
                                           "merge-03-rag+agent", "merge-04-chat+rag"]
    assert specs == eviction_suite.random_merge_specs(4, ["chat", "rag", "agent"], seed=5)
    assert specs != eviction_suite.random_merge_specs(4, ["chat", "rag", "agent"], seed=6)
    (_, parts), (_, later_parts) = specs[0], specs[3]
    assert parts[0][2] != later_parts[0][2]  # each merge draws parameters of its own


def test_a_random_merge_is_the_merge_of_its_parts_as_the_commands_write_them(
        tmp_path, capsys):
    exit_code, output, err = run_main(capsys, [
        "--families", "", "--trace", "", "--random-merges", "1", "--random-families",
        "rag,tenants", "--num-requests", "120", "--quick", "--lofo-variants", "",
        "--policies", "lru,adaptive"])
    assert exit_code == 0 and err == "merge-01-rag+tenants: done\n"
    figures = output["traces"]["merge-01-rag+tenants"]
    assert output["random_traces"]["num_traces"] == 1
    paths = []
    for index, part in enumerate(figures["merged_from"]):
        paths.append(str(tmp_path / f"part{index}.jsonl"))
        assert cli_main(["synth", part["family"], "--seed", str(part["seed"]),
                         "--num-requests", "120", "-o", paths[-1],
                         *[arg for name, value in part["parameters"].items()
                           for arg in ("--param", f"{name}={value}")]]) == 0
    merged = tmp_path / "merged.jsonl"
    assert cli_main(["merge", *paths, "--max-requests", "120", "-o", str(merged)]) == 0
    prepared = prepare_trace(load_trace(merged), TraceExpander(512))
    again = sweep(prepared, figures["capacities_blocks"], ["lru"])
    assert [round(r, 5) for r in again.policy_to_hit_rates["lru"]] == (
        figures["policy_hit_rates"]["lru"])
    assert [round(r, 5) for r in again.belady_hit_rates] == figures["belady_hit_rates"]


def test_a_bailian_trace_is_measured_as_its_mooncake_spelling(tmp_path, capsys, chat_trace):
    """The same sharing in 16-token ids: at the suite's 512-token blocks every figure
    that does not sample hashes (LRU, 2q, Belady, the infinite cache) is the same."""
    requests = chat_trace.requests
    bailian_path = write_lines(tmp_path / "bailian.jsonl", [
        bailian_line_of(mooncake_as_bailian(r), n) for n, r in enumerate(requests)])
    mooncake_path = tmp_path / "mooncake.jsonl"
    mooncake_path.write_text("".join(format_line(r) + "\n" for r in requests))
    figures = {}
    for name, trace in (("bailian", bailian_path), ("mooncake", mooncake_path)):
        _, output, _ = run_main(capsys, ["--families", "", "--trace", str(trace), "--quick",
                                         "--policies", "lru,2q,adaptive",
                                         "--lofo-variants", ""])
        (figures[name],) = output["traces"].values()
    bailian, mooncake = figures["bailian"], figures["mooncake"]
    for key in ("num_requests", "working_set_blocks", "capacities_blocks",
                "infinite_hit_rate", "belady_hit_rates"):
        assert bailian[key] == mooncake[key]
    for policy in ("lru", "2q"):
        assert bailian["policy_hit_rates"][policy] == mooncake["policy_hit_rates"][policy]
    assert mooncake["infinite_hit_rate"] > 0


def test_the_progress_total_counts_every_request_of_every_replay(chat_trace):
    class Bar:
        total, done = None, 0

        def refresh(self):
            pass

        def update(self, n):
            self.done += n

    bar = Bar()
    figures = evaluate(chat_trace, QUICK_FRACTIONS, ["lru", "adaptive"], ["margin-5"],
                       candidates_alone=True, progress=bar)
    # lru, adaptive, Belady, the variant and each candidate alone, at every capacity.
    num_sweeps = 4 + len(CANDIDATES)
    assert bar.total == bar.done == (num_sweeps * len(figures["capacities_blocks"])
                                     * len(chat_trace.requests))


def test_on_a_terminal_each_trace_has_a_bar(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    _, output, err = run_main(capsys, TINY_RUN)
    assert "chat: replaying:" in err and list(output["traces"]) == ["chat"]
    assert err.endswith("chat: done\n")  # the bar is cleared; the line stays
