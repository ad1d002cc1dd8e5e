"""A trace made ready for replay: every request's block hashes computed once.

A sweep replays the same trace many times (capacities x policies); hashing is the costly
part of expanding a request, so :class:`PreparedTrace` does it once per block size and
each replay only builds token lists and :class:`~prefixcache.core.Request` objects.

The hashes are kept in :class:`BlockHashChains`: each distinct hash once, and each
request's chain as 4-byte indices into them. A trace's requests mostly repeat content
(that is what a prefix cache is for), and a chain of block size 16 names 32 blocks per
512 tokens, so storing chains as lists of hash objects would cost several times more.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prefixcache.core import BlockHash, cdiv
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.trace import Trace, TraceRequest

# Slots are stored as unsigned 32-bit integers: the limit on distinct blocks per trace.
MAX_DISTINCT_BLOCKS = 1 << 32


class BlockHashChains(Sequence):
    """The block-hash chains of a trace's requests, each distinct hash stored once.

    ``chains[i]`` is request ``i``'s chain, a new list of hashes; ``slots(i)`` is the same
    chain as *slots*, indices (``0 .. num_slots - 1``) of the stored hashes
    (``hash_at(slot)``): equal slots mean equal hashes, and distinct slots distinct ones.
    A chain added as runs stores each new run whole, so some slots may hold a hash that no
    chain reaches (a run's tail past a request's last full block): ``num_distinct``, the
    hashes chains reference, can be below ``num_slots``. Append-only, until :meth:`freeze`.
    """

    __slots__ = ("_distinct", "_slot_of", "_run_starts", "_num_referenced", "_slots", "_ends")

    def __init__(self) -> None:
        self._distinct: list[BlockHash] = []
        self._slot_of: dict[BlockHash, int] | None = {}
        # id(run) -> [run, its first slot, how many of its hashes chains reference].
        self._run_starts: dict[int, list] = {}
        self._num_referenced = 0
        self._slots = array("I")
        self._ends = array("Q")

    def append(self, chain: Sequence[BlockHash]) -> None:
        """Add the next request's chain. Raises ValueError past MAX_DISTINCT_BLOCKS."""
        slot_of = self._slot_of
        if slot_of is None:
            raise RuntimeError("chains are frozen: append before freeze()")
        distinct, slots = self._distinct, self._slots
        for block_hash in chain:
            slot = slot_of.get(block_hash)
            if slot is None:
                slot = len(distinct)
                if slot >= MAX_DISTINCT_BLOCKS:
                    raise ValueError(f"a trace may hold at most {MAX_DISTINCT_BLOCKS:,} "
                                     "distinct blocks")
                slot_of[block_hash] = slot
                distinct.append(block_hash)
                self._num_referenced += 1
            slots.append(slot)
        self._ends.append(len(slots))

    def append_runs(self, runs: Sequence[list[BlockHash]], length: int) -> None:
        """Add the next request's chain given as runs (see
        :meth:`~prefixcache.sim.expand.TraceExpander.block_hash_runs`): the runs'
        concatenation cut to ``length``. A run object seen before reuses its slots; a new
        one gets new slots, without looking its hashes up, so every run must hold hashes
        that no other run and no :meth:`append`-ed chain holds."""
        if self._slot_of is None:
            raise RuntimeError("chains are frozen: append before freeze()")
        run_starts, distinct, slots = self._run_starts, self._distinct, self._slots
        end = len(slots) + length
        for run in runs:
            entry = run_starts.get(id(run))
            if entry is None:
                if len(distinct) + len(run) > MAX_DISTINCT_BLOCKS:
                    raise ValueError(f"a trace may hold at most {MAX_DISTINCT_BLOCKS:,} "
                                     "distinct blocks")
                # The entry keeps the run alive, so its id() stays its own.
                entry = run_starts[id(run)] = [run, len(distinct), 0]
                distinct.extend(run)
            start, num_used = entry[1], min(len(run), end - len(slots))
            if num_used > entry[2]:  # a run's slots are referenced from its start on
                self._num_referenced += num_used - entry[2]
                entry[2] = num_used
            slots.extend(range(start, start + num_used))
        self._ends.append(len(slots))

    def freeze(self) -> None:
        """Drop the index used to deduplicate while appending (most of the memory that
        appending needs beyond the chains themselves); no appends after this."""
        self._slot_of = None
        self._run_starts = {}

    @property
    def num_distinct(self) -> int:
        """How many distinct hashes the chains hold: the trace's working set in blocks."""
        return self._num_referenced

    @property
    def num_slots(self) -> int:
        """One more than the highest slot (slots of a run's unreferenced tail included)."""
        return len(self._distinct)

    @property
    def num_references(self) -> int:
        """The total length of all chains."""
        return len(self._slots)

    def hash_at(self, slot: int) -> BlockHash:
        return self._distinct[slot]

    def slots(self, index: int) -> array:
        """Request ``index``'s chain as slots (a new array); indexed like a list."""
        if not isinstance(index, int):
            raise TypeError("chains are indexed by request index only")
        ends = self._ends
        if index < 0:
            index += len(ends)
        if not 0 <= index < len(ends):
            raise IndexError("request index out of range")
        return self._slots[ends[index - 1] if index else 0:ends[index]]

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> list[BlockHash]:
        return list(map(self._distinct.__getitem__, self.slots(index)))

    def __iter__(self) -> Iterator[list[BlockHash]]:
        for index in range(len(self._ends)):
            yield self[index]


