"""`--optimization-level` above 0: decode steps through torch.compile.

A batched run with prefix caching and chunked prefill gives the same greedy tokens
compiled as eager, but for a split at a near-tie that fusion's last-bit rounding may decide
(tests/near_ties.py); the compiled forward really ran, for decode steps only; a failing
compiler leaves the engine serving eagerly, while a step that fails eagerly too still
raises its own error.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from prefixcache.engine.arg_utils import EngineArgs
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.model.loader import load_model
from prefixcache.worker.compiled_decode import CompiledDecode
from tests.engine.helpers import assert_all_blocks_free, run_batch
from tests.engine.test_greedy_equivalence import make_prompts
from tests.near_ties import assert_same_or_split_at_a_near_tie, load_reference_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Small blocks and budget: prompts span blocks and prefills are chunked, so steps of
# decodes alone (compiled) and steps with prefill chunks (eager) interleave.
ENGINE_OPTIONS = {"block_size": 4, "max_num_batched_tokens": 32}


def spy_on_compiled_calls(engine) -> list:
    """Record the metadata of every step that reaches the compiled forward."""
    compiled_decode = engine.runner.compiled_decode
    compiled = compiled_decode._compiled
    seen = []

    def spy(input_ids, kv_caches, metadata, *rest):
        seen.append(metadata)
        return compiled(input_ids, kv_caches, metadata, *rest)

    compiled_decode._compiled = spy
    return seen


def test_compiled_decode_equals_eager(make_engine, tiny_model, tiny_model_dir):
    prompts = make_prompts(tiny_model.arch_config.vocab_size)
    eager = run_batch(make_engine(**ENGINE_OPTIONS), prompts, GREEDY)
    engine = make_engine(optimization_level=1, **ENGINE_OPTIONS)
    compiled_steps = spy_on_compiled_calls(engine)
    compiled = run_batch(engine, prompts, GREEDY)

    reference_model = load_reference_model(tiny_model_dir)
    for prompt, eager_output, compiled_output in zip(prompts, eager, compiled, strict=True):
        assert_same_or_split_at_a_near_tie(reference_model, prompt, eager_output.token_ids,
                                           compiled_output.token_ids)
    # The spy sees a step before the compiled call; a compile that failed would have
    # dropped it (and the engine gone eager), so it must still be in place.
    assert compiled_steps, "no step reached the compiled forward"
    assert engine.runner.compiled_decode._compiled is not None, "compiling failed"
    assert all(not m.chunks and not m.decode_shared_prefixes for m in compiled_steps)
    assert_all_blocks_free(engine)


def build_model_differing_in_a_constant(model_dir: Path, like_dir: Path) -> Path:
    """A random Llama shaped exactly as the tiny model (same parameter shapes, same
    tokenizer) whose norms' epsilon is 0.5 instead of 1e-6: a plain number the compiled
    graph bakes in, not a tensor it reads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((like_dir / "config.json").read_text())
    config.update(rms_norm_eps=0.5)
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # logits over tens of units, as the tiny model's
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(like_dir / name, model_dir / name)
    return model_dir


def test_a_second_model_in_the_process_gets_its_own_graph(make_engine, tiny_model,
                                                         tiny_model_dir, tmp_path):
    """Module attributes (such as a norm's epsilon) are not guarded, since they never
    change: a second model in the process, differing from the first only in a constant
    its graph bakes in, must still compute its own function."""
    first = make_engine(optimization_level=1, **ENGINE_OPTIONS)
    prompts = make_prompts(tiny_model.arch_config.vocab_size)[:3]
    run_batch(first, prompts, GREEDY)
    other_dir = build_model_differing_in_a_constant(tmp_path / "other", tiny_model_dir)
    other = load_model(other_dir)
    eager = run_batch(LLMEngine.from_options(other, num_kv_blocks=256, **ENGINE_OPTIONS),
                      prompts, GREEDY)
    engine = LLMEngine.from_options(other, optimization_level=1, num_kv_blocks=256,
                                    **ENGINE_OPTIONS)
    compiled = run_batch(engine, prompts, GREEDY)

    assert engine.runner.compiled_decode._compiled is not None, "compiling failed"
    reference_model = load_reference_model(other_dir)
    for prompt, eager_output, compiled_output in zip(prompts, eager, compiled, strict=True):
        assert_same_or_split_at_a_near_tie(reference_model, prompt, eager_output.token_ids,
                                           compiled_output.token_ids)


def test_a_failing_compiler_leaves_the_engine_eager(make_engine, tiny_model, caplog):
    prompts = make_prompts(tiny_model.arch_config.vocab_size)[:3]
    eager = run_batch(make_engine(**ENGINE_OPTIONS), prompts, GREEDY)
    engine = make_engine(optimization_level=1, **ENGINE_OPTIONS)
    calls = []

    def broken_compiler(*args):
        calls.append(args)
        raise RuntimeError("no C++ compiler")

    engine.runner.compiled_decode._compiled = broken_compiler
    with caplog.at_level(logging.WARNING, logger="prefixcache.worker.compiled_decode"):
        outputs = run_batch(engine, prompts, GREEDY)

    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    assert len(calls) == 1  # tried once, then eager for good
    assert [r.message for r in caplog.records if "no C++ compiler" in r.message]


def test_a_step_that_fails_eagerly_raises_its_own_error(tiny_model):
    compiled_decode = CompiledDecode(tiny_model.model)

    def compiled(*args):
        raise RuntimeError("compiled failure")

    def eager(*args):
        raise ValueError("the step's own error")

    compiled_decode._compiled = compiled
    with pytest.raises(ValueError, match="the step's own error"):
        compiled_decode.run(eager)
    assert compiled_decode._compiled is compiled  # not the compiler's fault: kept


@pytest.mark.parametrize("level", [-1, 4, True, 1.0, "1"])
def test_optimization_level_must_be_0_to_3(level):
    with pytest.raises(ValueError, match="optimization_level"):
        EngineArgs(optimization_level=level)
