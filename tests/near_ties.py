"""Greedy outputs that may differ only where float noise can decide.

A batched matmul, a cache-hit prefill or a compiled (fused) kernel rounds differently from
another path by ~1e-6. Where a model's two best logits are that close, greedy decoding may
go either way, and from there the two outputs continue from different contexts. The tiny
test models spread their logits over tens of units, so such near-ties are rare but do
occur; a real error (wrong KV, wrong positions) moves logits by whole units.
"""

from __future__ import annotations

import torch

# Two logits this close are a coin toss for float noise, and orders of magnitude below
# what a real error does.
NEAR_TIE_LOGIT_GAP = 1e-3


def load_reference_model(model_dir):
    """The Hugging Face folder ``model_dir`` in transformers, float32, for reference logits."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def assert_same_or_split_at_a_near_tie(reference_model, prompt_token_ids: list[int],
                                       expected: list[int], actual: list[int]) -> None:
    """``actual`` equals ``expected`` token for token, or first differs where the reference
    model's two best logits (given the prompt and the common part) are the two tokens
    taken and closer than ``NEAR_TIE_LOGIT_GAP``; nothing after that point is compared."""
    assert len(actual) == len(expected)
    split = next((i for i, (a, b) in enumerate(zip(expected, actual, strict=True)) if a != b),
                 None)
    if split is None:
        return
    context = torch.tensor([prompt_token_ids + expected[:split]])
    with torch.no_grad():
        logits = reference_model(context).logits[0, -1]
    top_two = logits.topk(2)
    assert {expected[split], actual[split]} == set(top_two.indices.tolist()), \
        (split, expected, actual)
    gap = float(top_two.values[0] - top_two.values[1])
    assert gap < NEAR_TIE_LOGIT_GAP, (split, gap, expected, actual)
