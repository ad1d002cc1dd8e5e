"""Text deltas of one request, fed token by token (no model): whole characters only,
stop strings trimmed, stop tokens not rendered."""

from __future__ import annotations

import pytest

from prefixcache.core.request import Request, RequestStatus
from prefixcache.engine.request_state import RequestState
from prefixcache.engine.sampling_params import SamplingParams

# The parrot and the last CJK character each span several tokens.
TEXT = "Caf\u00e9 \U0001F642 na\u00efve \u4e2d\u6587 \U0001F99C\u9f98 done"


def feed(tokenizer, token_ids, params, eos_token_ids=()):
    """Append ``token_ids`` one at a time; returns the outputs and the finish status."""
    request = Request("r", [1, 2, 3])
    state = RequestState(request, params, tokenizer, eos_token_ids, arrival_time=0.0)
    outputs, status = [], None
    for token_id in token_ids:
        request.append_output_token_ids(token_id)
        status = state.append_token(token_id, max_model_len=10_000)
        if status is not None:
            state.finish(status)
        outputs.append(state.make_output())
        if status is not None:
            break
    return outputs, status


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def test_multibyte_characters_are_never_split(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(tokenizer.decode(token_ids[:n]).endswith("\ufffd")
               for n in range(len(token_ids)))  # some characters span several tokens
    outputs, status = feed(tokenizer, token_ids, SamplingParams(max_tokens=len(token_ids)))
    assert status == RequestStatus.FINISHED_LENGTH
    assert all("\ufffd" not in output.new_text for output in outputs)
    assert "".join(output.new_text for output in outputs) == TEXT == outputs[-1].text


def test_stop_string_across_tokens_is_trimmed(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    outputs, status = feed(tokenizer, token_ids, SamplingParams(max_tokens=100, stop=["ve \u4e2d"]))
    assert status == RequestStatus.FINISHED_STOPPED
    assert outputs[-1].text == "Caf\u00e9 \U0001F642 na\u00ef"
    assert "".join(output.new_text for output in outputs) == outputs[-1].text


def test_eos_ends_the_request_without_being_rendered(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    token_ids = tokenizer.encode("Hello there", add_special_tokens=False) + [eos, 42, 43]
    outputs, status = feed(tokenizer, token_ids, SamplingParams(max_tokens=100), (eos,))
    assert status == RequestStatus.FINISHED_STOPPED
    assert outputs[-1].text == "Hello there" and outputs[-1].token_ids[-1] == eos
    ignored, status = feed(tokenizer, token_ids, SamplingParams(max_tokens=100,
                                                                 ignore_eos=True), (eos,))
    assert status is None and len(ignored) == len(token_ids)


def test_stop_string_completed_by_the_text_flushed_at_finish_is_trimmed(tokenizer):
    # The last token leaves the emoji incomplete: its bytes are held back while running
    # and flushed as U+FFFD at finish, where a stop string can still complete.
    token_ids = tokenizer.encode("Hi \U0001F99C", add_special_tokens=False)  # parrot
    cut = next(n for n in range(1, len(token_ids))
               if tokenizer.decode(token_ids[:n]).endswith("\ufffd"))
    token_ids = token_ids[:cut]
    outputs, status = feed(tokenizer, token_ids, SamplingParams(max_tokens=cut))
    assert status == RequestStatus.FINISHED_LENGTH
    assert outputs[-1].text.endswith("\ufffd") and outputs[-1].finish_reason == "length"
    outputs, _ = feed(tokenizer, token_ids, SamplingParams(max_tokens=cut, stop=["\ufffd"]))
    assert outputs[-1].text == "Hi " and outputs[-1].finish_reason == "stop"
    assert "".join(output.new_text for output in outputs) == "Hi "
