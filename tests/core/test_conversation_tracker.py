"""Conversations inside documents: which conversation a request goes on from, which of its
blocks are its own, and ``document-liveness`` judging those blocks by the conversation."""

from __future__ import annotations

import pytest

from prefixcache.core import Request
from prefixcache.core.eviction.conversation_tracker import ConversationTracker
from prefixcache.core.eviction.document_liveness import (
    NO_CLASS,
    DocumentLivenessFreeBlockQueue,
)
from prefixcache.core.eviction.document_liveness_model import (
    DocumentHistory,
    DocumentLivenessModel,
)
from tests.core.helpers import free_ids, make_manager, seq
from tests.core.test_document_liveness import BLOCK_SIZE, run_request


def note(tracker: ConversationTracker, document: DocumentHistory, hashes: list[bytes],
         previous_prompt: tuple[int, list[bytes]] | None = None):
    request = Request(f"r{tracker.model.now}", list(range(BLOCK_SIZE * len(hashes))))
    return tracker.note_request(request, hashes, document, previous_prompt)


def names(*labels: str) -> list[bytes]:
    return [label.encode() for label in labels]


@pytest.mark.parametrize("recent_conversations", [0, 2])
def test_a_request_goes_on_from_the_conversation_whose_latest_prompt_it_contains(
        recent_conversations):
    tracker = ConversationTracker(DocumentLivenessModel(),
                                  recent_conversations=recent_conversations)
    system = DocumentHistory(0, 0)
    first = note(tracker, system, names("s", "a1"))
    assert first.own_from == 0 and system.num_conversations == 1  # nothing seen before
    second = note(tracker, system, names("s", "b1"))
    # A new conversation; the system prompt is shared, its own blocks start after it.
    assert second is not first and second.own_from == 1
    assert system.num_conversations == 2
    # Each goes on from its own latest prompt.
    assert note(tracker, system, names("s", "a1", "a2")) is first
    assert note(tracker, system, names("s", "b1", "b2", "b3")) is second
    assert note(tracker, system, names("s", "a1", "a2", "a3")) is first
    assert first.history.num_requests == 3 and second.history.num_requests == 2
    # An earlier prompt of a conversation is no longer its tail: asking it again starts
    # a conversation, none of whose blocks are new.
    again = note(tracker, system, names("s", "b1"))
    assert again not in (first, second) and again.own_from == 2
    assert system.num_conversations == 3


def test_the_deepest_conversation_contained_is_the_one_continued():
    tracker = ConversationTracker(DocumentLivenessModel())
    document = DocumentHistory(0, 0)
    long = note(tracker, document, names("d", "q"))
    # Not a continuation: it does not contain the other's last block.
    short = note(tracker, document, names("d"))
    assert short is not long
    # Contains both conversations' latest prompts: goes on from the deeper one.
    assert note(tracker, document, names("d", "q", "r")) is long
    # Contains only the short one's.
    assert note(tracker, document, names("d", "x")) is short


def test_conversations_are_bounded():
    tracker = ConversationTracker(DocumentLivenessModel(), max_conversations=2)
    document = DocumentHistory(0, 0)
    first = note(tracker, document, names("a"))
    note(tracker, document, names("b"))
    note(tracker, document, names("c"))
    assert len(tracker._by_tail) == 2 and len(tracker.histories.documents) == 2
    # "a" was forgotten: a request that contains it starts a new conversation.
    assert note(tracker, document, names("a", "a2")) is not first
    with pytest.raises(ValueError):
        ConversationTracker(DocumentLivenessModel(), max_conversations=0)


@pytest.mark.parametrize("max_seen_hashes", [3, 100])
def test_seen_hashes_are_bounded(max_seen_hashes):
    tracker = ConversationTracker(DocumentLivenessModel(), max_seen_hashes=max_seen_hashes)
    document = DocumentHistory(0, 0)
    note(tracker, document, names("s", "x"))
    note(tracker, document, names("p"))
    note(tracker, document, names("q"))
    # Four seen, one more than three: all but the one seen last go.
    assert sorted(tracker._seen) == (names("q") if max_seen_hashes == 3
                                     else names("p", "q", "s", "x"))
    # A forgotten block counts as never seen.
    own_from = note(tracker, document, names("s", "y")).own_from
    assert own_from == (0 if max_seen_hashes == 3 else 1)
    with pytest.raises(ValueError):
        ConversationTracker(DocumentLivenessModel(), max_seen_hashes=0)


