"""Quantized decode against the dequantized file: greedy agreement, logits, perplexity, and
decode speed, for each way of computing the output head.

Run from the repository root (it reads the contract's prompts from tests/). Loads the
default model (or MODEL) three times in float32: dense (``--quantization none``,
the file dequantized: the reference), int4 decode with the int8 head whose leading logits
are recomputed from the dense weights (the default), and int4 decode with the int8 head
alone (no recomputation); with ``--dense-head`` also int4 layers with the dense head.
Prints JSON: per variant, the first differing token of greedy text on fixed prompts, the
teacher-forced largest logit difference and argmax agreement on a fixed text, the
perplexity ratio, and decode ms/token at a short context (best of ``--repeats``,
variants alternated in one process).

    python benchmarks/quantized_agreement.py [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.entrypoints.llm import LLM
from prefixcache.model.loader import load_model
from prefixcache.model.quantized_linear import DecodeQuantizedLinear, RescoredDecodeHead

# The contract's fixed prompts and text, measured here at length.
from tests.model.test_smollm2_quantized import (
    PROMPTS,
    TEXT,
    perplexity,
    teacher_forced_logits,
)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def greedy_token_ids(loaded, max_tokens: int) -> list[list[int]]:
    llm = LLM(loaded, max_num_seqs=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(list(PROMPTS), params)]


def decode_seconds_per_token(loaded, num_tokens: int) -> float:
    llm = LLM(loaded, max_num_seqs=1, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([PROMPTS[0]], params)
    return (time.perf_counter() - start) / num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speed-tokens", type=int, default=64)
    parser.add_argument("--dense-head", action="store_true",
                        help="also measure int4 layers with the dense output head")
    args = parser.parse_args()
    torch.set_num_threads(2)

    dense = load_model(None, quantization="none")
    variants = {"int4, rescored int8 head": load_model(None, quantization="auto")}
    plain = load_model(None, quantization="auto")
    head = plain.model.decode_lm_head
    assert isinstance(head, RescoredDecodeHead)
    plain.model.decode_lm_head = DecodeQuantizedLinear(
        head.weight, None, head.quantized, head.max_quantized_tokens)
    variants["int4, int8 head"] = plain
    if args.dense_head:
        dense_head = load_model(None, quantization="auto")
        dense_head.model.decode_lm_head = None
        variants["int4, dense head"] = dense_head

    reference_text = greedy_token_ids(dense, args.max_tokens)
    token_ids = dense.tokenizer.encode(TEXT)
    reference_logits = teacher_forced_logits(dense, token_ids)
    reference_perplexity = perplexity(reference_logits, token_ids)
    results = {"none": {"perplexity": round(reference_perplexity, 3)}}
    for name, loaded in variants.items():
        text = greedy_token_ids(loaded, args.max_tokens)
        logits = teacher_forced_logits(loaded, token_ids)
        difference = (logits - reference_logits).abs().amax(dim=1)
        results[name] = {
            "greedy_first_difference": [first_difference(a, b)
                                        for a, b in zip(text, reference_text, strict=True)],
            "max_logit_difference": round(difference.max().item(), 3),
            "median_logit_difference": round(difference.median().item(), 3),
            "argmax_agreement": round(
                (logits.argmax(1) == reference_logits.argmax(1)).float().mean().item(), 4),
            "perplexity": round(perplexity(logits, token_ids), 3),
            "perplexity_ratio": round(perplexity(logits, token_ids) / reference_perplexity, 4),
        }
    timed = {"none": dense, **variants}
    best = dict.fromkeys(timed, math.inf)
    for _ in range(args.repeats):
        for name, loaded in timed.items():
            best[name] = min(best[name], decode_seconds_per_token(loaded, args.speed_tokens))
    for name, seconds in best.items():
        results[name]["decode_ms_per_token"] = round(seconds * 1e3, 1)
    print(json.dumps({"max_tokens": args.max_tokens, "repeats": args.repeats,
                      "load_average": os.getloadavg()[0], "results": results}, indent=2))


if __name__ == "__main__":
    main()
