"""One engine replica as its own process, for the KV tier tests: loads a model folder,
runs greedy requests one at a time and prints one JSON line with what happened.

    python -m tests.kv_tier.replica MODEL_DIR KV_TIER_URL REQUESTS_JSON

``REQUESTS_JSON`` is a list of ``{"prompt": [token ids], "cache_salt": str | null}``.
The output has each request's ``token_ids`` and ``num_cached_tokens``, the engine's
stats and ``leaked_blocks`` (blocks still held once everything finished: 0 when sound).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.sampling_params import SamplingParams

MAX_TOKENS = 8
BLOCK_SIZE = 8
NUM_KV_BLOCKS = 64


def run(engine: LLMEngine, requests: list[dict]) -> list[dict]:
    """Each request to completion, one after another (greedy)."""
    results = []
    for index, request in enumerate(requests):
        request_id = f"r{index}"
        engine.add_request(request_id, request["prompt"],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           cache_salt=request.get("cache_salt"))
        final = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    final = output
        results.append({"token_ids": final.token_ids,
                        "num_cached_tokens": final.num_cached_tokens})
    return results


def main(model_dir: str, kv_tier: str, requests_json: str) -> None:
    torch.set_num_threads(1)
    engine = LLMEngine.from_options(
        model_dir, kv_tier=None if kv_tier == "none" else kv_tier,
        block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS)
    results = run(engine, json.loads(requests_json))
    leaked = engine.num_kv_blocks - engine.kv_cache_manager.num_free_blocks
    stats = dataclasses.asdict(engine.get_stats())
    engine.close()
    print(json.dumps({"results": results, "stats": stats, "leaked_blocks": leaked}))


if __name__ == "__main__":
    main(*sys.argv[1:])