@pytest.mark.parametrize("recent_conversations", [0, 4])
def test_a_new_conversation_owns_from_its_first_block_no_earlier_prompt_had(
        recent_conversations):
    tracker = ConversationTracker(DocumentLivenessModel(),
                                  recent_conversations=recent_conversations)
    document = DocumentHistory(0, 0)
    note(tracker, document, names("s", "t", "u", "a"))
    for depth in range(5):
        # Shares the first `depth` blocks (at most three) with the first prompt.
        prompt = names("s", "t", "u")[:depth] + names(*(f"new{depth}-{i}" for i in range(4)))
        assert note(tracker, document, prompt).own_from == min(depth, 3)


def test_where_seen_blocks_were_forgotten_the_documents_latest_prompt_still_counts():
    tracker = ConversationTracker(DocumentLivenessModel(), max_seen_hashes=2)
    document = DocumentHistory(0, 0)
    first = names("d1", "d2", "d3", "q1")
    note(tracker, document, first)
    note(tracker, DocumentHistory(0, 0), names("x", "y", "z"))  # another document's
    assert not set(first) & set(tracker._seen)
    second = names("d1", "d2", "d3", "q2")
    # Without the document's latest prompt, nothing of the second question was seen...
    assert note(tracker, document, second).own_from == 0
    # ... with it (its block count and last hashes), the document's three blocks were.
    assert note(tracker, document, names("d1", "d2", "d3", "q3"),
                previous_prompt=(4, second[-2:])).own_from == 3
    # Only what its tail shows counts: here the prompts part before the tail's first block.
    assert note(tracker, document, names("d1", "e2", "e3", "q4"),
                previous_prompt=(4, second[-2:])).own_from == 0


def test_with_recent_conversations_a_branch_is_found_in_the_latest_k_only():
    tracker = ConversationTracker(DocumentLivenessModel(), recent_conversations=2)
    document = DocumentHistory(0, 0)
    note(tracker, document, names("s", "a1", "a2"))
    note(tracker, document, names("s", "b1"))
    # Branches off the first conversation, one of the document's latest two.
    assert note(tracker, document, names("s", "a1", "x")).own_from == 2
    note(tracker, document, names("s", "c1"))
    # Now the second is third latest: only the system prompt is found shared with the
    # two latest (the set of every block seen would find "b1" too).
    assert note(tracker, document, names("s", "b1", "y")).own_from == 1
    assert len(document.recent_conversations) == 2
    # A conversation going on moves to the front without taking a second place.
    latest = note(tracker, document, names("s", "c1", "c2"))
    assert document.recent_conversations[0] is latest
    assert len(set(map(id, document.recent_conversations))) == 2
    # Another document's conversations are never compared with.
    assert note(tracker, DocumentHistory(0, 0), names("s", "b1", "z")).own_from == 0
    with pytest.raises(ValueError):
        ConversationTracker(DocumentLivenessModel(), recent_conversations=-1)


def test_a_conversation_going_on_keeps_the_others_among_the_latest_k():
    tracker = ConversationTracker(DocumentLivenessModel(), recent_conversations=3)
    document = DocumentHistory(0, 0)
    note(tracker, document, names("s", "a1", "a2"))
    note(tracker, document, names("s", "b1"))
    note(tracker, document, names("s", "c1"))
    note(tracker, document, names("s", "b1", "b2"))  # the middle one goes on
    # The first is still among the latest three: a branch off it is found.
    assert note(tracker, document, names("s", "a1", "x")).own_from == 2


def test_the_documents_latest_prompt_only_raises_what_the_latest_k_show():
    tracker = ConversationTracker(DocumentLivenessModel(), recent_conversations=2)
    document = DocumentHistory(0, 0)
    note(tracker, document, names("s", "a1", "a2"))
    latest = names("s", "b1")
    note(tracker, document, latest)
    # Shares "s", "a1" with the first conversation, only "s" with the latest prompt.
    branch = note(tracker, document, names("s", "a1", "x"), previous_prompt=(2, latest))
    assert branch.own_from == 2


def test_with_recent_conversations_the_prompts_kept_are_bounded():
    tracker = ConversationTracker(DocumentLivenessModel(), max_seen_hashes=5,
                                  recent_conversations=4)
    document = DocumentHistory(0, 0)
    first = note(tracker, document, names("s", "a1", "a2"))
    second = note(tracker, document, names("s", "b1", "b2"))
    # Six hashes held, one more than five: the prompt kept longest is dropped...
    assert first.prompt is None and second.prompt == names("s", "b1", "b2")
    assert tracker._num_kept_hashes == 3
    # ... so a branch off it is found sharing only what the other shares with it.
    assert note(tracker, document, names("s", "a1", "x")).own_from == 1
    assert second.prompt is None  # and the new conversation's prompt took its room
    # A prompt longer than the bound is kept alone.
    note(tracker, document, names(*(f"long{i}" for i in range(8))))
    assert len(tracker._kept) == 1 and tracker._num_kept_hashes == 8


