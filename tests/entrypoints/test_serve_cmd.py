"""``prefixcache serve`` refuses bad configuration with exit code 2 and a message, before
binding anything."""

from __future__ import annotations

import asyncio

import pytest

from prefixcache.config import DEFAULT_EVICTION_POLICY
from prefixcache.core.eviction import LearnedReuseFreeBlockQueue
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.entrypoints.cli import build_parser, main
from prefixcache.entrypoints.openai.serve_cmd import engine_options, kv_events_options


def test_flags_map_to_engine_options_in_vllm_spelling():
    args = build_parser().parse_args([
        "serve", "/models/m", "--block-size", "32", "--no-enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor", "--num-gpu-blocks-override", "100",
        "--kv-cache-memory", "1GiB", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--dtype", "bfloat16", "--seed", "3", "--eviction-policy", "2q"])
    assert engine_options(args) == {
        "model": "/models/m", "enable_prefix_caching": False, "block_size": 32,
        "num_kv_blocks": 100, "dtype": "bfloat16", "hash_algo": "sha256_cbor",
        "eviction_policy": "2q", "enable_chunked_prefill": True, "seed": 3,
        "kv_cache_memory_bytes": 1 << 30, "max_num_seqs": 8, "max_num_batched_tokens": 512}
    defaults = engine_options(build_parser().parse_args(["serve"]))
    assert defaults["model"] is None and "max_num_seqs" not in defaults
    assert defaults["eviction_policy"] == DEFAULT_EVICTION_POLICY == "lru"


def test_eviction_policy_flag_reaches_the_engines_block_pool(tiny_model_dir):
    from prefixcache.engine.async_llm import AsyncLLM

    args = build_parser().parse_args([
        "serve", str(tiny_model_dir), "--eviction-policy", "learned-reuse",
        "--block-size", "4", "--num-kv-blocks", "16"])
    # As `run` builds it, minus uvicorn.
    llm = AsyncLLM.from_options(**kv_events_options(args), **engine_options(args))
    try:
        block_pool = llm.engine.kv_cache_manager.block_pool
        assert block_pool.eviction_policy == "learned-reuse"
        assert type(block_pool.free_block_queue) is LearnedReuseFreeBlockQueue

        async def generate():
            params = SamplingParams(temperature=0, max_tokens=3)
            return [o async for o in llm.generate("r", list(range(10, 20)), params)]

        outputs = asyncio.run(asyncio.wait_for(generate(), 60))
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        # The finished request's blocks went back through the policy: all free, and the
        # 12 tokens with KV (10 prompt + 2 fed-back outputs) fill 3 cached blocks.
        free_blocks = block_pool.free_block_queue.get_all_free_blocks()
        assert len(free_blocks) == 16
        assert sum(block.block_hash is not None for block in free_blocks) == 3
    finally:
        llm.shutdown()


def test_unknown_eviction_policy_is_a_usage_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["serve", "--eviction-policy", "mru"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "argument --eviction-policy: invalid choice: 'mru'" in err
    assert "'lru', 'unhashed-first', '2q', 'learned-reuse'" in err
    assert "Traceback" not in err


def test_kv_events_flags():
    args = build_parser().parse_args([
        "serve", "--kv-events-endpoint", "tcp://127.0.0.1:5557",
        "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558", "--kv-events-topic", "kv",
        "--kv-events-block-hash-format", "bytes"])
    assert kv_events_options(args) == {
        "kv_events_endpoint": "tcp://127.0.0.1:5557",
        "kv_events_replay_endpoint": "tcp://127.0.0.1:5558", "kv_events_topic": "kv",
        "kv_events_block_hash_format": "bytes"}
    defaults = kv_events_options(build_parser().parse_args(["serve"]))
    assert defaults["kv_events_endpoint"] is None
    assert defaults["kv_events_block_hash_format"] == "int64"  # vLLM's default


@pytest.mark.parametrize("argv", [
    ["serve", "--api-key-file", "/nonexistent/keys.txt"],
    ["serve", "--api-key", "k", "--api-key-file", "{keys}"],
    ["serve", "{missing_model}"],
    ["serve", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"],
    ["serve", "--kv-events-endpoint", "bogus"],
    ["serve", "--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "x"],
], ids=["missing-key-file", "key-and-key-file", "missing-model", "replay-without-endpoint",
        "bad-events-endpoint", "bad-replay-endpoint"])
def test_bad_configuration_exits_2(argv, tmp_path, capsys):
    keys = tmp_path / "keys.txt"
    keys.write_text("k1 tenant\n")
    argv = [a.format(keys=keys, missing_model=tmp_path / "no-model") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "prefixcache serve:" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", [["--port", "70000"], ["--block-size", "0"],
                                  ["--kv-cache-memory", "lots"], ["--dtype", "int4"],
                                  ["--eviction-policy", "mru"]])
def test_bad_flag_values_are_usage_errors(flag):
    with pytest.raises(SystemExit) as excinfo:
        build_parser().parse_args(["serve", *flag])
    assert excinfo.value.code == 2
