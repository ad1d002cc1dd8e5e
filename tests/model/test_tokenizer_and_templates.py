"""Chat templates rendered as transformers renders them, HF-folder tokenizers, streaming."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from prefixcache.model.chat_template import ChatTemplateError, render_chat_template
from prefixcache.model.detokenizer import IncrementalDetokenizer
from prefixcache.model.gguf_tokenizer import build_gguf_tokenizer
from prefixcache.model.tokenizer import Tokenizer, load_tokenizer


def test_blocks_are_trimmed_and_left_stripped():
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "U:{{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]
    assert render_chat_template(template, messages, add_generation_prompt=True) == "U:hi\nA:"


def test_raise_exception_surfaces_as_chat_template_error():
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="user first"):
        render_chat_template(template, [{"role": "assistant", "content": "a"}])


def test_bos_eos_tojson_loopcontrols_and_generation_blocks():
    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}{{ eos_token }}"
        "{{ tools | tojson }}"
    )
    messages = [{"role": "user", "content": c} for c in ("café", "b", "dropped")]
    rendered = render_chat_template(
        template, messages, bos_token="<s>", eos_token="</s>", tools=[{"name": "f"}]
    )
    assert rendered == '<s>"café""b"</s>[{"name": "f"}]'


def test_sandbox_blocks_attribute_escapes():
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        render_chat_template("{{ messages.__class__.__mro__ }}", [])


def tiny_backend() -> BackendTokenizer:
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4, "Ġ": 5, "Ġab": 6}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("Ġ", "ab")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return backend


def test_hf_folder_tokenizer_with_named_templates(tmp_path):
    tiny_backend().save(str(tmp_path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.eos_token_ids == (1, 3)
    assert tokenizer.encode("ab ab") == [4, 6]
    messages = [{"role": "user", "content": "ab"}]
    assert tokenizer.apply_chat_template(messages) == "<s>ab"


def test_hf_folder_chat_template_file(tmp_path):
    tiny_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("[{{ messages | length }}]")
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "[1]"


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        Tokenizer.from_hf_dir(tmp_path)


def test_no_chat_template_is_an_error(tmp_path):
    tiny_backend().save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_hf_dir(tmp_path).apply_chat_template([])


def gguf_metadata(pre: str = "smollm", model: str = "gpt2") -> dict:
    return {
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab", "1", "2", "Ġ"],
        "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }


def test_gguf_tokenizer_splits_digits_and_adds_bos():
    backend = build_gguf_tokenizer(gguf_metadata())
    assert backend.encode("ab12").ids == [0, 3, 4, 5]
    assert backend.encode("<s>ab", add_special_tokens=False).ids == [0, 3]


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (gguf_metadata(pre="mystery"), "tokenizer.ggml.pre='mystery'"),
        (gguf_metadata(model="llama"), "unsupported GGUF tokenizer model 'llama'"),
        ({}, "tokenizer.ggml.model is missing"),
    ],
)
def test_unsupported_gguf_tokenizers_are_named(metadata, message):
    with pytest.raises(ValueError, match=message):
        build_gguf_tokenizer(metadata)


def test_incremental_detokenizer_streams_whole_characters():
    # A byte-level vocabulary without merges: every UTF-8 byte is its own token, so the
    # 4-byte emoji and 3-byte kanji each span several tokens.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = Tokenizer(backend)
    text = "a 🎉b 日本"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([token_id]) for token_id in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert "" in deltas  # held back while a character was incomplete
