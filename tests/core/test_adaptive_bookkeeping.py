"""``adaptive``'s per-block bookkeeping: the ghost list, ``note_taken``, ``sort_released``
and ``mark_hashed``, in Python (the reference) and in C (the same contract, checked here
against the reference and against an OrderedDict)."""

from __future__ import annotations

import gc
import random
import sys
from collections import OrderedDict

import pytest

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction import adaptive_bookkeeping
from prefixcache.core.eviction.adaptive_bookkeeping import (
    NATIVE_BOOKKEEPING,
    PythonGhostList,
    python_note_taken,
    python_sort_released,
)

needs_c = pytest.mark.skipif(
    not NATIVE_BOOKKEEPING, reason="the package was built without a C compiler "
    "(tests/core/test_native_extensions.py fails where one is installed)")

PYTHON = pytest.param((PythonGhostList, python_note_taken, python_sort_released),
                      id="python")
NATIVE = pytest.param(
    (adaptive_bookkeeping.NativeGhostList, adaptive_bookkeeping.native_note_taken,
     adaptive_bookkeeping.native_sort_released), id="c", marks=needs_c)
IMPLEMENTATIONS = [PYTHON, NATIVE]

NEW = ()  # what adaptive marks a taken block's state with


def key(i: int) -> bytes:
    return i.to_bytes(2, "big") * 16


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_ghost_list_keeps_an_ordered_dicts_order(implementation):
    """New keys go last, a key added again keeps its place with its new values, pop
    takes a key out anywhere, the oldest go first beyond max_size: an OrderedDict's
    rules, over thousands of random operations."""
    ghost_list_type = implementation[0]
    rng = random.Random(5)
    for max_size in (0, 1, 7, 50):
        ghost = ghost_list_type(max_size)
        model: OrderedDict[bytes, tuple[int, object]] = OrderedDict()
        for step in range(3_000):
            k = key(rng.randrange(80))
            action = rng.random()
            if action < 0.6:
                state = rng.choice([None, NEW, [3, step]])
                ghost.add(k, step, state)
                model[k] = (step, state)
                while len(model) > max_size:
                    model.popitem(last=False)
            elif action < 0.9:
                if k in model:
                    assert ghost.pop(k) == model.pop(k)
                else:
                    with pytest.raises(KeyError):
                        ghost.pop(k)
            elif action < 0.91:
                ghost.clear()
                model.clear()
            assert len(ghost) == len(model)
            assert (k in ghost) == (k in model)
        assert ghost.keys() == list(model)
        for k, (evicted_at, state) in model.items():
            assert ghost[k][0] == evicted_at and ghost[k][1] is state
        with pytest.raises(KeyError):
            ghost[key(999)]


def property_in(attribute: str) -> property:
    """A read-write property that keeps its value in ``attribute``."""
    return property(lambda self: getattr(self, attribute),
                    lambda self, value: setattr(self, attribute, value))


class PropertyBlock(KVCacheBlock):
    """A block whose id and hash are properties (kept in slots of its own); the block
    class's slots, which the properties hide, hold decoys."""

    __slots__ = ("_id", "_hash")
    block_id = property_in("_id")
    block_hash = property_in("_hash")

    def __init__(self, block_id: int) -> None:
        self._hash = None
        super().__init__(block_id)
        KVCacheBlock.block_id.__set__(self, 10**6)
        KVCacheBlock.block_hash.__set__(self, key(999))


