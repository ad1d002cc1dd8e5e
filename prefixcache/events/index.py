"""What a cache-aware router knows about one engine: the block hashes it has stored.

Built only from events. A hash may be stored by more than one block at once (an engine
that does not de-duplicate caches a second copy when two requests fill identical blocks
concurrently; vLLM does this), and each copy is stored and removed with its own event. So
the index counts copies per hash and a hash stays present until its last copy is removed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prefixcache.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    WireEvent,
)


class EventIndex:
    """Stored block hashes (in their wire form) of one publisher, with copy counts.

    Invariant: ``hash_to_num_copies`` holds only positive counts; a hash is ``in`` the
    index exactly when the engine has at least one cached block with that hash, provided
    the index has seen every event since the engine started or last cleared.
    ``num_unknown_removals`` counts removals of hashes the index never saw stored: a
    sign it joined late or lost events.
    """

    __slots__ = ("hash_to_num_copies", "num_unknown_removals")

    def __init__(self) -> None:
        self.hash_to_num_copies: dict[ExternalBlockHash, int] = {}
        self.num_unknown_removals = 0

    def apply(self, event: WireEvent) -> None:
        """Update the index with one event."""
        hash_to_num_copies = self.hash_to_num_copies
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                hash_to_num_copies[block_hash] = hash_to_num_copies.get(block_hash, 0) + 1
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                num_copies = hash_to_num_copies.get(block_hash)
                if num_copies is None:
                    self.num_unknown_removals += 1
                elif num_copies == 1:
                    del hash_to_num_copies[block_hash]
                else:
                    hash_to_num_copies[block_hash] = num_copies - 1
        elif isinstance(event, AllBlocksCleared):
            hash_to_num_copies.clear()
        else:
            raise TypeError(f"not a KV cache wire event: {event!r}")

    def apply_batch(self, batch: KVEventBatch) -> None:
        """Update the index with every event of ``batch``, in order."""
        for event in batch.events:
            self.apply(event)

    def apply_batches(self, batches: Iterable[KVEventBatch]) -> None:
        for batch in batches:
            self.apply_batch(batch)

    def num_prefix_hits(self, block_hashes: Sequence[ExternalBlockHash]) -> int:
        """How many leading blocks of a request (its chained hashes) this engine holds.

        Routing stops at the first miss: a block's KV is only usable when every block
        before it is too.
        """
        num_hits = 0
        hash_to_num_copies = self.hash_to_num_copies
        for block_hash in block_hashes:
            if block_hash not in hash_to_num_copies:
                break
            num_hits += 1
        return num_hits

    def stored_hashes(self) -> set[ExternalBlockHash]:
        return set(self.hash_to_num_copies)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.hash_to_num_copies

    def __len__(self) -> int:
        return len(self.hash_to_num_copies)

    def __iter__(self) -> Iterator[ExternalBlockHash]:
        return iter(self.hash_to_num_copies)
