"""Rebuild a `tokenizers.Tokenizer` from the `tokenizer.ggml.*` metadata of a GGUF file.

Supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`), the family used by SmolLM2,
Llama 3 and Qwen2/3. `tokenizer.ggml.pre` names how text is split before BPE; each supported
value maps to the pre-tokenizer of the original `tokenizer.json`. Anything else is a
ValueError naming it, rather than a tokenizer that silently splits text differently from
the one the model was trained with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

# GPT-2's split: contractions, letters, digits, other symbols, whitespace.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's split: case-insensitive contractions, digits in runs of at most three.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's split: like Llama 3 but every digit on its own.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _pre_tokenizer(pre: str) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # Every digit is its own token, then GPT-2's split.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("llama-bpe", "llama3"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in ("qwen2", "qwen35"):
        split = pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    raise ValueError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}")


def build_gguf_tokenizer(metadata: Mapping[str, Any]) -> BackendTokenizer:
    """A backend tokenizer equivalent to the one described by GGUF `metadata`."""
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type is None:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
    if model_type != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {model_type!r}; only byte-level BPE ('gpt2')"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    pre = metadata.get("tokenizer.ggml.pre", "default")
    bpe = models.BPE(
        vocab={token: token_id for token_id, token in enumerate(tokens)},
        merges=merges,
        # Llama 3 looks a whole pre-token up in the vocabulary before merging.
        ignore_merges=pre in ("llama-bpe", "llama3"),
    )
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()

    token_types = metadata.get("tokenizer.ggml.token_type") or []
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind == _TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(token_types)
        if kind == _TOKEN_TYPE_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)
    backend.post_processor = _post_processor(metadata, tokens)
    return backend


def _post_processor(metadata: Mapping[str, Any], tokens: list[str]) -> Any:
    """Adds BOS / EOS around encoded text when the file asks for it."""
    single, pieces = "$A", []
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        single = f"{tokens[bos_id]} {single}"
        pieces.append((tokens[bos_id], bos_id))
    if metadata.get("tokenizer.ggml.add_eos_token", False) and eos_id is not None:
        single = f"{single} {tokens[eos_id]}"
        pieces.append((tokens[eos_id], eos_id))
    if not pieces:
        return processors.ByteLevel(trim_offsets=False)
    return processors.TemplateProcessing(single=single, special_tokens=pieces)