class DictBlock:
    """A block of no block class, keeping its attributes in a __dict__."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash = None


def make_blocks(rng: random.Random, num_blocks: int, num_keys: int,
                block_types: tuple[type, ...] = (KVCacheBlock,)) -> list[KVCacheBlock]:
    blocks = [rng.choice(block_types)(block_id) for block_id in range(num_blocks)]
    for block in blocks:
        if rng.random() < 0.85:
            block.block_hash = key(rng.randrange(num_keys))
    return blocks


def random_world(seed: int, block_types: tuple[type, ...] = (KVCacheBlock,)):
    """Blocks (of ``block_types``, at random), reuse marks, unproven states and a ghost
    list's contents, at random: the same for the same seed, with state objects of their
    own."""
    rng = random.Random(seed)
    num_blocks = 40
    blocks = make_blocks(rng, num_blocks, 60, block_types)
    states = [None, NEW, [1, 0], [2, 1], [], ()]
    is_reused = bytearray(rng.random() < 0.3 for _ in range(num_blocks))
    unproven = [rng.choice(states) for _ in range(num_blocks)]
    ghost_entries = [(key(rng.randrange(60)), step, rng.choice(states)) for step in range(50)]
    return rng, blocks, states, is_reused, unproven, ghost_entries


def named(obj, known: list):
    """``obj`` with every block named by its id and every object in ``known`` by its place
    there (so that identity is compared, not equality)."""
    if isinstance(obj, KVCacheBlock | DictBlock):
        return f"block {obj.block_id}"
    if isinstance(obj, bytes | int):
        return obj
    if isinstance(obj, list | tuple) and not any(obj is s for s in known):
        return type(obj)(named(item, known) for item in obj)
    return next(f"state {i}" for i, s in enumerate(known) if obj is s)


def run_both(seed: int, operation, block_types: tuple[type, ...] = (KVCacheBlock,)):
    """``operation(implementation, rng, blocks, is_reused, unproven, ghost, state)`` on
    the same random world under each implementation (``state``: a fresh list for new
    content). Returns, per implementation, what it returned and the world after it,
    :func:`named`."""
    results = []
    for implementation in (PYTHON.values[0], NATIVE.values[0]):
        rng, blocks, states, is_reused, unproven, ghost_entries = random_world(seed,
                                                                             block_types)
        ghost = implementation[0](30)
        for k, evicted_at, state in ghost_entries:
            ghost.add(k, evicted_at, state)
        state: list = []
        known = [*states, state]
        returned = operation(implementation, rng, blocks, is_reused, unproven, ghost, state)
        ghost_keys = ghost.keys()
        results.append((named(returned, known), bytes(is_reused), named(unproven, known),
                        [(k, named(ghost[k], known)) for k in ghost_keys]))
    return results


@needs_c
@pytest.mark.parametrize("seed", range(8))
def test_note_taken_in_c_does_what_the_reference_does(seed):
    def take(implementation, rng, blocks, is_reused, unproven, ghost, state):
        return implementation[1](rng.sample(blocks, 25), ghost, 1_000, is_reused, unproven,
                                 NEW)

    python, native = run_both(seed, take)
    assert python == native
    assert python[0] > 1_000


@needs_c
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("finished", [True, False])
def test_sort_released_in_c_does_what_the_reference_does(seed, finished):
    def release(implementation, rng, blocks, is_reused, unproven, ghost, state):
        # Many blocks share hashes with the ghost list: found, then gone for the rest.
        return implementation[2](rng.sample(blocks, 30), finished, is_reused, unproven,
                                 ghost, 1_050, rng.choice([10, 30, 100]), 128, state, NEW)

    python, native = run_both(seed, release)
    assert python == native
    unhashed, lower, protected, new, sampled_new, credits = python[0]
    assert protected and lower and unhashed


#: Blocks of the block class mixed with blocks whose attributes are properties, or in a
#: __dict__: the C functions read the block class's slots directly, and must read every
#: other block as getattr does, whichever type comes first.
MIXED_BLOCK_TYPES = [pytest.param((KVCacheBlock, PropertyBlock, DictBlock), id="mixed"),
                     pytest.param((PropertyBlock,), id="properties"),
                     pytest.param((DictBlock,), id="dicts")]


@needs_c
@pytest.mark.parametrize("block_types", MIXED_BLOCK_TYPES)
@pytest.mark.parametrize("seed", range(3))
def test_the_c_functions_read_blocks_of_any_type_as_getattr_does(seed, block_types):
    def take(implementation, rng, blocks, is_reused, unproven, ghost, state):
        return implementation[1](rng.sample(blocks, 25), ghost, 1_000, is_reused, unproven,
                                 NEW)

    def release(implementation, rng, blocks, is_reused, unproven, ghost, state):
        return implementation[2](rng.sample(blocks, 30), True, is_reused, unproven,
                                 ghost, 1_050, 30, 128, state, NEW)

    for operation in (take, release):
        python, native = run_both(seed, operation, block_types)
        assert python == native
    for mark_hashed in (adaptive_bookkeeping.python_mark_hashed,
                        adaptive_bookkeeping.native_mark_hashed):
        blocks = make_blocks(random.Random(seed), 40, 60, block_types)
        per_block = [None] * 40
        mark_hashed(blocks, per_block, "marked")
        assert per_block == ["marked" if block.block_hash is not None else None
                             for block in sorted(blocks, key=lambda block: block.block_id)]


@needs_c
def test_the_c_functions_find_a_blocks_attributes_where_getattr_does():
    """A metaclass whose own ``block_hash`` hands out the block class's slot descriptor:
    looking the name up on the class finds that slot, but an instance's getattr finds
    the subclass's property. The C functions must read what getattr reads."""
    slot = KVCacheBlock.__dict__["block_hash"]

    class Meta(type):
        @property
        def block_hash(cls):
            return slot

    class Sub(KVCacheBlock, metaclass=Meta):
        __slots__ = ("_hash",)
        block_hash = property_in("_hash")

    block = Sub(0)
    slot.__set__(block, key(7))  # a decoy in the slot the property hides
    for mark_hashed in (adaptive_bookkeeping.python_mark_hashed,
                        adaptive_bookkeeping.native_mark_hashed):
        per_block = [None]
        mark_hashed([block], per_block, "marked")
        assert per_block == [None]


