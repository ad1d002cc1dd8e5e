"""The offline ``LLM`` API and the ``prefixcache generate`` command."""

from __future__ import annotations

import inspect
import io
import subprocess
import sys

import pytest
import torch

from prefixcache import LLM, RequestOutput, SamplingParams
from prefixcache.core import EVICTION_POLICIES
from prefixcache.engine.arg_utils import EngineArgs
from prefixcache.entrypoints.cli import main
from prefixcache.model.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, block_size=4, num_kv_blocks=128)


def test_generate_returns_outputs_in_input_order(llm):
    prompts = ["hello world", "the quick brown fox", [5, 6, 7, 8], "blocks and slots"]
    batch = llm.generate(prompts, GREEDY)
    assert [o.request_id for o in batch] == sorted({o.request_id for o in batch}, key=int)
    for prompt, output in zip(prompts, batch, strict=True):
        (alone,) = llm.generate(prompt, GREEDY)
        assert isinstance(output, RequestOutput) and output.finished
        assert output.token_ids == alone.token_ids and len(output.token_ids) == 6
        expected_prompt = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt)
        assert output.prompt_token_ids == expected_prompt
        assert output.outputs[0].token_ids == output.token_ids


def test_repeat_is_served_from_the_cache(llm):
    prompt = "prefix caching reuses the key and value blocks of prompts that share a prefix."
    llm.reset_prefix_cache()
    (first,) = llm.generate(prompt, GREEDY)
    (second,) = llm.generate(prompt, GREEDY)
    num_prompt_tokens = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (num_prompt_tokens - 1) // 4 * 4
    assert second.token_ids == first.token_ids


def test_n_samples_per_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)
    outputs = llm.generate(["hello", "world"], params)
    assert len(outputs) == 2
    for output in outputs:
        assert len(output.outputs) == 3
        assert output.token_ids == output.outputs[0].token_ids
        assert len({tuple(sample.token_ids) for sample in output.outputs}) > 1
    again = llm.generate(["hello", "world"], params)
    assert [[s.token_ids for s in o.outputs] for o in again] == \
        [[s.token_ids for s in o.outputs] for o in outputs]


