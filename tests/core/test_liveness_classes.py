"""The key classes ``adaptive``'s liveness order reads: a pair of a document's and a
conversation's class, whose log-odds are the document's, the conversation's, or the
higher of the two, from the models' latest fits."""

from __future__ import annotations

import pytest

from prefixcache.core.eviction.liveness_classes import NO_CLASS, LivenessKeyClasses
from tests.core.test_liveness_order import Estimates


def refit(model: Estimates, log_odds: list[float]) -> None:
    model.log_odds = log_odds
    model.num_fits += 1


def test_a_pair_reads_the_higher_of_its_classes_or_the_one_it_has():
    documents, conversations = Estimates([-2.0, 1.0]), Estimates([0.5, -1.0])
    classes = LivenessKeyClasses(documents, conversations)
    both_low_document = classes.key_class(0, 0)
    both_high_document = classes.key_class(1, 1)
    document_only = classes.key_class(1, NO_CLASS)
    conversation_only = classes.key_class(NO_CLASS, 1)
    assert classes.class_log_odds(both_low_document) == 0.5
    assert classes.class_log_odds(both_high_document) == 1.0
    assert classes.class_log_odds(document_only) == 1.0
    assert classes.class_log_odds(conversation_only) == -1.0
    assert classes.key_class(1, 1) == both_high_document  # numbered once
    with pytest.raises(ValueError, match="needs a document's or a conversation's class"):
        classes.key_class(NO_CLASS, NO_CLASS)


@pytest.mark.parametrize("refitted", ["documents", "conversations"])
def test_the_log_odds_follow_either_models_refit(refitted):
    documents, conversations = Estimates([0.0]), Estimates([0.0])
    classes = LivenessKeyClasses(documents, conversations)
    pair = classes.key_class(0, 0)
    assert classes.all_class_log_odds == [0.0]
    fits_before = classes.num_fits
    refit({"documents": documents, "conversations": conversations}[refitted], [2.5])
    assert classes.num_fits == fits_before + 1
    assert classes.class_log_odds(pair) == 2.5
