"""The documents a liveness model learns from: each finished request counted on the
document its first full block names, the least recently asked about forgotten first."""

from __future__ import annotations

from prefixcache.core.eviction.document_liveness_model import DocumentLivenessModel
from prefixcache.core.eviction.document_tracker import DocumentTracker
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.request import Request

HASHER = BlockHasher(4, hash_seed="tests")


def finished(request_id: str, document: int, num_prompt_tokens: int,
             num_output_tokens: int = 1) -> Request:
    """A request about ``document`` (its first block's tokens) with a prompt of
    ``num_prompt_tokens`` (at least 4), having generated ``num_output_tokens``."""
    tokens = [document] * 4 + [document + 1 + t for t in range(num_prompt_tokens - 4)]
    request = Request(request_id, tokens, block_hasher=HASHER)
    for step in range(num_output_tokens):
        request.append_output_token_ids(7 + step)
    return request


def test_the_least_recently_asked_about_document_is_forgotten_first():
    tracker = DocumentTracker(DocumentLivenessModel(), max_documents=2)
    tracker.note_finished(finished("a1", 100, 8))
    tracker.note_finished(finished("b1", 200, 8))
    again = tracker.note_finished(finished("a2", 100, 8))  # a is now the latest
    tracker.note_finished(finished("c1", 300, 8))
    kept = list(tracker.documents.values())
    assert len(kept) == 2 and again in kept
    assert again.num_requests == 2
    # b, forgotten, starts over: its next request is its first again.
    assert tracker.note_finished(finished("b2", 200, 8)).num_requests == 1


def test_a_document_remembers_the_range_of_its_prompt_lengths_and_its_first_request():
    model = DocumentLivenessModel()
    tracker = DocumentTracker(model)
    first = tracker.note_finished(finished("1", 100, 12, num_output_tokens=5))
    assert model.finest_class_key(first) == ("first", (5).bit_length(), (12).bit_length())
    for request_id, length in (("2", 7), ("3", 30), ("4", 20)):
        document = tracker.note_finished(finished(request_id, 100, length))
    assert document is first
    assert (document.min_prompt_tokens, document.max_prompt_tokens) == (7, 30)
    assert (document.first_prompt_tokens, document.first_output_tokens) == (12, 5)
    assert model.finest_class_key(document) == ("again", (30 - 7).bit_length(), 4)


def test_requests_without_a_full_prompt_block_are_not_counted():
    tracker = DocumentTracker(DocumentLivenessModel())
    short = Request("short", [1, 2, 3], block_hasher=HASHER)
    assert tracker.note_finished(short) is None
    assert tracker.note_finished(None) is None
    assert not tracker.documents
