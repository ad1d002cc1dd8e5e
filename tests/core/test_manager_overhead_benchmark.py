"""``benchmarks/manager_overhead.py``'s eviction-policy comparison: every policy serves the
same requests side by side, with a second LRU manager as the control; which shadow caches
``adaptive`` is timed with; and its handling of arguments it cannot use and of Ctrl-C."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import manager_overhead
from benchmarks.manager_overhead import (
    BLOCK_SIZE,
    LRU_CONTROL,
    MAX_LIVE,
    MAX_POLICY_NUM_BLOCKS,
    MAX_REQUESTS_BUILT,
    NUM_DECODE_STEPS,
    PROMPT_LEN,
    SHARED_PREFIX_LEN,
    Lifecycles,
    eviction_policy_comparison,
    make_prompts,
    run_workload,
)
from prefixcache.core.eviction.adaptive import AdaptiveFreeBlockQueue
from prefixcache.core.eviction.adaptive_bookkeeping import (
    NATIVE_BOOKKEEPING,
    PythonGhostList,
    python_mark_hashed,
)
from prefixcache.core.eviction.liveness_order import (
    NATIVE_LIVENESS_SHADOW,
    PythonShadowLivenessOrder,
)
from prefixcache.core.eviction.shadow import NATIVE_SHADOWS, PythonShadowSegmentedLRU

# The smallest pool the workload fits in: the live requests beside the one admitted.
MIN_BLOCKS = (MAX_LIVE + 1) * (PROMPT_LEN + NUM_DECODE_STEPS) // BLOCK_SIZE


def test_side_by_side_comparison_reports_every_policy_and_the_control():
    prompts = make_prompts(30)
    figures = eviction_policy_comparison(prompts, repeats=3, policies=["2q", "lru"],
                                         num_warmup=10, num_blocks=MIN_BLOCKS)
    assert list(figures) == ["lru", LRU_CONTROL, "2q"]  # lru once, whatever the order asked
    assert figures["lru"]["over_lru"] == 1.0
    assert figures["lru"]["over_lru_range"] == [1.0, 1.0]
    for name in (LRU_CONTROL, "2q"):
        low, high = figures[name]["over_lru_range"]
        assert 0 < low <= figures[name]["over_lru"] <= high
        assert figures[name]["lifecycle_mean_us"] > 0
    # Every manager served every request: on this workload every policy hits the shared
    # prefix of each request after the first, and nothing else.
    expected_hits = (len(prompts) - 1) * SHARED_PREFIX_LEN
    assert {f["hit_tokens"] for f in figures.values()} == {expected_hits}


def test_lifecycles_time_only_after_the_warm_up_and_free_everything():
    prompts = make_prompts(MAX_LIVE + 4)
    run = run_workload(prompts, num_untimed=3, num_blocks=MIN_BLOCKS, hash_algo="sha256")
    assert len(run["samples"]["lifecycle"]) == len(prompts) - 3
    assert len(run["samples"]["decode_step"]) == (len(prompts) - 3) * NUM_DECODE_STEPS
    # A request is freed once more than MAX_LIVE are live: the first frees come after the
    # warm-up here, one per request from request MAX_LIVE + 1 on.
    assert len(run["samples"]["free"]) == len(prompts) - MAX_LIVE
    assert run["failed_allocations"] == 0


def test_a_leak_is_reported():
    lifecycles = Lifecycles(MIN_BLOCKS, hash_algo="sha256")
    lifecycles.serve("r0", make_prompts(1)[0])
    lifecycles.manager.block_pool.get_new_blocks(1)  # taken outside any request
    with pytest.raises(RuntimeError, match="leaked"):
        lifecycles.finish()


class Built(Exception):
    """Raised in place of building the prompts: the arguments were accepted."""


def forbid_building(monkeypatch):
    def built(*args, **kwargs):
        raise Built

    monkeypatch.setattr(manager_overhead, "make_prompts", built)


@pytest.mark.parametrize("argv,message", [
    (["--requests", "16"], f"--requests must be at least {MAX_LIVE + 1}: a request is freed"),
    (["--requests", "0"], f"--requests must be at least {MAX_LIVE + 1}"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--policy-num-blocks", "-5"], f"--policy-num-blocks must be at least {MIN_BLOCKS}"),
    (["--policy-num-blocks", str(MIN_BLOCKS - 1)], "--policy-num-blocks must be at least"),
    (["--policy-num-blocks", str(MAX_POLICY_NUM_BLOCKS + 1)],
     f"--policy-num-blocks must be at most {MAX_POLICY_NUM_BLOCKS}"),
    (["--policy-warmup", "-1"], "--policy-warmup must be at least 0"),
    (["--policies", "lru,nope"], "unknown eviction policies nope"),
    (["--policy-warmup", str(MAX_REQUESTS_BUILT - 499), "--requests", "500"],
     f"--policy-warmup plus --requests must be at most {MAX_REQUESTS_BUILT:,}"),
])
def test_bad_arguments_end_in_a_usage_error_before_anything_is_built(monkeypatch, capsys, argv,
                                                                     message):
    forbid_building(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        manager_overhead.main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert message in error
    # No flag that was not given.
    assert set(re.findall(r"--[a-z-]+", error)) <= {a for a in argv if a.startswith("--")}


@pytest.mark.parametrize("argv", [
    ["--requests", str(MAX_LIVE + 1)],
    ["--policy-num-blocks", str(MIN_BLOCKS)],
    ["--policy-num-blocks", str(MAX_POLICY_NUM_BLOCKS)],
    ["--policy-warmup", "0"],
])
def test_the_bounds_themselves_are_accepted(monkeypatch, argv):
    forbid_building(monkeypatch)
    with pytest.raises(Built):
        manager_overhead.main(argv)


def test_the_fewest_requests_accepted_are_measured(capsys):
    argv = ["--requests", str(MAX_LIVE + 1), "--repeats", "1", "--quick", "--policies", "lru",
            "--policy-num-blocks", str(MIN_BLOCKS), "--policy-warmup", "0"]
    assert manager_overhead.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    # The one request freed is summarised (with no sample, summarising it raised).
    assert set(report["results"][0]["free"]) == {"mean_us", "p50_us", "p99_us"}
    assert report["hit_tokens_as_expected"]


@pytest.mark.parametrize("flag, field, attribute, python_type, native", [
    ("", "adaptive_shadows", "shadow_type", PythonShadowSegmentedLRU, NATIVE_SHADOWS),
    ("", "adaptive_shadows", "liveness_shadow_type", PythonShadowLivenessOrder,
     NATIVE_SHADOWS and NATIVE_LIVENESS_SHADOW),
    ("--python-shadows", "adaptive_shadows", "shadow_type", PythonShadowSegmentedLRU, False),
    ("--python-shadows", "adaptive_shadows", "liveness_shadow_type",
     PythonShadowLivenessOrder, False),
    ("--python-bookkeeping", "adaptive_bookkeeping", "ghost_list_type", PythonGhostList,
     False),
    ("--python-bookkeeping", "adaptive_bookkeeping", "mark_hashed", python_mark_hashed,
     False),
    ("", "adaptive_bookkeeping", "ghost_list_type", PythonGhostList, NATIVE_BOOKKEEPING)])
def test_the_report_says_which_of_adaptives_parts_ran_in_c(monkeypatch, capsys, flag, field,
                                                           attribute, python_type, native):
    # The flags swap adaptive's class attributes for the script's process: have
    # monkeypatch put them back after the test.
    for name in ("shadow_type", "sampled_hashes", "liveness_shadow_type", "ghost_list_type",
                 "note_taken", "sort_released", "mark_hashed"):
        monkeypatch.setattr(AdaptiveFreeBlockQueue, name, AdaptiveFreeBlockQueue.__dict__[name])
    argv = ["--requests", str(MAX_LIVE + 1), "--repeats", "1", "--quick", "--policies",
            "adaptive", "--policy-num-blocks", str(MIN_BLOCKS), "--policy-warmup", "0"]
    assert manager_overhead.main(argv + [flag] * bool(flag)) == 0
    report = json.loads(capsys.readouterr().out)
    expected = "c" if native else "python"
    assert report["eviction_policy_workload"][field] == expected
    assert (getattr(AdaptiveFreeBlockQueue, attribute) is python_type) == (
        expected == "python")
    assert report["eviction_policies"]["adaptive"]["hit_tokens"] > 0


def test_policies_are_read_as_replay_reads_them(monkeypatch):
    timed = []

    def record(prompts, repeats, policies, *args, **kwargs):
        timed.append(policies)
        raise Built

    monkeypatch.setattr(manager_overhead, "best_of",
                        lambda *a, **k: {"hit_tokens": 0, "lifecycle": {"mean_us": 1.0}})
    monkeypatch.setattr(manager_overhead, "hash_encoding_comparison", lambda *a: {})
    monkeypatch.setattr(manager_overhead, "eviction_policy_comparison", record)
    with pytest.raises(Built):
        manager_overhead.main(["--quick", "--requests", str(MAX_LIVE + 1), "--policy-warmup",
                               "0", "--policies", " lru, 2q,lru,2q ,"])
    assert timed == [["lru", "2q"]]


def test_ctrl_c_ends_in_exit_130_and_a_line_not_a_traceback(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(manager_overhead, "run_workload", interrupted)
    assert manager_overhead.main(["--quick"]) == 130
    assert capsys.readouterr() == ("", "interrupted\n")
