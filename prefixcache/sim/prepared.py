"""A trace made ready for replay: every request's block hashes computed once.

A sweep replays the same trace many times (capacities x policies); hashing is the costly
part of expanding a request, so :class:`PreparedTrace` does it once per block size and
each replay only builds token lists and :class:`~prefixcache.core.Request` objects.

The hashes are kept in :class:`BlockHashChains`: each distinct hash once, and each
request's chain as 4-byte indices into them, where a list would take 8 bytes a block (a
chain of block size 16 names 32 blocks per 512 tokens) and, for a token-id trace, a new
hash object for every block of every request.
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
    chain as *slots*, indices (``0 .. num_distinct - 1``, in order of first appearance) of
    the stored hashes (``hash_at(slot)``): equal slots mean equal hashes, and equal hashes
    equal slots, however the chains were added. Append-only, until :meth:`freeze`.
    """

    __slots__ = ("_distinct", "_slot_of", "_run_slots", "_slots", "_ends")

    def __init__(self) -> None:
        self._distinct: list[BlockHash] = []
        self._slot_of: dict[BlockHash, int] | None = {}
        # id(run) -> (the run, kept so its id stays its own; the slots of its hashes
        # that some chain has reached so far).
        self._run_slots: dict[int, tuple[list[BlockHash], array]] = {}
        self._slots = array("I")
        self._ends = array("Q")

    def _start_chain(self, num_new_at_most: int) -> dict[BlockHash, int]:
        """The hash -> slot index, after checking that appending is allowed and that
        ``num_new_at_most`` more hashes stay within MAX_DISTINCT_BLOCKS."""
        slot_of = self._slot_of
        if slot_of is None:
            raise RuntimeError("chains are frozen: append before freeze()")
        if len(self._distinct) + num_new_at_most > MAX_DISTINCT_BLOCKS:
            raise ValueError(f"a trace may hold at most {MAX_DISTINCT_BLOCKS:,} distinct blocks")
        return slot_of

    def append(self, chain: Sequence[BlockHash]) -> None:
        """Add the next request's chain. Raises ValueError past MAX_DISTINCT_BLOCKS."""
        slot_of = self._start_chain(len(chain))
        distinct, slots = self._distinct, self._slots
        for block_hash in chain:
            slot = slot_of.get(block_hash)
            if slot is None:
                slot = slot_of[block_hash] = len(distinct)
                distinct.append(block_hash)
            slots.append(slot)
        self._ends.append(len(slots))

    def append_runs(self, runs: Sequence[list[BlockHash]], length: int) -> None:
        """Add the next request's chain given as runs (see
        :meth:`~prefixcache.sim.expand.TraceExpander.block_hash_runs`): the runs'
        concatenation cut to ``length``, the same as ``append`` of that chain. A run
        object seen before reuses the slots found for it, so each hash of a run is looked
        up once, not once per request reaching it."""
        slot_of = self._start_chain(length)
        run_slots, distinct, slots = self._run_slots, self._distinct, self._slots
        remaining = length
        for run in runs:
            if remaining <= 0:
                break
            entry = run_slots.get(id(run))
            if entry is None:
                entry = run_slots[id(run)] = (run, array("I"))
            found = entry[1]
            num_used = min(len(run), remaining)
            for block_hash in run[len(found):num_used]:
                slot = slot_of.get(block_hash)
                if slot is None:
                    slot = slot_of[block_hash] = len(distinct)
                    distinct.append(block_hash)
                found.append(slot)
            slots.extend(found if num_used == len(found) else found[:num_used])
            remaining -= num_used
        self._ends.append(len(slots))

    def freeze(self) -> None:
        """Drop the indexes used while appending (most of the memory that appending
        needs beyond the chains themselves); no appends after this."""
        self._slot_of = None
        self._run_slots = {}

    @property
    def num_distinct(self) -> int:
        """How many distinct hashes the chains hold: the trace's working set in blocks."""
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
    # Runs look each hash up once; only a Mooncake request has them.
    by_runs = all(request.hash_ids is not None for request in requests)
    for done, request in enumerate(requests, start=1):
        if by_runs:
            block_hashes.append_runs(*expander.block_hash_runs(request))
        else:
            block_hashes.append(expander.block_hashes(request))
        max_hit_blocks.append((request.input_length - 1) // block_size)
        num_kv_tokens = (request.input_length
                         + (request.output_length if reserve_decode_slots else 0))
        blocks_needed.append(cdiv(num_kv_tokens, block_size))
        if progress is not None and done % 256 == 0:
            progress(256)
    if progress is not None and len(requests) % 256:
        progress(len(requests) % 256)
    block_hashes.freeze()
    return PreparedTrace(trace, expander, reserve_decode_slots, list(requests), block_hashes,
                         max_hit_blocks, blocks_needed)
