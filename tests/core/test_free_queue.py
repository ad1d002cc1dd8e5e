"""KVCacheBlock and the intrusive doubly linked free queue."""

from __future__ import annotations

import pytest

from prefixcache.core import EVICTION_POLICIES, FreeKVCacheBlockQueue, KVCacheBlock


def make_blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def check_links(queue: FreeKVCacheBlockQueue) -> None:
    """Walk both ways between the sentinels; the count must match each walk."""
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    assert head.prev_free_block is None
    assert tail.next_free_block is None
    forward = []
    node = head
    while node.next_free_block is not None:
        assert node.next_free_block.prev_free_block is node
        node = node.next_free_block
        forward.append(node)
    assert node is tail
    backward = []
    node = tail
    while node.prev_free_block is not None:
        node = node.prev_free_block
        backward.append(node)
    assert node is head
    inner = forward[:-1]
    assert inner == list(reversed(backward[:-1]))
    assert len(inner) == queue.num_free_blocks == len(queue.get_all_free_blocks())
    assert len({id(b) for b in inner}) == len(inner)


def check_detached(*blocks: KVCacheBlock) -> None:
    for block in blocks:
        assert block.prev_free_block is None
        assert block.next_free_block is None


# -- KVCacheBlock ------------------------------------------------------------------------

def test_block_defaults():
    block = KVCacheBlock(7)
    assert block.block_id == 7
    assert block.ref_cnt == 0
    assert block.block_hash is None
    check_detached(block)


def test_block_hash_set_and_reset():
    block = KVCacheBlock(0)
    block.block_hash = b"h" * 32
    assert block.block_hash == b"h" * 32
    block.block_hash = None
    assert block.block_hash is None


def test_block_is_slotted():
    block = KVCacheBlock(0)
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        block.arbitrary_attribute = 1


# -- construction ------------------------------------------------------------------------

def test_empty_queue_links_the_sentinels():
    queue = FreeKVCacheBlockQueue([])
    assert queue.num_free_blocks == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head
    assert ids(queue) == []
    check_links(queue)


def test_one_block_queue():
    (block,) = blocks = make_blocks(1)
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 1
    assert queue.fake_free_list_head.next_free_block is block
    assert queue.fake_free_list_tail.prev_free_block is block
    assert block.prev_free_block is queue.fake_free_list_head
    assert block.next_free_block is queue.fake_free_list_tail
    check_links(queue)


def test_initial_order_is_block_order():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4, 5]
    assert blocks[2].prev_free_block is blocks[1]
    assert blocks[2].next_free_block is blocks[3]
    check_links(queue)


# -- popleft -----------------------------------------------------------------------------

def test_popleft_takes_the_head_and_clears_its_pointers():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    check_detached(blocks[0])
    assert queue.fake_free_list_head.next_free_block is blocks[1]
    assert blocks[1].prev_free_block is queue.fake_free_list_head
    assert ids(queue) == [1, 2]
    check_links(queue)


def test_popleft_until_empty_then_raises():
    blocks = make_blocks(2)
    queue = FreeKVCacheBlockQueue(blocks)
    assert [queue.popleft().block_id, queue.popleft().block_id] == [0, 1]
    assert queue.num_free_blocks == 0
    check_links(queue)
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()
    assert queue.num_free_blocks == 0
    check_links(queue)


# -- popleft_n ---------------------------------------------------------------------------

def test_popleft_n_zero_changes_nothing():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    assert queue.popleft_n(0) == []
    assert ids(queue) == [0, 1, 2]
    check_links(queue)


def test_popleft_n_one():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft_n(1) == [blocks[0]]
    check_detached(blocks[0])
    assert ids(queue) == [1, 2]
    check_links(queue)


def test_popleft_n_many_in_head_order_with_pointers_cleared():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    popped = queue.popleft_n(3)
    assert [b.block_id for b in popped] == [0, 2, 3]
    check_detached(*popped)
    assert queue.fake_free_list_head.next_free_block is blocks[4]
    assert blocks[4].prev_free_block is queue.fake_free_list_head
    assert ids(queue) == [4, 5]
    check_links(queue)


def test_popleft_n_everything_leaves_head_linked_to_tail():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft_n(4) == blocks
    check_detached(*blocks)
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head
    check_links(queue)


