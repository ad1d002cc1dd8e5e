"""Several replays of one prepared trace, in parallel processes.

Replays of one trace at different capacities or under different policies share nothing
but the prepared trace, which they only read. With ``jobs`` above 1, :func:`replay_all`
forks that many worker processes, which inherit the prepared trace from the parent
instead of receiving a copy, and each replays whole configurations. The results are the
replays' own: a replay is deterministic, so they are the same figures, in the same
order, as one process gives (only the timings differ).

Memory: a worker shares the parent's pages until it writes to them. Reading a hash
updates the reference count of its Python object, so over a replay a worker comes to
hold its own copy of the pages of the hashes it reads: up to about 100 bytes per distinct
block, on top of what the replay itself holds.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from prefixcache.sim.prepared import PreparedTrace
from prefixcache.sim.replay import BELADY, ReplayConfig, ReplayResult, replay


class ReplayWorkerDied(RuntimeError):
    """A worker process ended without a result: killed from outside, most often by the
    kernel for want of memory."""


_PR_SET_PDEATHSIG = 1  # prctl(2)'s option: the signal a process gets when its parent ends

# How often the parent reads the workers' progress counts, in seconds.
_PROGRESS_POLL_S = 0.25

# The trace the workers replay, and the requests each configuration has replayed so far
# (one slot per configuration, written only by the worker replaying it): set in the
# parent for as long as its pool lives, and inherited by the forked workers.
_shared_trace: PreparedTrace | None = None
_requests_replayed: ctypes.Array[ctypes.c_longlong] | None = None


def can_fork() -> bool:
    """Whether this platform can start workers that inherit the trace (POSIX ``fork``)."""
    return "fork" in multiprocessing.get_all_start_methods()


def _die_with_parent(parent_pid: int) -> None:
    """In a worker, first: be killed when the parent process ends, however it ends, so
    that no replay outlives the command that wanted it (Linux's parent-death signal;
    elsewhere a worker whose parent is killed finishes its replay first)."""
    try:
        set_parent_death_signal = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return
    set_parent_death_signal(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it ended before the signal was asked for
        os._exit(1)


def _replay_shared(index: int, config: ReplayConfig) -> ReplayResult:
    def count(num_requests: int) -> None:
        _requests_replayed[index] += num_requests

    return replay(_shared_trace, config, count)


def replay_all(prepared: PreparedTrace, configs: Sequence[ReplayConfig],
               progress: Callable[[int], None] | None = None,
               jobs: int = 1) -> list[ReplayResult]:
    """The result of each of ``configs`` replayed on ``prepared``, in ``configs``' order,
    using up to ``jobs`` worker processes (1: this one).

    ``progress(n)`` gets ``len(prepared.requests)`` per replay in all, as :func:`replay`
    gives it, always in this process: as requests go, with workers too (read every
    ``_PROGRESS_POLL_S``). Belady's replays, the longest, are started first. ValueError
    if ``jobs`` is below 1, or above 1 where workers cannot be forked. An error in a
    replay is raised here as in this process, once the workers still replaying are
    stopped; :class:`ReplayWorkerDied` if a worker is killed. One call at a time per
    process: the workers find the trace in a module global.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    if jobs == 1 or len(configs) <= 1:
        return [replay(prepared, config, progress) for config in configs]
    if not can_fork():
        raise ValueError("parallel replays need the fork start method, which this "
                         "platform lacks; use one job")
    global _shared_trace, _requests_replayed
    order = sorted(range(len(configs)), key=lambda i: configs[i].policy != BELADY)
    results: list[ReplayResult | None] = [None] * len(configs)
    context = multiprocessing.get_context("fork")
    _shared_trace = prepared
    _requests_replayed = context.RawArray("q", len(configs))
    reported = 0
    pool = ProcessPoolExecutor(min(jobs, len(configs)),
                               mp_context=context,
                               initializer=_die_with_parent, initargs=(os.getpid(),))
    all_done = False
    try:
        pending = {pool.submit(_replay_shared, i, configs[i]): i for i in order}
        while pending:
            done, _ = wait(pending, timeout=_PROGRESS_POLL_S, return_when=FIRST_COMPLETED)
            for future in done:
                results[pending.pop(future)] = future.result()  # a replay's error: raised
            replayed = sum(_requests_replayed)
            if progress is not None and replayed > reported:
                progress(replayed - reported)
                reported = replayed
        all_done = True
    except BrokenProcessPool as exc:
        # A worker killed from outside (the kernel's out-of-memory killer, a signal).
        raise ReplayWorkerDied("a replay's worker process was killed (out of memory? "
                               "with fewer jobs, each has more)") from exc
    finally:
        if not all_done:
            _kill_workers(pool)  # their results are no longer wanted
        pool.shutdown(wait=True, cancel_futures=True)
        _shared_trace = _requests_replayed = None
    return results


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """Stop the replays still running, which shutting down alone would wait for."""
    kill = getattr(pool, "kill_workers", None)  # public from Python 3.14
    if kill is not None:
        kill()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