SYSTEM_PROMPT = seq(0, 8)  # two full blocks every conversation starts with


def play_chats(mgr, num_chats: int) -> None:
    """Conversations under one system prompt: every third goes on for five turns, the
    others end after one; interleaved, so that one-turn conversations keep coming."""
    for chat in range(num_chats):
        turns = 5 if chat % 3 == 0 else 1
        prompt = SYSTEM_PROMPT + seq(10_000 * (chat + 1), 4)
        for turn in range(turns):
            run_request(mgr, f"c{chat}t{turn}", prompt)
            prompt = prompt + seq(10_000 * (chat + 1) + 100 * (turn + 1), 4)


@pytest.mark.parametrize("conversations", [True, False])
def test_a_conversation_that_goes_on_outlives_one_that_looks_ended(conversations):
    mgr = make_manager(
        num_blocks=4000, block_size=BLOCK_SIZE, eviction_policy="document-liveness",
        free_queue_factory=lambda blocks, _: DocumentLivenessFreeBlockQueue(
            blocks, conversations=conversations))
    play_chats(mgr, 120)
    # A conversation three turns in, then (released later) a new one's first turn.
    going_on = SYSTEM_PROMPT + seq(5_000_000, 4)
    for turn in range(3):
        going_on_blocks = run_request(mgr, f"going on {turn}", going_on)
        going_on = going_on + seq(5_000_100 + 100 * turn, 4)
    new_blocks = run_request(mgr, "new", SYSTEM_PROMPT + seq(6_000_000, 4))
    order = free_ids(mgr)
    # The system prompt's blocks stay longest either way: every conversation needs them.
    assert min(order.index(b) for b in new_blocks[:2]) > max(
        order.index(b) for b in going_on_blocks[2:] + new_blocks[2:])
    # Each prompt's last block (the same depth, so the same depth term):
    going_on_last, new_last = order.index(going_on_blocks[-1]), order.index(new_blocks[-1])
    if conversations:
        # Conversations three turns in mostly go on; those one turn in mostly do not.
        assert new_last < going_on_last
    else:
        # One document: the same class term for both, whichever conversation goes on.
        group_of = mgr.block_pool.free_block_queue._group_of
        parts = [group_of[going_on_blocks[-1]].parts, group_of[new_blocks[-1]].parts]
        assert parts[0][0] == parts[1][0] and parts[0][3] == parts[1][3] == NO_CLASS


def test_own_blocks_are_keyed_by_the_conversation_once_the_document_has_several():
    mgr = make_manager(num_blocks=400, block_size=BLOCK_SIZE,
                       eviction_policy="document-liveness")
    queue = mgr.block_pool.free_block_queue
    lone = run_request(mgr, "lone", seq(0, 12))
    # The only conversation of its document: its blocks keep the document's term too.
    assert all(queue._group_of[b].parts[0] != NO_CLASS for b in lone)
    assert all(queue._group_of[b].parts[3] != NO_CLASS for b in lone)
    second = run_request(mgr, "second", seq(0, 8) + seq(500, 4))
    parts = [queue._group_of[b].parts for b in second]
    # Shared with the first conversation: the document's alone.
    assert all(p[0] != NO_CLASS and p[3] == NO_CLASS for p in parts[:2])
    # Its own block: the conversation's alone (two conversations share the document).
    assert parts[2][0] == NO_CLASS and parts[2][3] != NO_CLASS


def test_the_policy_gives_the_tracker_the_documents_prompt_before_this_one():
    mgr = make_manager(num_blocks=400, block_size=BLOCK_SIZE,
                       eviction_policy="document-liveness")
    queue = mgr.block_pool.free_block_queue
    queue.conversations.max_seen_hashes = 1  # the document's blocks are soon forgotten
    document = seq(0, 12)  # three full blocks
    run_request(mgr, "q1", document + seq(500, 4))
    run_request(mgr, "other", seq(9_000, 12))
    second = run_request(mgr, "q2", document + seq(600, 4))
    parts = [queue._group_of[block].parts for block in second]
    # The document's latest prompt (q1's) shows the three blocks were shared: they keep
    # the document's key; only the question is the new conversation's own.
    assert all(p[3] == NO_CLASS for p in parts[:3])
    assert parts[3][3] != NO_CLASS