def test_popleft_n_more_than_free_raises_and_removes_nothing():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft_n(4)
    assert ids(queue) == [0, 1, 2]
    check_links(queue)
    queue.popleft_n(3)
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft_n(1)


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_popleft_n_negative_raises_and_zero_takes_nothing_under_every_policy(policy):
    blocks = make_blocks(3)
    queue = EVICTION_POLICIES[policy](blocks)
    with pytest.raises(ValueError, match="negative"):
        queue.popleft_n(-2)
    assert queue.popleft_n(0) == []
    assert queue.num_free_blocks == 3
    assert ids(queue) == [0, 1, 2]
    assert queue.popleft_n(3) == blocks


# -- remove ------------------------------------------------------------------------------

def test_remove_from_middle_head_and_tail():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    check_detached(blocks[2])
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    assert ids(queue) == [0, 1, 3, 4]
    queue.remove(blocks[0])
    assert ids(queue) == [1, 3, 4]
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert queue.fake_free_list_tail.prev_free_block is blocks[3]
    check_links(queue)


def test_remove_a_block_not_in_the_queue_is_an_error_and_changes_nothing():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    with pytest.raises((RuntimeError, ValueError)):
        queue.remove(blocks[1])
    assert ids(queue) == [0, 2]
    check_links(queue)


# -- append / append_n / prepend_n -------------------------------------------------------

def test_append_goes_to_the_tail():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append(blocks[3])
    queue.append(blocks[2])
    assert ids(queue) == [0, 1, 3, 2]
    assert queue.fake_free_list_tail.prev_free_block is blocks[2]
    check_links(queue)


def test_append_to_empty_queue():
    blocks = make_blocks(1)
    queue = FreeKVCacheBlockQueue([])
    queue.append(blocks[0])
    assert ids(queue) == [0]
    check_links(queue)


@pytest.mark.parametrize("order", [[], [5], [7, 5, 6], [6, 7, 5]])
def test_append_n_keeps_the_given_order(order):
    blocks = make_blocks(8)
    queue = FreeKVCacheBlockQueue(blocks[:3])
    queue.append_n([blocks[i] for i in order])
    assert ids(queue) == [0, 1, 2] + order
    check_links(queue)


def test_append_n_to_empty_queue():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue([])
    queue.append_n([blocks[2], blocks[0], blocks[1]])
    assert ids(queue) == [2, 0, 1]
    check_links(queue)


@pytest.mark.parametrize("order", [[], [5], [7, 5, 6]])
def test_prepend_n_goes_in_front_in_the_given_order(order):
    blocks = make_blocks(8)
    queue = FreeKVCacheBlockQueue(blocks[:3])
    queue.prepend_n([blocks[i] for i in order])
    assert ids(queue) == order + [0, 1, 2]
    check_links(queue)


def test_second_prepend_goes_in_front_of_the_first():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.prepend_n([blocks[2], blocks[3]])
    queue.prepend_n([blocks[5], blocks[4]])
    assert ids(queue) == [5, 4, 2, 3, 0, 1]
    check_links(queue)


def test_prepend_n_to_empty_queue():
    blocks = make_blocks(2)
    queue = FreeKVCacheBlockQueue([])
    queue.prepend_n([blocks[1], blocks[0]])
    assert ids(queue) == [1, 0]
    assert queue.popleft() is blocks[1]
    check_links(queue)


# -- a whole life ------------------------------------------------------------------------

def test_get_all_free_blocks_reflects_every_operation():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)
    steps = [
        (lambda: queue.popleft(), [1, 2, 3, 4, 5]),
        (lambda: queue.remove(blocks[3]), [1, 2, 4, 5]),
        (lambda: queue.append(blocks[0]), [1, 2, 4, 5, 0]),
        (lambda: queue.popleft_n(2), [4, 5, 0]),
        (lambda: queue.append_n([blocks[2], blocks[1]]), [4, 5, 0, 2, 1]),
        (lambda: queue.prepend_n([blocks[3]]), [3, 4, 5, 0, 2, 1]),
        (lambda: queue.remove(blocks[1]), [3, 4, 5, 0, 2]),
    ]
    for op, expected in steps:
        op()
        assert ids(queue) == expected
        check_links(queue)


def test_drain_and_refill():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)
    drained = [queue.popleft() for _ in range(5)]
    assert drained == blocks
    assert queue.num_free_blocks == 0
    check_links(queue)
    queue.append_n(list(reversed(blocks)))
    assert ids(queue) == [4, 3, 2, 1, 0]
    check_links(queue)
    assert [b.block_id for b in queue.popleft_n(5)] == [4, 3, 2, 1, 0]
    check_links(queue)
    for block in blocks:
        queue.append(block)
    assert ids(queue) == [0, 1, 2, 3, 4]
    check_links(queue)