@needs_c
def test_the_c_functions_raise_for_a_block_whose_slot_is_empty():
    """A block class instance with its hash slot deleted: AttributeError, as getattr."""
    ghost = adaptive_bookkeeping.NativeGhostList(4)
    blocks = [KVCacheBlock(0), KVCacheBlock(1)]
    blocks[0].block_hash = key(1)
    del blocks[1].block_hash
    with pytest.raises(AttributeError):
        adaptive_bookkeeping.native_note_taken(blocks, ghost, 0, bytearray(2), [None] * 2,
                                               NEW)
    with pytest.raises(AttributeError):
        adaptive_bookkeeping.native_mark_hashed(blocks, [None] * 2, "marked")
    with pytest.raises(AttributeError):
        adaptive_bookkeeping.native_sort_released(blocks, True, bytearray(2), [None] * 2,
                                                  ghost, 0, 1, 256, [], NEW)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sort_released_sorts_each_kind_of_block(implementation):
    ghost_list_type, _, sort_released = implementation
    blocks = [KVCacheBlock(i) for i in range(6)]
    for block, name in zip(blocks[1:], (b"reused", b"recent", b"old", b"new", b"cold"),
                           strict=True):
        block.block_hash = name.ljust(32, b"\x00")  # last byte 0: every new one sampled
    is_reused = bytearray([0, 1, 0, 0, 0, 0])
    earlier = [7, 0]  # unproven new content evicted earlier, then recomputed
    unproven = [NEW, NEW, NEW, NEW, NEW, None]
    ghost = ghost_list_type(10)
    ghost.add(blocks[2].block_hash, 95, earlier)  # 5 evictions ago
    ghost.add(blocks[3].block_hash, 80, None)  # 20 evictions ago: just beyond the reach
    state: list = []
    unhashed, lower, protected, new, sampled_new, credits = sort_released(
        blocks, True, is_reused, unproven, ghost, 100, 20, 1, state, NEW)
    assert unhashed == [blocks[0]]
    assert protected == [blocks[1], blocks[2]]
    assert lower == [blocks[3], blocks[4], blocks[5]]
    assert new == [blocks[4]] and sampled_new == [blocks[4].block_hash]
    assert credits == [earlier] and credits[0] is earlier
    assert is_reused == bytearray([0, 1, 1, 0, 0, 0])
    assert unproven[0] is NEW and unproven[4] is state
    assert unproven[1] is unproven[2] is unproven[3] is unproven[5] is None
    assert not len(ghost)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_note_taken_records_evictions_in_order(implementation):
    ghost_list_type, note_taken, _ = implementation
    blocks = [KVCacheBlock(i) for i in range(4)]
    blocks[0].block_hash, blocks[2].block_hash, blocks[3].block_hash = key(1), key(2), key(3)
    is_reused = bytearray([1, 1, 1, 1])
    old = [5, 0]
    unproven = [old, None, NEW, None]
    ghost = ghost_list_type(2)
    assert note_taken(blocks, ghost, 40, is_reused, unproven, NEW) == 43
    assert is_reused == bytearray(4) and all(state is NEW for state in unproven)
    assert ghost.keys() == [key(2), key(3)]  # key(1) trimmed: at most 2 kept
    assert ghost[key(2)] == (41, NEW) and ghost[key(3)] == (42, None)


@needs_c
def test_the_c_functions_refuse_what_they_cannot_use():
    native = adaptive_bookkeeping
    ghost = native.NativeGhostList(4)
    block = KVCacheBlock(3)
    block.block_hash = "not bytes"
    with pytest.raises(TypeError):
        native.native_note_taken([block], ghost, 0, bytearray(4), [None] * 4, NEW)
    with pytest.raises(TypeError):
        ghost.add("not bytes", 0, None)
    block.block_hash = key(1)
    for is_reused, unproven in ((bytearray(3), [None] * 4), (bytearray(4), [None] * 3)):
        with pytest.raises(IndexError):
            native.native_note_taken([block], ghost, 0, is_reused, unproven, NEW)
        with pytest.raises(IndexError):
            native.native_sort_released([block], True, is_reused, unproven, ghost, 0, 1,
                                        256, [], NEW)
    with pytest.raises(TypeError):  # the Python ghost list is not the C one's
        native.native_note_taken([block], PythonGhostList(4), 0, bytearray(4), [None] * 4,
                                 NEW)
    with pytest.raises(TypeError):
        native.native_note_taken((block,), ghost, 0, bytearray(4), [None] * 4, NEW)
    with pytest.raises(ValueError):
        native.NativeGhostList(-1)
    assert not len(ghost) and "not bytes" not in ghost