def test_per_prompt_params_and_errors(llm):
    outputs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=2),
                                        SamplingParams(temperature=0, max_tokens=4)])
    assert [len(o.token_ids) for o in outputs] == [2, 4]
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["a", "b"], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["a", []], GREEDY)
    # The engine's refusal names the prompt, not the internal request id.
    vocab_size = llm.engine.vocab_size
    with pytest.raises(ValueError, match=rf"^prompt 1: prompt token {vocab_size} is not a "):
        llm.generate(["a", [1, vocab_size]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_kv_blocks


def test_constructor_takes_the_engine_options_by_name(tiny_model):
    parameters = inspect.signature(LLM).parameters
    assert list(parameters) == list(inspect.signature(EngineArgs).parameters)
    for name in ("model", "enable_prefix_caching", "block_size", "num_kv_blocks",
                 "kv_cache_memory_bytes", "dtype", "max_num_seqs", "max_num_batched_tokens",
                 "hash_algo", "eviction_policy", "seed"):
        assert name in parameters
    llm = LLM(tiny_model, enable_prefix_caching=False, block_size=8, num_kv_blocks=32,
              max_num_seqs=2, max_num_batched_tokens=64, hash_algo="sha256_cbor",
              eviction_policy="2q", seed=3, enable_chunked_prefill=False)
    engine = llm.engine
    assert (engine.block_size, engine.num_kv_blocks) == (8, 32)
    assert engine.scheduler_config.max_num_seqs == 2
    assert not engine.cache_config.enable_prefix_caching
    assert engine.kv_cache_manager.block_pool.eviction_policy == "2q"
    assert engine.engine_args.max_num_batched_tokens == 64
    assert not engine.scheduler_config.enable_chunked_prefill
    default_engine = LLM(tiny_model, num_kv_blocks=8).engine
    assert default_engine.kv_cache_manager.block_pool.eviction_policy == "lru"


@pytest.mark.parametrize("options,match", [
    ({"max_num_seqs": "8"}, "max_num_seqs"),
    ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
    ({"dtype": "float16"}, "dtype"),
    ({"block_size": 0}, "block_size"),
    ({"hash_algo": "md5"}, "hash_algo"),
    ({"eviction_policy": "mru"}, "eviction_policy"),
    ({"seed": 2**64}, "seed"),
    ({"seed": "7"}, "seed"),
])
def test_bad_options_are_value_errors_naming_the_option(tiny_model, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model, **options)


def test_an_unknown_option_is_a_type_error_naming_it(tiny_model):
    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        LLM(tiny_model, gpu_memory_utilization=0.9)


@pytest.mark.parametrize("policy", ["mru", "LRU", "", None, ["lru"]])
def test_engine_args_reject_an_unknown_eviction_policy_naming_the_choices(policy):
    with pytest.raises(ValueError) as excinfo:
        EngineArgs(eviction_policy=policy)
    message = str(excinfo.value)
    assert message.startswith("eviction_policy must be one of ")
    assert message.endswith(f", got {policy!r}")
    assert all(name in message for name in EVICTION_POLICIES)


def test_a_file_that_is_not_a_model_is_a_value_error_naming_it(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    for path in (junk, text, folder):
        with pytest.raises(ValueError, match=path.name):
            LLM(str(path))
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "missing"))


def test_progress_bar_for_large_batches_on_a_terminal(llm, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    llm.generate(["a"] * 8, GREEDY)
    assert "Generating" in terminal.getvalue() and "8/8" in terminal.getvalue()
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    llm.generate(["a"] * 8, GREEDY, use_tqdm=False)
    llm.generate(["a"] * 2, GREEDY)  # too small to be worth a bar
    assert quiet.getvalue() == ""


def test_chat_renders_the_template(llm):
    conversation = [{"role": "user", "content": "hello"}]
    (output,) = llm.chat(conversation, GREEDY)
    assert output.prompt == "<|user|>hello<|end|><|assistant|>"
    assert output.prompt_token_ids == llm.tokenizer.encode(output.prompt,
                                                           add_special_tokens=False)
    batch = llm.chat([conversation, [{"role": "user", "content": "world"}]], GREEDY)
    assert len(batch) == 2 and batch[0].token_ids == output.token_ids
    for bad in ([], [{"role": "user"}], [{"content": "hi"}], [{"role": "user", "content": 5}]):
        with pytest.raises(ValueError):
            llm.chat(bad, GREEDY)


def test_default_model_answers_a_chat_prompt(smollm2):
    llm = LLM(smollm2, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=24)
    (output,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         params)
    assert "Paris" in output.text
    assert output.finish_reason == "stop"  # it ends its answer with <|im_end|>
    (repeat,) = llm.chat([{"role": "user", "content": "What is the capital of Germany?"}],
                         params)
    assert "Berlin" in repeat.text
    # The system prompt and chat scaffolding before the question are shared.
    assert repeat.num_cached_tokens >= 16


def test_generate_command_help_and_errors(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    assert "--max-tokens" in capsys.readouterr().out
    assert main(["generate", "hi", "--model", str(tiny_model_dir / "missing")]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(tiny_model_dir), "--top-p", "0"]) == 2
    err = capsys.readouterr().err
    assert "top_p" in err and "Traceback" not in err


def test_generate_command_streams_text(tiny_model_dir, tiny_model, capsys):
    code = main(["generate", "hello", "--model", str(tiny_model_dir), "--max-tokens", "5",
                 "--ignore-eos"])
    captured = capsys.readouterr()
    assert code == 0
    (expected,) = LLM(tiny_model).generate(
        "hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert captured.out == expected.text + "\n"
    assert "5 generated" in captured.err and "finish_reason=length" in captured.err


def test_generate_command_runs_prompts_in_turn_and_later_ones_hit_the_cache(
        tiny_model_dir, capsys):
    shared = "alpha beta gamma delta " * 8  # well past one 16-token block
    code = main(["generate", shared + "one", shared + "two", "--model", str(tiny_model_dir),
                 "--max-tokens", "3", "--ignore-eos"])
    captured = capsys.readouterr()
    assert code == 0
    summaries = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert len(summaries) == 2
    assert " 0 cached" in summaries[0]
    cached = int(summaries[1].split(" prompt tokens, ")[1].split(" cached")[0])
    assert cached >= 16 and cached % 16 == 0
    assert len(captured.out.splitlines()) == 2


def test_generate_command_bad_model_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "prefixcache", "generate", "hi", "--model",
         str(tmp_path / "nope.gguf")], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "nope.gguf" in result.stderr and "Traceback" not in result.stderr


def test_a_loaded_model_sets_the_kv_dtype_and_a_mismatch_is_refused(tiny_model_dir):
    bf16 = load_model(tiny_model_dir, torch.bfloat16)
    engine = LLM(bf16, num_kv_blocks=16).engine
    assert engine.model_config.dtype == "bfloat16"
    assert engine.runner.kv_caches[0].key_cache.dtype == torch.bfloat16
    assert LLM(bf16, num_kv_blocks=16, dtype="bfloat16").engine.model_config.dtype == "bfloat16"
    with pytest.raises(ValueError, match="'float32' does not match the loaded model's bfloat16"):
        LLM(bf16, num_kv_blocks=16, dtype="float32")
    output = LLM(bf16, num_kv_blocks=16).generate(
        "hello", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 3
