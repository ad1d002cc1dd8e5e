"""Several request traces merged into one: the traffic of several workloads arriving at
one server, in order of arrival (``prefixcache merge``).

Requests are ordered by timestamp; requests with equal timestamps keep the order of the
traces as given, then their order within their trace. Timestamps are kept as they are,
or, with ``align_starts``, each trace's are shifted so that its earliest request arrives
at 0 (traces logged at different times then overlap from their start).

Mooncake hash ids name content only within the trace that uses them: id 7 of one trace
and id 7 of another are unrelated blocks. So each trace's ids are moved past every id of
the traces before it (the first trace's stay as they are) and no block is shared across
traces, unless ``shared_ids`` says the traces name content alike (pieces of one trace,
or traces written by one tool from one tokenizer's output). Token-id requests name their
content by its tokens, which mean the same in every trace: they are kept as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from prefixcache.sim.trace import MOONCAKE_BLOCK_SIZE, Trace, TraceRequest


def merge_traces(traces: Sequence[Trace], *, shared_ids: bool = False,
                 align_starts: bool = False,
                 max_requests: int | None = None) -> list[TraceRequest]:
    """The requests of ``traces`` in order of arrival (module docstring), the first
    ``max_requests`` of them (all when None), numbered 1, 2, ... as the lines of the
    merged trace. Raises ValueError, naming the file and line, if a request has no
    timestamp (there is then no order of arrival to merge by) or is a Bailian line (the
    merged trace is written in the Mooncake and token-id formats, and a Bailian line's
    16-token hash ids have no Mooncake spelling)."""
    for trace in traces:
        untimed = next((r for r in trace.requests if r.timestamp_ms is None), None)
        if untimed is not None:
            raise ValueError(f"{trace.path}:{untimed.line_no}: the request has no "
                             "'timestamp': traces are merged in order of arrival, so "
                             "every request needs one")
        bailian = next((r for r in trace.requests if r.hash_ids is not None
                        and r.hash_block_size != MOONCAKE_BLOCK_SIZE), None)
        if bailian is not None:
            raise ValueError(f"{trace.path}:{bailian.line_no}: a Bailian line (16-token "
                             "hash ids): merge writes Mooncake and token-id traces only")
    # (arrival time, request, how far its hash ids move), built first and copied into new
    # requests only once sorted and cut, so a merge holds one copy of what it writes.
    arrivals: list[tuple[float, TraceRequest, int]] = []
    id_offset = 0
    for trace in traces:
        time_shift = min(r.timestamp_ms for r in trace.requests) if align_starts else 0.0
        moved_ids = 0 if shared_ids else id_offset
        arrivals.extend((request.timestamp_ms - time_shift, request, moved_ids)
                        for request in trace.requests)
        id_offset += 1 + max((max(r.hash_ids, default=-1) for r in trace.requests
                              if r.hash_ids is not None), default=-1)
    # A stable sort: equal timestamps keep the order the loop above appended them in.
    arrivals.sort(key=lambda arrival: arrival[0])
    if max_requests is not None:
        del arrivals[max_requests:]
    return [dataclasses.replace(request, line_no=line_no, timestamp_ms=timestamp,
                                hash_ids=_moved(request.hash_ids, moved_ids))
            for line_no, (timestamp, request, moved_ids) in enumerate(arrivals, start=1)]


def _moved(hash_ids: tuple[int, ...] | None, by: int) -> tuple[int, ...] | None:
    if hash_ids is None or by == 0:
        return hash_ids
    return tuple(block_id + by for block_id in hash_ids)
