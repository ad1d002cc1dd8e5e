"""Prefix caching, end to end on the default model: TTFT, throughput, overhead, vs. HF.

Prints one JSON object. Every ratio is measured side by side in this one run, with the
measurements it compares interleaved (A, B, A, B, ...) so that drift in machine load hits
both sides alike; medians are reported.

1. ``ttft``: time to first token of a ~2,000-token prompt on a cold cache vs. a repeat that
   shares all but its last 16 tokens (target >= 10x).
2. ``shared_prefix_throughput``: 32 requests = a 1,500-token shared prefix + 100 unique
   tokens each, 64 output tokens (greedy, EOS ignored), all submitted at once; output
   tokens per second with prefix caching on vs. off (target >= 3x).
3. ``zero_hit_overhead``: the same engine work with every prompt unique (0% hits), caching
   on vs. off: wall time ratio, median over interleaved repeats (target <= 2% slower).
4. ``nested_prefix_throughput``: 32 requests = a 256-token system prompt all share, then
   one of 4 documents of 1,200 tokens (8 requests each), then 50 unique tokens; 64 output
   tokens. Caching on with cascade attention (groups nest: the system prompt is read once,
   each document once) vs. caching on without cascade (what grouping only by the first
   block did here: cut at the 256 tokens all share, the suffixes stay too long to halve
   the padded batch) vs. caching off.
5. ``vs_transformers``: the shared-prefix workload through Hugging Face ``generate``, one
   request at a time with its own KV cache, on the same weights; measured on the first
   ``--hf-requests`` requests (sequential, so its per-request rate does not depend on how
   many) and compared with our caching-on throughput.

    python benchmarks/prefix_ttft.py            # the full run (~10-20 minutes on 2 cores)
    python benchmarks/prefix_ttft.py --quick    # smaller sizes, a smoke test
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: on a shared machine, spinning OpenMP workers that lose their
# core to another process stall every parallel region (measured here: 2 threads 5x slower
# than 1 under load); passive waiting keeps the figures stable. An explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from prefixcache.engine.llm_engine import LLMEngine  # noqa: E402
from prefixcache.engine.sampling_params import SamplingParams  # noqa: E402
from prefixcache.model.loader import LoadedModel, load_model  # noqa: E402

# Token ids below this are SmolLM2's special tokens; random prompts avoid them.
FIRST_ORDINARY_TOKEN = 20


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(num_tokens)]


def make_engine(loaded: LoadedModel, enable_prefix_caching: bool, num_kv_blocks: int):
    return LLMEngine.from_options(loaded, enable_prefix_caching=enable_prefix_caching,
                                  num_kv_blocks=num_kv_blocks, max_num_batched_tokens=2048)


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Submit every prompt at once and run to completion: wall and CPU time, token counts,
    and the time spent scheduling (where all prefix-caching work — hashing, lookups, block
    bookkeeping — happens, apart from hashing blocks that generated tokens complete)."""
    schedule = engine.scheduler.schedule
    schedule_seconds = 0.0

    def timed_schedule():
        nonlocal schedule_seconds
        begin = time.perf_counter()
        output = schedule()
        schedule_seconds += time.perf_counter() - begin
        return output

    engine.scheduler.schedule = timed_schedule
    cpu_start = time.process_time()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    num_output_tokens = 0
    num_cached_tokens = 0
    finish_reasons: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                num_output_tokens += len(output.token_ids)
                num_cached_tokens += output.num_cached_tokens
                reason = output.finish_reason
                finish_reasons[reason] = finish_reasons.get(reason, 0) + 1
                if output.error:
                    print(f"request {output.request_id} failed: {output.error}",
                          file=sys.stderr)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "cpu_seconds": time.process_time() - cpu_start,
            "schedule_seconds": schedule_seconds, "output_tokens": num_output_tokens,
            "cached_tokens": num_cached_tokens, "finish_reasons": finish_reasons}


