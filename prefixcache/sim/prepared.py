"""A trace made ready for replay: every request's block hashes computed once.

A sweep replays the same trace many times (capacities x policies); hashing is the costly
part of expanding a request, so :class:`PreparedTrace` does it once per block size and
each replay only builds token lists and :class:`~prefixcache.core.Request` objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.core import BlockHash, cdiv
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.trace import Trace, TraceRequest


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
    block_hashes: list[list[BlockHash]]
    max_hit_blocks: list[int]
    blocks_needed: list[int]

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
    block_hashes, max_hit_blocks, blocks_needed = [], [], []
    for done, request in enumerate(requests, start=1):
        block_hashes.append(expander.block_hashes(request))
        max_hit_blocks.append((request.input_length - 1) // block_size)
        num_slots = request.input_length + (request.output_length if reserve_decode_slots else 0)
        blocks_needed.append(cdiv(num_slots, block_size))
        if progress is not None and done % 256 == 0:
            progress(256)
    if progress is not None and len(requests) % 256:
        progress(len(requests) % 256)
    return PreparedTrace(trace, expander, reserve_decode_slots, list(requests), block_hashes,
                         max_hit_blocks, blocks_needed)