@needs_c
def test_the_c_ghost_list_refuses_changes_from_inside_a_change():
    """A block whose hash attribute changes the ghost list being filled: the change is
    refused, the call fails, and the list is whole."""
    ghost = adaptive_bookkeeping.NativeGhostList(4)

    class MeddlingBlock(KVCacheBlock):
        __slots__ = ()

        @property
        def block_hash(self):
            ghost.clear()
            return key(1)

        @block_hash.setter
        def block_hash(self, value):
            pass

    ghost.add(key(2), 0, None)
    with pytest.raises(RuntimeError, match="middle of a change"):
        adaptive_bookkeeping.native_note_taken([MeddlingBlock(0)], ghost, 1, bytearray(1),
                                               [None], NEW)
    assert ghost.keys() == [key(2)]


@needs_c
def test_the_c_ghost_list_leaks_nothing_and_is_collected_in_cycles():
    k = key(42)
    state = [1, 2]
    before = sys.getrefcount(k), sys.getrefcount(state)
    ghost = adaptive_bookkeeping.NativeGhostList(2)
    for step in range(10):
        ghost.add(k, step, state)
        ghost.add(key(step), step, state)
    ghost.pop(key(9))
    ghost.clear()
    ghost.add(k, 0, state)
    del ghost
    assert (sys.getrefcount(k), sys.getrefcount(state)) == before

    class Holder:
        collected = False

        def __del__(self):
            Holder.collected = True

    ghost = adaptive_bookkeeping.NativeGhostList(2)
    holder = Holder()
    holder.ghost = ghost
    ghost.add(k, 0, holder)  # ghost -> holder -> ghost
    del ghost, holder
    gc.collect()
    assert Holder.collected


def test_adaptive_uses_the_c_bookkeeping_where_it_is_built():
    from prefixcache.core.eviction.adaptive import AdaptiveFreeBlockQueue

    expected = (adaptive_bookkeeping.NativeGhostList if NATIVE_BOOKKEEPING
                else PythonGhostList)
    assert AdaptiveFreeBlockQueue.ghost_list_type is expected
    assert type(AdaptiveFreeBlockQueue([KVCacheBlock(0)]).ghost) is expected


MARK_HASHED = [
    pytest.param(adaptive_bookkeeping.python_mark_hashed, id="python"),
    pytest.param(adaptive_bookkeeping.native_mark_hashed, id="c", marks=needs_c)]


@pytest.mark.parametrize("mark_hashed", MARK_HASHED)
def test_mark_hashed_sets_only_blocks_holding_a_hash(mark_hashed):
    blocks = [KVCacheBlock(i) for i in (4, 0, 2, 3)]
    blocks[0].block_hash, blocks[2].block_hash = key(1), key(2)
    first, second = (1, 2.0, 3), (4, 5.0, 6)
    per_block = ["untouched"] * 5
    mark_hashed(blocks, per_block, first)
    assert per_block == ["untouched", "untouched", first, "untouched", first]
    assert per_block[4] is first
    blocks[3].block_hash = key(3)
    mark_hashed(blocks[2:], per_block, second)
    assert per_block == ["untouched", "untouched", second, second, first]
    mark_hashed([], per_block, first)
    assert per_block[2] is second


@pytest.mark.parametrize("mark_hashed", MARK_HASHED)
def test_mark_hashed_refuses_a_block_beyond_the_list(mark_hashed):
    inside, beyond = KVCacheBlock(0), KVCacheBlock(3)
    inside.block_hash = beyond.block_hash = key(1)
    per_block = [None] * 3
    with pytest.raises(IndexError):
        mark_hashed([inside, beyond], per_block, "value")
    assert per_block == ["value", None, None]  # the blocks before the failing one are done


@needs_c
def test_the_c_mark_hashed_keeps_references_right():
    native = adaptive_bookkeeping.native_mark_hashed
    blocks = [KVCacheBlock(i) for i in range(3)]
    for block in blocks:
        block.block_hash = key(block.block_id)
    old, new = [0], [1]
    per_block = [old] * 3
    before = sys.getrefcount(old), sys.getrefcount(new)
    native(blocks, per_block, new)
    assert sys.getrefcount(old) == before[0] - 3 and sys.getrefcount(new) == before[1] + 3
    with pytest.raises(TypeError):
        native(tuple(blocks), per_block, new)
    with pytest.raises(TypeError):
        native(blocks, tuple(per_block), new)
