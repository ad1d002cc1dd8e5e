"""Request models and flag parsing that need no server."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from prefixcache.arg_types import byte_size
from prefixcache.entrypoints.openai.errors import from_validation_error
from prefixcache.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize(("text", "value"), [("1000", 1000), ("64KiB", 65536), ("2GiB", 2 << 30),
                                              ("1.5G", 1_500_000_000), ("512mib", 512 << 20),
                                              ("10kb", 10_000)])
def test_byte_size(text, value):
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-5", "0", "1.2.3GiB", "5XB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


def test_completion_prompt_shapes():
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_chat_messages_join_text_parts_and_ignore_unknown_fields():
    request = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "some_future_field": {"x": 1}, "max_completion_tokens": 3})
    assert request.chat_messages() == [{"role": "user", "content": "a\nb"}]
    assert request.requested_max_tokens == 3


def test_validation_error_names_the_field_not_the_union_member():
    with pytest.raises(ValidationError) as excinfo:
        CompletionRequest.model_validate({"prompt": 5})
    error = from_validation_error(excinfo.value)
    assert (error.status, error.param) == (400, "prompt")
    with pytest.raises(ValidationError) as excinfo:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
            {"type": "image_url"}]}]})
    error = from_validation_error(excinfo.value)
    assert error.param == "messages.0.content"
    assert "only text content parts" in error.message