def time_to_first_token(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first sampled token, and the cached tokens."""
    start = time.perf_counter()
    engine.add_request("ttft", prompt, SamplingParams(temperature=0, max_tokens=1))
    while True:
        outputs = engine.step()
        if outputs:
            elapsed = time.perf_counter() - start
            (output,) = outputs
            assert output.finished
            return elapsed, output.num_cached_tokens


def bench_ttft(loaded: LoadedModel, args, rng: random.Random) -> dict:
    vocab_size = loaded.arch_config.vocab_size
    engine = make_engine(loaded, True, num_kv_blocks=1024)
    time_to_first_token(engine, random_prompt(rng, 64, vocab_size))  # warm-up
    cold, warm, cached = [], [], []
    for _ in range(args.ttft_repeats):
        prompt = random_prompt(rng, args.ttft_prompt_tokens, vocab_size)
        engine.reset_prefix_cache()
        seconds, num_cached = time_to_first_token(engine, prompt)
        assert num_cached == 0
        cold.append(seconds)
        repeat = prompt[:-16] + random_prompt(rng, 16, vocab_size)
        seconds, num_cached = time_to_first_token(engine, repeat)
        warm.append(seconds)
        cached.append(num_cached)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {
        "prompt_tokens": args.ttft_prompt_tokens,
        "cached_tokens_on_repeat": cached[0],
        "cold_ttft_s": round(cold_s, 4),
        "cached_ttft_s": round(warm_s, 4),
        "speedup": round(cold_s / warm_s, 2),
        "target": ">= 10x",
        "cold_samples_s": [round(s, 4) for s in cold],
        "cached_samples_s": [round(s, 4) for s in warm],
    }


def shared_prefix_prompts(args, rng: random.Random, vocab_size: int) -> list[list[int]]:
    prefix = random_prompt(rng, args.shared_prefix_tokens, vocab_size)
    return [prefix + random_prompt(rng, args.unique_tokens, vocab_size)
            for _ in range(args.num_requests)]


def bench_shared_prefix(loaded: LoadedModel, args, rng: random.Random) -> dict:
    vocab_size = loaded.arch_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    num_kv_blocks = args.num_kv_blocks
    results: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.throughput_repeats):
        prompts = shared_prefix_prompts(args, rng, vocab_size)
        for caching in (True, False):
            results[caching].append(
                run_all(make_engine(loaded, caching, num_kv_blocks), prompts, params))
    on = statistics.median(r["output_tokens"] / r["seconds"] for r in results[True])
    off = statistics.median(r["output_tokens"] / r["seconds"] for r in results[False])
    return {
        "num_requests": args.num_requests,
        "shared_prefix_tokens": args.shared_prefix_tokens,
        "unique_tokens": args.unique_tokens,
        "output_tokens": args.output_tokens,
        "num_kv_blocks": num_kv_blocks,
        "caching_on_tokens_per_s": round(on, 2),
        "caching_off_tokens_per_s": round(off, 2),
        "caching_on_seconds": [round(r["seconds"], 2) for r in results[True]],
        "caching_off_seconds": [round(r["seconds"], 2) for r in results[False]],
        "caching_on_cached_tokens": results[True][0]["cached_tokens"],
        "output_tokens_per_run": [r["output_tokens"] for r in results[True] + results[False]],
        "finish_reasons": results[True][0]["finish_reasons"],
        "speedup": round(on / off, 2),
        "target": ">= 3x",
    }


def nested_prefix_prompts(args, rng: random.Random, vocab_size: int) -> list[list[int]]:
    system = random_prompt(rng, args.nested_system_tokens, vocab_size)
    documents = [random_prompt(rng, args.nested_document_tokens, vocab_size)
                 for _ in range(args.nested_documents)]
    # Interleaved (document 0, 1, 2, 3, 0, ...) as requests about several documents arrive.
    return [system + documents[i % len(documents)]
            + random_prompt(rng, args.nested_unique_tokens, vocab_size)
            for i in range(args.num_requests)]


NO_CASCADE = 10**9  # a min_shared_prefix_tokens no group reaches


def bench_nested_prefix(loaded: LoadedModel, args, rng: random.Random) -> dict:
    vocab_size = loaded.arch_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    variants = {"cascade": (True, None), "no_cascade": (True, NO_CASCADE),
                "caching_off": (False, None)}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.throughput_repeats):
        prompts = nested_prefix_prompts(args, rng, vocab_size)
        for name, (caching, min_shared_tokens) in variants.items():
            engine = make_engine(loaded, caching, args.num_kv_blocks)
            if min_shared_tokens is not None:
                engine.runner.min_shared_prefix_tokens = min_shared_tokens
            results[name].append(run_all(engine, prompts, params))
    rate = {name: statistics.median(r["output_tokens"] / r["seconds"] for r in runs)
            for name, runs in results.items()}
    return {
        "num_requests": args.num_requests,
        "system_tokens": args.nested_system_tokens,
        "documents": args.nested_documents,
        "document_tokens": args.nested_document_tokens,
        "unique_tokens": args.nested_unique_tokens,
        "output_tokens": args.output_tokens,
        "tokens_per_s": {name: round(value, 2) for name, value in rate.items()},
        "seconds": {name: [round(r["seconds"], 2) for r in runs]
                    for name, runs in results.items()},
        "cached_tokens": {name: runs[0]["cached_tokens"] for name, runs in results.items()},
        "cascade_vs_no_cascade": round(rate["cascade"] / rate["no_cascade"], 2),
        "cascade_vs_caching_off": round(rate["cascade"] / rate["caching_off"], 2),
    }


def bench_zero_hit_overhead(loaded: LoadedModel, args, rng: random.Random) -> dict:
    vocab_size = loaded.arch_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.overhead_output_tokens,
                            ignore_eos=True)
    ratios, cpu_ratios, on_seconds, off_seconds = [], [], [], []
    schedule_seconds: dict[bool, list[float]] = {True: [], False: []}
    run_all(make_engine(loaded, True, args.num_kv_blocks),
            [random_prompt(rng, 32, vocab_size)], params)  # warm-up
    for repeat in range(args.overhead_repeats):
        prompts = [random_prompt(rng, args.overhead_prompt_tokens, vocab_size)
                   for _ in range(args.overhead_requests)]
        # Alternate which side goes first so neither always runs on a warmer machine.
        order = (True, False) if repeat % 2 == 0 else (False, True)
        runs = {}
        for caching in order:
            runs[caching] = run_all(make_engine(loaded, caching, args.num_kv_blocks),
                                    prompts, params)
            assert runs[caching]["cached_tokens"] == 0
            schedule_seconds[caching].append(runs[caching]["schedule_seconds"])
        on_seconds.append(runs[True]["seconds"])
        off_seconds.append(runs[False]["seconds"])
        ratios.append(runs[True]["seconds"] / runs[False]["seconds"])
        cpu_ratios.append(runs[True]["cpu_seconds"] / runs[False]["cpu_seconds"])
    median_ratio = statistics.median(ratios)
    median_cpu_ratio = statistics.median(cpu_ratios)
    # The caching work itself, as a share of the run: (schedule time on - off) / run time.
    direct = statistics.median(
        (on - off) / total for on, off, total in
        zip(schedule_seconds[True], schedule_seconds[False], off_seconds, strict=True))
    return {
        "num_requests": args.overhead_requests,
        "prompt_tokens": args.overhead_prompt_tokens,
        "output_tokens": args.overhead_output_tokens,
        "repeats": args.overhead_repeats,
        "caching_on_seconds": [round(s, 3) for s in on_seconds],
        "caching_off_seconds": [round(s, 3) for s in off_seconds],
        "median_on_over_off": round(median_ratio, 4),
        "overhead_percent": round((median_ratio - 1) * 100, 2),
        "median_cpu_on_over_off": round(median_cpu_ratio, 4),
        "cpu_overhead_percent": round((median_cpu_ratio - 1) * 100, 2),
        "schedule_seconds_on": [round(x, 4) for x in schedule_seconds[True]],
        "schedule_seconds_off": [round(x, 4) for x in schedule_seconds[False]],
        "caching_work_percent_of_run": round(direct * 100, 3),
        "target": "<= 2%",
    }


def hf_model_from(loaded: LoadedModel):
    """A transformers LlamaForCausalLM holding exactly our loaded weights (un-fused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = loaded.arch_config
    config = LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    q_size = arch.num_heads * arch.head_dim
    kv_size = arch.num_kv_heads * arch.head_dim
    state = {}
    for name, tensor in loaded.model.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            q, k, v = tensor.split([q_size, kv_size, kv_size])
            state[base + "q_proj.weight"], state[base + "k_proj.weight"] = q, k
            state[base + "v_proj.weight"] = v
        elif name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            gate, up = tensor.split([arch.intermediate_size, arch.intermediate_size])
            state[base + "gate_proj.weight"], state[base + "up_proj.weight"] = gate, up
        else:
            state[name] = tensor
    model = LlamaForCausalLM(config).eval()
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embeddings
    if missing:
        raise RuntimeError(f"weights missing for the transformers model: {missing}")
    model.tie_weights()
    return model


def bench_vs_transformers(loaded: LoadedModel, args, rng: random.Random,
                          ours_tokens_per_s: float) -> dict:
    model = hf_model_from(loaded)
    prompts = shared_prefix_prompts(args, rng, loaded.arch_config.vocab_size)
    prompts = prompts[: args.hf_requests]
    num_output_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]), max_new_tokens=args.output_tokens,
                min_new_tokens=args.output_tokens, do_sample=False, pad_token_id=0,
            )
            num_output_tokens += generated.shape[1] - len(prompt)
    seconds = time.perf_counter() - start
    hf_tokens_per_s = num_output_tokens / seconds
    return {
        "hf_requests_measured": len(prompts),
        "hf_seconds": round(seconds, 2),
        "hf_tokens_per_s": round(hf_tokens_per_s, 2),
        "ours_caching_on_tokens_per_s": round(ours_tokens_per_s, 2),
        "ours_over_hf": round(ours_tokens_per_s / hf_tokens_per_s, 2),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    parser.add_argument("--ttft-prompt-tokens", type=int, default=2000)
    parser.add_argument("--ttft-repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--shared-prefix-tokens", type=int, default=1500)
    parser.add_argument("--unique-tokens", type=int, default=100)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--throughput-repeats", type=int, default=1)
    parser.add_argument("--nested-system-tokens", type=int, default=256)
    parser.add_argument("--nested-documents", type=int, default=4)
    parser.add_argument("--nested-document-tokens", type=int, default=1200)
    parser.add_argument("--nested-unique-tokens", type=int, default=50)
    parser.add_argument("--num-kv-blocks", type=int, default=4096,
                        help="the same pool for caching on and off (default: 4096 blocks)")
    parser.add_argument("--overhead-requests", type=int, default=8)
    parser.add_argument("--overhead-prompt-tokens", type=int, default=256)
    parser.add_argument("--overhead-output-tokens", type=int, default=32)
    parser.add_argument("--overhead-repeats", type=int, default=7)
    parser.add_argument("--hf-requests", type=int, default=8)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--only", choices=("ttft", "throughput", "nested", "overhead"),
                        default=None,
                        help="run one part (and no transformers comparison)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both engines and transformers "
                             "(default: torch's own choice)")
    args = parser.parse_args(argv)
    if args.quick:
        args.ttft_prompt_tokens, args.ttft_repeats = 512, 2
        args.num_requests, args.shared_prefix_tokens = 4, 256
        args.unique_tokens, args.output_tokens = 16, 8
        args.overhead_requests, args.overhead_prompt_tokens = 2, 64
        args.overhead_output_tokens, args.overhead_repeats = 4, 3
        args.hf_requests = 2
        args.nested_system_tokens, args.nested_documents = 256, 2
        args.nested_document_tokens, args.nested_unique_tokens = 256, 16
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_start = time.perf_counter()
    loaded = load_model(None)
    result = {
        "benchmark": "prefix_ttft",
        "model": loaded.path.name,
        "dtype": "float32",
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "model_load_s": round(time.perf_counter() - load_start, 2),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "args": {k: v for k, v in vars(args).items()},
    }
    parts = [("ttft", "ttft", bench_ttft),
             ("throughput", "shared_prefix_throughput", bench_shared_prefix),
             ("nested", "nested_prefix_throughput", bench_nested_prefix),
             ("overhead", "zero_hit_overhead", bench_zero_hit_overhead)]
    for part, key, bench in parts:
        if args.only in (None, part):
            result[key] = bench(loaded, args, rng)
            print(json.dumps({key: result[key]}), file=sys.stderr)  # progress
    if not args.skip_hf and args.only is None:
        result["vs_transformers"] = bench_vs_transformers(
            loaded, args, rng, result["shared_prefix_throughput"]["caching_on_tokens_per_s"])
    result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
