"""Replays in worker processes: the figures of one process, errors raised at once, a
killed worker an error rather than a hang, and no worker outliving its parent."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from prefixcache.sim import parallel_replays
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.parallel_replays import ReplayWorkerDied, can_fork, replay_all
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig
from prefixcache.sim.sweep import sweep
from tests.processes import REPO_ROOT
from tests.sim.helpers import random_mooncake_trace

pytestmark = pytest.mark.skipif(not can_fork(), reason="workers are forked (POSIX only)")

TIMINGS = ("replay_seconds", "requests_per_s", "blocks_per_s")


def _without_timings(run) -> dict:
    figures = run.to_dict()
    for key in TIMINGS:
        del figures[key]
    return figures


@pytest.mark.parametrize("mode", [{"concurrency": 2}, {"timeline": True}])
def test_a_sweep_in_workers_reports_what_one_process_does(mode):
    prepared = prepare_trace(random_mooncake_trace(7, num_requests=120), TraceExpander(128))
    smallest = max(prepared.blocks_needed)
    capacities = [smallest, 2 * smallest, 4 * smallest]
    policies = ["lru", "2q", "adaptive", "dead-first"]
    steps = {1: [], 3: []}
    results = {jobs: sweep(prepared, capacities, policies, progress=steps[jobs].append,
                           jobs=jobs, **mode)
               for jobs in (1, 3)}
    alone, in_workers = results[1], results[3]
    assert in_workers.policy_to_hit_rates == alone.policy_to_hit_rates
    assert in_workers.belady_hit_rates == alone.belady_hit_rates
    assert ([_without_timings(run) for run in in_workers.runs]
            == [_without_timings(run) for run in alone.runs])
    assert in_workers.ordering_violations == []
    # The bar fills exactly once either way: a replay's worth per replay.
    assert sum(steps[3]) == sum(steps[1]) == len(capacities) * 5 * 120
    assert all(step > 0 for step in steps[3])


@pytest.fixture
def watchdog():
    """Fails the test, instead of hanging it, if it is still running after a minute."""
    def expire(signum, frame):
        raise TimeoutError("still waiting after 60 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_an_error_in_a_replay_is_raised_without_waiting_for_the_others(monkeypatch,
                                                                        watchdog):
    def stuck_or_failing(prepared, config, progress=None):
        if config.policy == "belady":
            time.sleep(600)  # a replay far longer than the test may take
        raise ValueError("this replay failed")

    # Forked workers run the module as the parent left it.
    monkeypatch.setattr(parallel_replays, "replay", stuck_or_failing)
    prepared = prepare_trace(random_mooncake_trace(2), TraceExpander(128))
    configs = [ReplayConfig(40, "belady"), ReplayConfig(40, "lru")]
    with pytest.raises(ValueError, match="this replay failed"):
        replay_all(prepared, configs, jobs=2)
    assert multiprocessing.active_children() == []


def test_a_killed_worker_is_an_error_not_a_hang(monkeypatch, watchdog):
    def killed(prepared, config, progress=None):
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(parallel_replays, "replay", killed)
    prepared = prepare_trace(random_mooncake_trace(1), TraceExpander(128))
    with pytest.raises(ReplayWorkerDied, match="killed"):
        replay_all(prepared, [ReplayConfig(40, "lru"), ReplayConfig(80, "lru")], jobs=2)
    assert multiprocessing.active_children() == []


def test_progress_moves_while_the_workers_are_still_replaying(monkeypatch, tmp_path,
                                                            watchdog):
    """Each worker counts one request, then waits for the parent to have reported it
    before replaying the rest: without progress from inside a replay, they wait for
    ever (and the watchdog fails the test)."""
    reported = tmp_path / "reported"
    real_replay = parallel_replays.replay

    def first_request_then_the_rest(prepared, config, progress=None):
        progress(1)
        while not reported.exists():
            time.sleep(0.01)
        return real_replay(prepared, config, progress)

    monkeypatch.setattr(parallel_replays, "replay", first_request_then_the_rest)
    prepared = prepare_trace(random_mooncake_trace(3, num_requests=50), TraceExpander(128))
    steps = []

    def record(num_requests):
        steps.append(num_requests)
        reported.touch()

    configs = [ReplayConfig(40, "lru"), ReplayConfig(80, "lru")]
    results = replay_all(prepared, configs, record, jobs=2)
    assert [run.num_blocks for run in results] == [40, 80]
    assert sum(steps) == 2 * (50 + 1)  # the fake's first request, then the whole replay


def test_jobs_below_one_are_refused():
    prepared = prepare_trace(random_mooncake_trace(1), TraceExpander(128))
    with pytest.raises(ValueError, match="at least 1"):
        replay_all(prepared, [ReplayConfig(40, "lru")], jobs=0)


# A parent whose workers each write their process id and then replay for ever.
_PARENT = """
import os, sys, time
from prefixcache.sim import parallel_replays
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig
from tests.sim.helpers import random_mooncake_trace

def endless(prepared, config, progress=None):
    with open(os.path.join(sys.argv[1], str(os.getpid())), "w"):
        pass
    while True:
        time.sleep(1)

parallel_replays.replay = endless
prepared = prepare_trace(random_mooncake_trace(1), TraceExpander(128))
parallel_replays.replay_all(prepared, [ReplayConfig(40, "lru"), ReplayConfig(80, "lru")],
                            jobs=2)
"""


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux only")
def test_workers_end_with_their_parent_however_it_is_killed(tmp_path, watchdog):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], cwd=REPO_ROOT,
                              env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    try:
        while len(list(tmp_path.iterdir())) < 2:  # both workers are replaying
            time.sleep(0.05)
        workers = [int(path.name) for path in tmp_path.iterdir()]
        assert all(_is_running(pid) for pid in workers)
        parent.kill()  # SIGKILL: the parent cannot clean up
        parent.wait()
        while any(_is_running(pid) for pid in workers):
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
