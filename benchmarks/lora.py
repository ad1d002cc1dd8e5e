"""Multi-LoRA serving on the default model: batched adapters' cost, and cache hits.

Prints one JSON object. Each comparison is measured side by side in this one run, its two
sides interleaved (A, B, A, B, ...) so that drift in machine load hits both alike; the
best of the repeats is reported.

1. ``four_adapters_vs_base``: one batch of requests (random prompts, greedy, EOS ignored)
   run on the base model vs. the same batch split evenly over 4 LoRA adapters (rank 16 on
   all seven projections: the most work an adapter adds), ``max_loras=4`` so every step
   mixes the four; prefix caching off so both compute every token. Reported: wall time of
   each and their ratio (target <= 1.5).
2. ``per_adapter_system_prompts``: 4 adapters, each with its own system prompt, and
   ``--requests-per-adapter`` user turns per adapter, run in one batch with prefix
   caching on. Reported: the prefix-cache hit rate (hit tokens / prompt tokens looked up)
   and what an ideal cache would hit: every request after the first of its adapter
   reuses the whole system prompt, which only whole blocks can hold.

The adapters are random PEFT folders written here (``adapter_config.json`` and
``adapter_model.safetensors``), so the benchmark needs no download.

    python benchmarks/lora.py            # ~2-4 minutes on 2 cores
    python benchmarks/lora.py --quick    # smaller sizes, a smoke test
"""

from __future__ import annotations

import os

# Before torch starts OpenMP (see prefix_ttft.py): passive waiting keeps figures stable on a
# shared machine. An explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from prefixcache.engine.llm_engine import LLMEngine  # noqa: E402
from prefixcache.engine.sampling_params import SamplingParams  # noqa: E402
from prefixcache.lora import LoRARequest  # noqa: E402
from prefixcache.lora.adapter import module_shapes  # noqa: E402
from prefixcache.model.loader import LoadedModel, load_model  # noqa: E402

FIRST_ORDINARY_TOKEN = 20  # SmolLM2's special tokens sit below this
NUM_ADAPTERS = 4
LORA_RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path, loaded: LoadedModel, seed: int) -> Path:
    """A PEFT LoRA folder for `loaded` with random A and B (PEFT's key names)."""
    folder.mkdir(parents=True, exist_ok=True)
    arch = loaded.arch_config
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (out_features, in_features) in module_shapes(arch).items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = \
                torch.randn(LORA_RANK, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = \
                torch.randn(out_features, LORA_RANK, generator=generator) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
        "target_modules": list(TARGETS), "bias": "none", "use_rslora": False,
    }))
    return folder


def run_batch(engine: LLMEngine, prompts: list[list[int]], loras: list, max_tokens: int
              ) -> float:
    """Seconds to run every prompt to completion, all submitted at once."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for index, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{index}-{start}", prompt, params, lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def four_adapters_vs_base(loaded, adapters, args) -> dict:
    rng = random.Random(0)
    vocab = loaded.arch_config.vocab_size
    prompts = [[rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(args.prompt_tokens)]
               for _ in range(args.batch)]
    split = [adapters[i % NUM_ADAPTERS] for i in range(args.batch)]
    engine = LLMEngine.from_options(loaded, enable_lora=True, max_loras=NUM_ADAPTERS,
                                    max_lora_rank=LORA_RANK, enable_prefix_caching=False,
                                    max_num_seqs=args.batch)
    for adapter in adapters:
        engine.add_lora(adapter)
    run_batch(engine, prompts[:2], split[:2], 2)  # warm-up: first-call costs
    base_times, lora_times = [], []
    for _ in range(args.repeats):
        base_times.append(run_batch(engine, prompts, [None] * args.batch, args.max_tokens))
        lora_times.append(run_batch(engine, prompts, split, args.max_tokens))
    base_s, lora_s = min(base_times), min(lora_times)
    return {
        "batch": args.batch, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "adapters": NUM_ADAPTERS, "lora_rank": LORA_RANK,
        "target_modules": list(TARGETS), "repeats": args.repeats,
        "base_s": round(base_s, 3), "four_adapters_s": round(lora_s, 3),
        "ratio": round(lora_s / base_s, 3),
        "base_s_all": [round(t, 3) for t in base_times],
        "four_adapters_s_all": [round(t, 3) for t in lora_times],
    }


def per_adapter_system_prompts(loaded, adapters, args) -> dict:
    rng = random.Random(1)
    vocab = loaded.arch_config.vocab_size
    block_size = 16
    system_prompts = [[rng.randrange(FIRST_ORDINARY_TOKEN, vocab)
                       for _ in range(args.system_tokens)] for _ in adapters]
    prompts, loras = [], []
    for _ in range(args.requests_per_adapter):
        for adapter, system in zip(adapters, system_prompts, strict=True):
            question = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab)
                        for _ in range(args.question_tokens)]
            prompts.append(system + question)
            loras.append(adapter)
    engine = LLMEngine.from_options(loaded, enable_lora=True, max_loras=NUM_ADAPTERS,
                                    max_lora_rank=LORA_RANK, block_size=block_size,
                                    max_num_seqs=len(prompts))
    # One request per adapter first, so the others find its system prompt cached.
    run_batch(engine, prompts[:NUM_ADAPTERS], loras[:NUM_ADAPTERS], args.max_tokens)
    run_batch(engine, prompts[NUM_ADAPTERS:], loras[NUM_ADAPTERS:], args.max_tokens)
    stats = engine.get_stats()
    num_prompt_tokens = sum(len(p) for p in prompts)
    ideal_hits = (len(prompts) - NUM_ADAPTERS) * (args.system_tokens // block_size * block_size)
    return {
        "adapters": NUM_ADAPTERS, "requests_per_adapter": args.requests_per_adapter,
        "system_tokens": args.system_tokens, "question_tokens": args.question_tokens,
        "prompt_tokens": num_prompt_tokens, "hit_tokens": stats.prefix_cache_hits,
        "hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "ideal_hit_rate": round(ideal_hits / num_prompt_tokens, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--requests-per-adapter", type=int, default=8)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.prompt_tokens, args.max_tokens, args.repeats = 8, 32, 8, 1
        args.system_tokens, args.requests_per_adapter = 64, 3
    loaded = load_model(None, torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(f"adapter-{i}", i + 1,
                        str(write_random_adapter(Path(tmp) / f"adapter-{i}", loaded, seed=i)))
            for i in range(NUM_ADAPTERS)
        ]
        result = {
            "model": "SmolLM2-135M-Instruct (float32)",
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "four_adapters_vs_base": four_adapters_vs_base(loaded, adapters, args),
            "per_adapter_system_prompts": per_adapter_system_prompts(loaded, adapters, args),
        }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