@dataclass(slots=True)
class PreparedTrace:
    """The requests of ``trace`` with their block hashes under ``expander``.

    ``block_hashes[i]`` chains the full blocks of ``requests[i]``;
    ``max_hit_blocks[i]`` is how many of them a lookup may hit (the manager always leaves
    the last prompt token to compute); ``blocks_needed[i]`` is the size of the request's
    block table: prompt plus ``output_length`` decode slots when ``reserve_decode_slots``.
    """

    trace: Trace
    expander: TraceExpander
    reserve_decode_slots: bool
    requests: list[TraceRequest]
    block_hashes: BlockHashChains
    max_hit_blocks: array
    blocks_needed: array

    @property
    def block_size(self) -> int:
        return self.expander.block_size

    @property
    def num_prompt_tokens(self) -> int:
        return sum(request.input_length for request in self.requests)

    def num_decode_slots(self, index: int) -> int:
        return self.requests[index].output_length if self.reserve_decode_slots else 0


def prepare_trace(trace: Trace, expander: TraceExpander,
                  reserve_decode_slots: bool = True, progress=None) -> PreparedTrace:
    """Hash every request of ``trace``; ``progress(n)`` is called as requests are done.

    Raises ValueError if the expander's block size cannot expand the trace.
    """
    block_size = expander.block_size
    requests = trace.requests
    if requests:
        expander.check_supports(requests[0])
    block_hashes = BlockHashChains()
    max_hit_blocks, blocks_needed = array("q"), array("q")
    # Runs skip looking up each hash, but cannot see a token-id request's hashes.
    by_runs = all(request.hash_ids is not None for request in requests)
    for done, request in enumerate(requests, start=1):
        if by_runs:
            block_hashes.append_runs(*expander.block_hash_runs(request))
        else:
            block_hashes.append(expander.block_hashes(request))
        max_hit_blocks.append((request.input_length - 1) // block_size)
        num_slots = request.input_length + (request.output_length if reserve_decode_slots else 0)
        blocks_needed.append(cdiv(num_slots, block_size))
        if progress is not None and done % 256 == 0:
            progress(256)
    if progress is not None and len(requests) % 256:
        progress(len(requests) % 256)
    block_hashes.freeze()
    return PreparedTrace(trace, expander, reserve_decode_slots, list(requests), block_hashes,
                         max_hit_blocks, blocks_needed)
