"""Driving an engine to completion in tests."""

from __future__ import annotations

import random

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams


def run_to_completion(
    engine: LLMEngine, earlier_outputs: list[RequestOutput] = (), max_steps: int = 10_000
) -> dict[str, RequestOutput]:
    """Step until nothing is left; the final output of every request, by id. Also checks
    that deltas concatenate to the cumulative fields (``earlier_outputs``: outputs of
    steps the caller already took)."""
    finals: dict[str, RequestOutput] = {}
    texts: dict[str, str] = {}
    token_ids: dict[str, list[int]] = {}
    steps = [list(earlier_outputs)]
    for _ in range(max_steps):
        if not steps:
            if not engine.has_unfinished_requests():
                break
            steps.append(engine.step())
        for output in steps.pop():
            rid = output.request_id
            texts[rid] = texts.get(rid, "") + output.new_text
            token_ids[rid] = token_ids.get(rid, []) + output.new_token_ids
            assert texts[rid] == output.text
            assert token_ids[rid] == output.token_ids
            assert rid not in finals, f"output for {rid} after it finished"
            if output.finished:
                finals[rid] = output
    else:
        raise AssertionError("engine did not finish")
    return finals


def run_batch(engine: LLMEngine, prompts: list[list[int]],
              params: SamplingParams) -> list[RequestOutput]:
    """All ``prompts`` added at once and run to completion; their final outputs in order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finals = run_to_completion(engine)
    return [finals[str(i)] for i in range(len(prompts))]


def solo_token_ids(model, prompts: list[list[int]], params: SamplingParams,
                   block_size: int) -> list[list[int]]:
    """Each prompt alone on a fresh engine with no prefix cache: the ground truth a
    batched, cached or preempted run must equal."""
    outputs = []
    for prompt in prompts:
        engine = LLMEngine.from_options(model, enable_prefix_caching=False,
                                        block_size=block_size, num_kv_blocks=64)
        engine.add_request("r", prompt, params)
        outputs.append(run_to_completion(engine)["r"].token_ids)
    return outputs


def random_tokens(rng: random.Random, n: int, vocab_size: int, low: int = 3) -> list[int]:
    """``n`` random token ids, avoiding the special tokens at the start of the vocabulary."""
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == engine.num_kv_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert not engine.scheduler.has_unfinished_requests()
