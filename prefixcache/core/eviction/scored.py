"""Free queues ordered by a key instead of by position: lazy min-heaps.

The linked list of :class:`~prefixcache.core.eviction.base.FreeKVCacheBlockQueue` can only
put a block at either end. A policy that ranks every free block by a computed value (Belady's
next use, a predicted chance of reuse) needs a priority queue; this is that queue, behind
the same contract, so the block pool cannot tell the difference.

Removal (a cache hit on a free block) must stay cheap, so entries are never searched for:
each block carries a version, odd while it is in the queue, and a heap entry whose version
is not the block's current one is stale and skipped when it surfaces. Stale entries are
compacted away once they outnumber the live ones.

:class:`ScoredFreeBlockQueue` keys every block on its own. :class:`GroupedScoredFreeBlockQueue`
keys *groups* of blocks that always share a key (say, the blocks one request released at
one depth) and keeps each group's blocks in order, the groups in lists whose keys stay in
the order the groups were made: re-keying after the estimates behind the keys change then
costs one key per list, not per group or per block.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from typing import Any

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction.base import FreeKVCacheBlockQueue


class VersionedFreeBlockQueue(FreeKVCacheBlockQueue):
    """What the key-ordered queues share: per-block versions (odd while queued) for O(1)
    removal, and the contract's methods around the subclass's :meth:`_pop_lowest`.
    ``prepend_n`` cannot honour "first": it orders by key like ``append_n``. Block ids
    are the pool's, from 0 up; versions are kept in a list indexed by them."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        self._versions: list[int] = [0] * (max((b.block_id for b in blocks), default=-1) + 1)
        super().__init__(blocks)

    def _pop_lowest(self) -> KVCacheBlock:
        """Take the next block to evict (there is one)."""
        raise NotImplementedError

    def version(self, block_id: int) -> int:
        """Block ``block_id``'s version: odd while it is in the queue."""
        versions = self._versions
        return versions[block_id] if block_id < len(versions) else 0

    def _enter(self, block: KVCacheBlock) -> int:
        """Count ``block`` in; returns its new (odd) version."""
        versions = self._versions
        block_id = block.block_id
        if block_id >= len(versions):  # a block the queue was not built with
            versions.extend([0] * (block_id + 1 - len(versions)))
        version = versions[block_id] + 1
        versions[block_id] = version
        self.num_free_blocks += 1
        return version

    def _enter_n(self, blocks: list[KVCacheBlock]) -> list[int]:
        """Count ``blocks`` in; returns their new (odd) versions, in order."""
        versions = self._versions
        highest = max((block.block_id for block in blocks), default=-1)
        if highest >= len(versions):  # a block the queue was not built with
            versions.extend([0] * (highest + 1 - len(versions)))
        entered = []
        append = entered.append
        for block in blocks:
            block_id = block.block_id
            version = versions[block_id] + 1
            versions[block_id] = version
            append(version)
        self.num_free_blocks += len(blocks)
        return entered

    def _leave_if_current(self, block: KVCacheBlock, version: int) -> bool:
        """If ``version`` is ``block``'s current one, count it out and return True; False
        for a stale entry."""
        versions = self._versions
        block_id = block.block_id
        if block_id >= len(versions) or versions[block_id] != version:
            return False
        versions[block_id] = version + 1
        self.num_free_blocks -= 1
        return True

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        return self._pop_lowest()

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        self._check_take(n)
        return [self._pop_lowest() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        version = self.version(block.block_id)
        if version % 2 == 0:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        self._leave_if_current(block, version)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        self.append_n(blocks)  # the order is the keys', whatever the caller asks


class ScoredFreeBlockQueue(VersionedFreeBlockQueue):
    """Free blocks in a min-heap on ``(key, push order)``: the lowest key is evicted first,
    and among equal keys the block pushed first.

    Subclasses say what a block's key is: :meth:`key_for` for blocks handed in without
    context (``append``, ``append_n``, ``prepend_n``, and ``release`` unless overridden),
    or :meth:`_push` with a key of their own. Keys must be mutually comparable (numbers,
    or tuples of them). :meth:`_take_or_rekey` may veto a block that surfaces (for keys
    that expire). Same contract as every free queue: it holds exactly the ``ref_cnt == 0``
    blocks, each once; ``prepend_n`` cannot honour "first" and orders by key like the rest.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # (key, push order, version, block)
        self._heap: list[tuple[Any, int, int, KVCacheBlock]] = []
        self._num_pushed = 0
        super().__init__(blocks)

    # -- what subclasses decide ----------------------------------------------------------

    def key_for(self, block: KVCacheBlock) -> Any:
        """The key of ``block`` handed in without context. Lower is evicted sooner."""
        raise NotImplementedError

    def _take_or_rekey(self, block: KVCacheBlock) -> bool:
        """Called with the lowest block, already out of the queue: True to evict it; or
        False after pushing it back under a new key (the search then goes on)."""
        return True

    # -- the heap ------------------------------------------------------------------------

    def _push(self, block: KVCacheBlock, key: Any) -> None:
        version = self._enter(block)
        self._num_pushed += 1
        heapq.heappush(self._heap, (key, self._num_pushed, version, block))

    def _pop_lowest(self) -> KVCacheBlock:
        heap = self._heap
        while heap:
            _, _, version, block = heapq.heappop(heap)
            # A stale entry was removed (hit) or pushed again since.
            if self._leave_if_current(block, version) and self._take_or_rekey(block):
                return block
        raise ValueError("No free blocks available")

    def _live_entries(self) -> list[tuple[Any, int, int, KVCacheBlock]]:
        versions = self._versions
        return [entry for entry in self._heap if versions[entry[3].block_id] == entry[2]]

    # -- the free-queue contract -----------------------------------------------------------

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        if len(self._heap) > 2 * self.num_free_blocks + 1024:
            # Hits leave stale entries behind; without this the heap would grow with every
            # hit for as long as the blocks stay free.
            self._heap = self._live_entries()
            heapq.heapify(self._heap)

    def append(self, block: KVCacheBlock) -> None:
        self._push(block, self.key_for(block))

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self._push(block, self.key_for(block))

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block in eviction order by current keys (a subclass that re-keys on
        the way out may still reorder). O(n log n); for tests and tools."""
        return [entry[3] for entry in sorted(self._live_entries(), key=lambda e: e[:2])]


class KeyGroup:
    """Blocks that share one key, in eviction order, with the parts the key is computed
    from. ``entries`` holds ``(block, version)`` from ``next_index`` on; an entry whose
    version is no longer the block's is stale (the block was taken or hit). ``listed``
    once the group has joined its list (at a re-key); until then ``key`` is the key it
    was made with and ``heap_version`` tells its current entry in the heap of new
    groups."""

    __slots__ = ("parts", "key", "order", "heap_version", "listed", "entries",
                 "next_index", "num_live")

    def __init__(self, parts: Any, key: Any, order: int) -> None:
        self.parts = parts
        self.key = key
        self.order = order
        self.heap_version = 0
        self.listed = False
        self.entries: list[tuple[KVCacheBlock, int]] = []
        self.next_index = 0
        self.num_live = 0


class GroupedScoredFreeBlockQueue(VersionedFreeBlockQueue):
    """Free blocks in groups that share a key; the group with the lowest key (then the
    one made first) gives up its blocks first, in the order they joined it. Blocks that
    hold nothing cached wait in a FIFO ahead of every group.

    Subclasses compute keys from parts: :meth:`key_of_parts`, and :meth:`parts_for` for
    blocks handed in without context (``append``, ``append_n``, ``prepend_n``, and
    ``release`` unless overridden; None puts a block with the empty ones). They put
    blocks in groups of their own with :meth:`_new_group` and :meth:`_add_to_group` (a
    group takes blocks only until the next re-key), and call :meth:`_recompute_keys` when
    the estimates behind the keys change.

    A re-key costs O(lists), not O(groups). Each group belongs to a *list*
    (:meth:`list_of_parts`): under one set of estimates, the keys of a list's groups never
    decrease in the order the groups were made (a per-list value plus a clock that only
    advances, say). Groups made since the last re-key keep the key they were made with,
    in a heap of their own; a re-key appends them to their lists, and from then on a
    listed group is keyed by :meth:`listed_key_of_parts`, the estimates as they were at
    that re-key, when it reaches the head of its list. Only list heads are in the heap of
    lists, so the order is exactly that of one heap over every group's key.
    Same contract as every free queue: it holds exactly the ``ref_cnt == 0`` blocks, each
    once; ``prepend_n`` orders by key like the rest.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._empty: deque[tuple[KVCacheBlock, int]] = deque()
        self._group_of: dict[int, KeyGroup] = {}  # block id -> its group, while queued
        self._live_groups: dict[int, KeyGroup] = {}  # by order, groups with a block
        # Groups made since the last re-key, in order, and their heap on (key, order).
        self._new_groups: list[KeyGroup] = []
        self._new_heap: list[tuple[Any, int, int, KeyGroup]] = []
        # The listed groups, each list in the order its groups were made; emptied groups
        # stay until they reach the head (or a compaction).
        self._lists: dict[Any, deque[KeyGroup]] = {}
        self._num_listed = 0
        # (key, order, list id) of list heads. An entry whose order is no longer its
        # list's head is stale; its key is at most the head's, so it surfaces first.
        self._heads: list[tuple[Any, int, Any]] = []
        self._num_groups_made = 0
        super().__init__(blocks)

    # -- what subclasses decide ----------------------------------------------------------

    def key_of_parts(self, parts: Any) -> Any:
        """The key of a group with these parts, from the current estimates."""
        raise NotImplementedError

    def listed_key_of_parts(self, parts: Any) -> Any:
        """The key of a listed group with these parts, from the estimates as they were at
        the last :meth:`_recompute_keys` (by default :meth:`key_of_parts`: right for
        estimates that change only at re-keys)."""
        return self.key_of_parts(parts)

    def list_of_parts(self, parts: Any) -> Any:
        """The list of a group with these parts: hashable and comparable with the other
        list ids (ints or tuples of them). Under one set of estimates the keys of one
        list's groups must not decrease in the order they are made."""
        raise NotImplementedError

    def parts_for(self, block: KVCacheBlock) -> Any:
        """The key parts of ``block`` handed in without context; None: it is empty."""
        raise NotImplementedError

    # -- groups ---------------------------------------------------------------------------

    def _new_group(self, parts: Any) -> KeyGroup:
        if len(self._new_groups) > 2 * len(self._live_groups) + 1024:
            # Without re-keys, groups emptied by hits would pile up here.
            self._new_groups = [g for g in self._new_groups if g.num_live]
            self._new_heap = [entry for entry in self._new_heap
                              if entry[2] == entry[3].heap_version and entry[3].num_live]
            heapq.heapify(self._new_heap)
        self._num_groups_made += 1
        return KeyGroup(parts, self.key_of_parts(parts), self._num_groups_made)

    def _add_to_group(self, group: KeyGroup, block: KVCacheBlock) -> None:
        self._add_n_to_group(group, [block])

    def _add_n_to_group(self, group: KeyGroup, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the end of ``group``, in order."""
        if group.listed:
            raise RuntimeError("a group takes blocks only until the next re-key")
        if not blocks:
            return
        # _enter_n's work and the group's, in one pass: this runs for every released block.
        versions, group_of = self._versions, self._group_of
        append = group.entries.append
        for block in blocks:
            block_id = block.block_id
            try:
                version = versions[block_id] + 1
            except IndexError:  # a block the queue was not built with
                versions.extend([0] * (block_id + 1 - len(versions)))
                version = 1
            versions[block_id] = version
            append((block, version))
            group_of[block_id] = group
        self.num_free_blocks += len(blocks)
        group.num_live += len(blocks)
        if group.num_live == len(blocks):  # (again) in the running
            self._live_groups[group.order] = group
            self._new_groups.append(group)
            group.heap_version += 1
            heapq.heappush(self._new_heap,
                           (group.key, group.order, group.heap_version, group))

    def _add_empty(self, block: KVCacheBlock) -> None:
        self._empty.append((block, self._enter(block)))

    def _recompute_keys(self) -> None:
        """Key every group with free blocks from the current estimates: the new groups
        join their lists, and each list's head is keyed."""
        lists = self._lists
        list_of_parts = self.list_of_parts
        for group in self._new_groups:
            if group.num_live and not group.listed:  # (a group refilled is here twice)
                group.listed = True
                list_id = list_of_parts(group.parts)
                groups = lists.get(list_id)
                if groups is None:
                    groups = lists[list_id] = deque()
                groups.append(group)
                self._num_listed += 1
        self._new_groups = []
        self._new_heap = []
        heads = []
        for list_id in list(lists):
            head = self._list_head(list_id)
            if head is not None:
                head.key = self.listed_key_of_parts(head.parts)
                heads.append((head.key, head.order, list_id))
        heapq.heapify(heads)
        self._heads = heads

    def _list_head(self, list_id: Any) -> KeyGroup | None:
        """The first group of the list with free blocks (emptied ones ahead of it are
        dropped); None, and the list is dropped, if it has none."""
        groups = self._lists.get(list_id)
        if groups is None:
            return None
        while groups and not groups[0].num_live:
            groups.popleft()
            self._num_listed -= 1
        if not groups:
            del self._lists[list_id]
            return None
        return groups[0]

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        self._leave_group(block)

    def _leave_group(self, block: KVCacheBlock) -> None:
        group = self._group_of.pop(block.block_id, None)
        if group is None:  # an empty block
            return
        group.num_live -= 1
        if group.num_live == 0:
            self._drop_emptied(group)

    def _drop_emptied(self, group: KeyGroup) -> None:
        """``group`` has no free block left."""
        del self._live_groups[group.order]
        group.entries.clear()
        group.next_index = 0
        if self._num_listed > 2 * len(self._live_groups) + 1024:
            self._compact_lists()

    def _compact_lists(self) -> None:
        """Drop the emptied groups from every list (the heads' entries may go stale)."""
        for list_id, groups in list(self._lists.items()):
            live = deque(group for group in groups if group.num_live)
            if live:
                self._lists[list_id] = live
            else:
                del self._lists[list_id]
        self._num_listed = sum(len(groups) for groups in self._lists.values())

    def _lowest_group(self) -> KeyGroup | None:
        """The group with free blocks whose (key, order) is lowest, if any."""
        new_heap = self._new_heap
        while new_heap:
            _, _, heap_version, group = new_heap[0]
            if heap_version == group.heap_version and group.num_live:
                break
            heapq.heappop(new_heap)
        heads = self._heads
        while heads:
            _, order, list_id = heads[0]
            head = self._list_head(list_id)
            if head is not None and head.order == order:
                break
            heapq.heappop(heads)
            if head is not None:  # a stale entry: the list's head is now a later group
                head.key = self.listed_key_of_parts(head.parts)
                heapq.heappush(heads, (head.key, head.order, list_id))
        if not heads:
            return new_heap[0][3] if new_heap else None
        if not new_heap or heads[0][:2] < new_heap[0][:2]:
            return self._lists[heads[0][2]][0]
        return new_heap[0][3]

    def _pop_lowest(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The ``n`` next blocks: the empty ones, then group by group, each group's in
        order (a group stays the lowest while blocks are taken: no key changes)."""
        self._check_take(n)
        taken: list[KVCacheBlock] = []
        empty = self._empty
        while empty and len(taken) < n:
            block, version = empty.popleft()
            if self._leave_if_current(block, version):
                taken.append(block)
        versions, group_of = self._versions, self._group_of
        while len(taken) < n:
            group = self._lowest_group()  # there is one: n blocks are free
            entries, index = group.entries, group.next_index
            num_taken = len(taken)
            wanted = min(n - num_taken, group.num_live)
            while len(taken) - num_taken < wanted:
                block, version = entries[index]
                index += 1
                block_id = block.block_id
                if versions[block_id] == version:  # else taken or hit since it joined
                    versions[block_id] = version + 1
                    del group_of[block_id]
                    taken.append(block)
            group.next_index = index
            group.num_live -= wanted
            self.num_free_blocks -= wanted
            if not group.num_live:
                self._drop_emptied(group)
        return taken

    # -- the free-queue contract -----------------------------------------------------------

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Empty blocks join the FIFO; the others one new group per distinct parts."""
        groups: dict[Any, KeyGroup] = {}
        for block in blocks:
            parts = self.parts_for(block)
            if parts is None:
                self._add_empty(block)
                continue
            group = groups.get(parts)
            if group is None:
                group = groups[parts] = self._new_group(parts)
            self._add_to_group(group, block)

    def _current_entries(self, entries) -> list[KVCacheBlock]:
        versions = self._versions
        return [block for block, version in entries
                if versions[block.block_id] == version]

    def _current_key(self, group: KeyGroup) -> Any:
        return self.listed_key_of_parts(group.parts) if group.listed else group.key

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block in eviction order. O(n + groups log groups); for tests and
        tools."""
        blocks = self._current_entries(self._empty)
        for group in sorted(self._live_groups.values(),
                            key=lambda g: (self._current_key(g), g.order)):
            blocks += self._current_entries(group.entries[group.next_index:])
        return blocks

    def free_block_keys(self) -> dict[int, Any]:
        """Each free block's current key (None for the empty ones); for tests and tools."""
        keys: dict[int, Any] = {block.block_id: None
                                for block in self._current_entries(self._empty)}
        for group in self._live_groups.values():
            key = self._current_key(group)
            for block in self._current_entries(group.entries[group.next_index:]):
                keys[block.block_id] = key
        return keys

    def _empty_every_block(self) -> None:
        """Move every free block, in eviction order, to the empty FIFO (their content was
        just dropped). Every group is left empty and unlisted, so a subclass may still add
        to one."""
        blocks = self.get_all_free_blocks()
        for group in self._live_groups.values():
            group.entries.clear()
            group.next_index = group.num_live = 0
        for groups in self._lists.values():
            for group in groups:  # a subclass may still add to one: it is new again
                group.listed = False
        self._live_groups.clear()
        self._group_of.clear()
        self._new_groups = []
        self._new_heap = []
        self._lists.clear()
        self._num_listed = 0
        self._heads = []
        self._empty.clear()
        for block in blocks:  # out, then back in with a fresh version
            self._leave_if_current(block, self._versions[block.block_id])
            self._add_empty(block)
