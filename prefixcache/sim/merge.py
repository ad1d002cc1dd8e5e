"""Several request traces merged into one: the traffic of several workloads arriving at
one server, in order of arrival (``prefixcache merge``).

Requests are ordered by timestamp; requests with equal timestamps keep the order of the
traces as given, then their order within their trace. Timestamps are kept as they are,
or, with ``align_starts``, each trace's are shifted so that its earliest request arrives
at 0 (traces logged at different times then overlap from their start).

Hash ids (Mooncake's and Bailian's) name content only within the trace that uses them: id
7 of one trace and id 7 of another are unrelated blocks. So each trace's ids are moved
past every id of the traces before it (the first trace's stay as they are) and no block
is shared across traces, unless ``shared_ids`` says the traces name content alike (pieces
of one trace, or traces written by one tool from one tokenizer's output). Bailian chat
ids are moved alike (``chat_id``, and ``parent_chat_id`` but for a root's -1), so that
sessions stay apart too. Token-id requests name their content by its tokens, which mean
the same in every trace: they are kept as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from prefixcache.sim.trace import Trace, TraceRequest

#: Ids a merged trace names, hash ids and chat ids, are below this: 64-bit unsigned, as a
#: hash's external form (``block_hash_to_int64``) is. (A trace read may name larger ones:
#: a replay takes any, but moving them on could go on without end.)
ID_BOUND = 1 << 64
#: A Bailian line's fields naming chats: its own and its parent's (-1 for a root).
CHAT_ID_FIELDS = ("chat_id", "parent_chat_id")


def merge_traces(traces: Sequence[Trace], *, shared_ids: bool = False,
                 align_starts: bool = False,
                 max_requests: int | None = None) -> list[TraceRequest]:
    """The requests of ``traces`` in order of arrival (module docstring), the first
    ``max_requests`` of them (all when None), numbered 1, 2, ... as the lines of the
    merged trace. Raises ValueError, naming the file and line, if a request has no
    timestamp (there is then no order of arrival to merge by), and naming the file if
    moving its ids would take one to 2**64 (:data:`ID_BOUND`)."""
    for trace in traces:
        untimed = next((r for r in trace.requests if r.timestamp_ms is None), None)
        if untimed is not None:
            raise ValueError(f"{trace.path}:{untimed.line_no}: the request has no "
                             "'timestamp': traces are merged in order of arrival, so "
                             "every request needs one")
    # (arrival time, request, how far its hash ids and chat ids move), built first and
    # copied into new requests only once sorted and cut, so a merge holds one copy of
    # what it writes.
    arrivals: list[tuple[float, TraceRequest, int, int]] = []
    id_offset = chat_offset = 0
    for trace in traces:
        time_shift = min(r.timestamp_ms for r in trace.requests) if align_starts else 0.0
        moved_ids, moved_chats = (0, 0) if shared_ids else (id_offset, chat_offset)
        arrivals.extend((request.timestamp_ms - time_shift, request, moved_ids, moved_chats)
                        for request in trace.requests)
        largest_id = max((max(r.hash_ids, default=-1) for r in trace.requests
                          if r.hash_ids is not None), default=-1)
        largest_chat = max((_largest_chat_id(r) for r in trace.requests), default=-1)
        if max(moved_ids + largest_id, moved_chats + largest_chat) >= ID_BOUND:
            if not (moved_ids or moved_chats):
                raise ValueError(f"{trace.path}: it names ids of 2**64 or more; a merged "
                                 "trace names ids below 2**64")
            raise ValueError(f"{trace.path}: its ids, moved past the earlier traces', would "
                             "reach 2**64 or more, past what a merged trace names: merge "
                             "with --shared-hash-ids, or number the traces' ids from 0")
        id_offset += 1 + largest_id
        chat_offset += 1 + largest_chat
    # A stable sort: equal timestamps keep the order the loop above appended them in.
    arrivals.sort(key=lambda arrival: arrival[0])
    if max_requests is not None:
        del arrivals[max_requests:]
    return [dataclasses.replace(request, line_no=line_no, timestamp_ms=timestamp,
                                hash_ids=_moved(request.hash_ids, moved_ids),
                                session_fields=_moved_chats(request.session_fields,
                                                            moved_chats))
            for line_no, (timestamp, request, moved_ids, moved_chats)
            in enumerate(arrivals, start=1)]


def _moved(hash_ids: tuple[int, ...] | None, by: int) -> tuple[int, ...] | None:
    if hash_ids is None or by == 0:
        return hash_ids
    return tuple(block_id + by for block_id in hash_ids)


def _is_chat_id(key: str, value) -> bool:
    """Whether a session field is a chat id that moves: a non-negative integer (a root's
    parent, -1, is none)."""
    return key in CHAT_ID_FIELDS and type(value) is int and value >= 0


def _largest_chat_id(request: TraceRequest) -> int:
    """The largest chat id a Bailian request names (its own or its parent's, which may
    lie before the trace's first line), or -1."""
    return max((value for key, value in request.session_fields if _is_chat_id(key, value)),
               default=-1)


def _moved_chats(session_fields: tuple, by: int) -> tuple:
    """Bailian session fields with their chat ids moved by ``by`` (a root's parent, -1,
    and ids that are not non-negative integers stay as they are)."""
    if not session_fields or by == 0:
        return session_fields
    return tuple((key, value + by if _is_chat_id(key, value) else value)
                 for key, value in session_fields)
