"""Fixtures for the engine tests: a tiny random Llama (built with transformers, saved as a
Hugging Face folder once per session) and, for a few tests, the default SmolLM2.

Two choices keep greedy outputs free of float-noise flips, so "identical token for token"
tests test the engine and not rounding: the output head is scaled up (logits spread over
tens of units, no near-ties for argmax) and the EOS row of the head is zero (logit 0, far
below the greedy maximum), so greedy generation runs to ``max_tokens``. The tokenizer's
alphabet is printable ASCII, so every token decodes to whole characters.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.model.loader import load_model

SPECIAL_TOKENS = ["<|end|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 320
MAX_POSITION_EMBEDDINGS = 512
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog, again and again. " * 4,
    "prefix caching reuses the key and value blocks of prompts that share a prefix.",
    "0123456789 hello world! blocks, slots, tokens, hits and requests; (tiny) [model]?",
]


def _build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Byte-level symbols of printable ASCII, space (G-dot) and newline (C-dot) only.
    alphabet = [chr(b) for b in range(0x21, 0x7F)] + ["\u0120", "\u010a"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama with GQA in a Hugging Face folder, with tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = _build_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    eos_id = tokenizer.token_to_id("<|end|>")
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
        model.lm_head.weight[eos_id].zero_()
    model.save_pretrained(model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE,
    }))
    return model_dir


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """The tiny model loaded once, shared by every engine (each has its own KV cache)."""
    return load_model(tiny_model_dir)


@pytest.fixture
def make_engine(tiny_model):
    """Build an engine on the tiny model; options as in ``LLMEngine.from_options``."""
    def make(**options) -> LLMEngine:
        options.setdefault("num_kv_blocks", 256)
        return LLMEngine.from_options(tiny_model, **options)
    return make


@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct), loaded once."""
    return load_model(None)
