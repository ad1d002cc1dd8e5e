"""LoRA in the engine: cache isolation between adapters (hits, KV events, stats), the
max_loras limit on a step, the registry's LRU of loaded adapters, clear refusals."""

from __future__ import annotations

import json
import shutil

import pytest

from prefixcache import LLM, LoRARequest, SamplingParams
from prefixcache.core.kv_events import BlockStored
from prefixcache.engine.errors import InvalidRequestError
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.lora import LoRAError, LoRANotFoundError
from tests.lora.conftest import save_random_adapter

PROMPT = [5, 17, 42, 99, 7, 3, 25, 11, 64, 8, 12, 33, 47, 2, 18, 20, 77]  # 17 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def make_engine(model_dir, **options):
    defaults = dict(enable_lora=True, max_loras=2, num_kv_blocks=64, block_size=4)
    return LLMEngine.from_options(str(model_dir), **{**defaults, **options})


def run_one(engine, request_id, lora=None, prompt=PROMPT):
    engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    return final


def test_adapters_and_base_share_no_cached_blocks(tiny_model_dir, lora_a, lora_b):
    engine = make_engine(tiny_model_dir, enable_kv_events=True)
    assert run_one(engine, "base", None).num_cached_tokens == 0
    assert run_one(engine, "a1", lora_a).num_cached_tokens == 0
    assert run_one(engine, "b1", lora_b).num_cached_tokens == 0
    # The same adapter hits its own blocks: 4 full blocks of the 17-token prompt.
    assert run_one(engine, "a2", lora_a).num_cached_tokens == 16
    assert run_one(engine, "base2", None).num_cached_tokens == 16
    stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
    by_lora = {}
    for event in stored:
        by_lora.setdefault((event.lora_name, event.lora_id), []).extend(event.block_hashes)
    # Each of the three stored its own prompt blocks (plus output blocks), none shared.
    assert set(by_lora) == {(None, None), ("adapter-a", 1), ("adapter-b", 2)}
    hashes = [set(h) for h in by_lora.values()]
    assert not (hashes[0] & hashes[1]) and not (hashes[0] & hashes[2]) \
        and not (hashes[1] & hashes[2])
    assert all(len(h) >= 4 for h in hashes)
    stats = engine.get_stats()
    assert stats.prefix_cache_hits == 32


def test_max_loras_limits_the_adapters_of_a_step(tiny_model_dir, lora_a, lora_b):
    """With max_loras=1, requests for A and B queued together never run in one step,
    and each still produces what it produces alone."""
    alone = {}
    for name, lora in (("a", lora_a), ("b", lora_b)):
        alone[name] = run_one(make_engine(tiny_model_dir), name, lora).token_ids
    engine = make_engine(tiny_model_dir, max_loras=1)
    engine.add_request("a", PROMPT, GREEDY, lora_request=lora_a)
    engine.add_request("b", PROMPT, GREEDY, lora_request=lora_b)
    engine.add_request("base", PROMPT, GREEDY)  # behind b, admitted past it
    finals = {}
    adapters_per_step = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        adapters_per_step.append({r.lora_name for r in engine.scheduler.running})
        for output in outputs:
            if output.finished:
                finals[output.request_id] = output.token_ids
    running_at_step_one = adapters_per_step[0]
    assert running_at_step_one == {"adapter-a", None}  # the base passed the waiting B
    assert all(len(names - {None}) <= 1 for names in adapters_per_step)
    assert finals["a"] == alone["a"] and finals["b"] == alone["b"]
    assert engine.runner.lora_slots.num_slot_loads == 2


def test_loaded_adapters_beyond_max_cpu_loras_are_evicted_lru(tiny_model_dir, lora_a,
                                                              lora_b):
    engine = make_engine(tiny_model_dir, max_loras=1, max_cpu_loras=1)
    registry = engine.lora_registry
    first = run_one(engine, "a1", lora_a).token_ids
    assert registry.is_loaded("adapter-a")
    run_one(engine, "b1", lora_b)
    assert registry.is_loaded("adapter-b") and not registry.is_loaded("adapter-a")
    assert run_one(engine, "a2", lora_a).token_ids == first  # read from its folder again
    assert registry.num_loads == 3
    assert [r.lora_name for r in engine.list_loras()] == ["adapter-a", "adapter-b"]


def test_adapters_in_use_are_never_evicted(tiny_model_dir, lora_a, lora_b):
    engine = make_engine(tiny_model_dir, max_loras=1, max_cpu_loras=1)
    engine.add_request("a", PROMPT, GREEDY, lora_request=lora_a)
    engine.add_request("b", PROMPT, GREEDY, lora_request=lora_b)
    registry = engine.lora_registry
    assert registry.is_loaded("adapter-a") and registry.is_loaded("adapter-b")
    while engine.has_unfinished_requests():
        engine.step()
    assert registry.num_loaded == 1 and registry.num_loads == 2


def test_llm_generate_takes_one_lora_request_per_prompt(tiny_model_dir, lora_a):
    llm = LLM(str(tiny_model_dir), enable_lora=True, num_kv_blocks=64, block_size=4)
    base, adapted = llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[None, lora_a])
    assert base.outputs[0].token_ids != adapted.outputs[0].token_ids
    with pytest.raises(ValueError, match="got 1 LoRA requests for 2 prompts"):
        llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[lora_a])
    chat = llm.chat([{"role": "user", "content": "hello"}], GREEDY, lora_request=lora_a)
    assert chat[0].outputs[0].token_ids


# -- refusals -------------------------------------------------------------------------


def refusal(engine, lora) -> LoRAError:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("r", PROMPT, GREEDY, lora_request=lora)
    assert info.value.param == "lora_request"
    assert not engine.has_unfinished_requests()
    return info.value.__cause__


def test_lora_without_enable_lora_is_refused(tiny_model_dir, lora_a):
    engine = LLMEngine.from_options(str(tiny_model_dir), num_kv_blocks=16, block_size=4)
    assert "enable_lora=True" in str(refusal(engine, lora_a))


def test_missing_folder_is_not_found(tiny_model_dir, tmp_path):
    error = refusal(make_engine(tiny_model_dir),
                    LoRARequest("gone", 5, str(tmp_path / "nowhere")))
    assert isinstance(error, LoRANotFoundError) and "no adapter folder" in str(error)


def test_rank_above_max_lora_rank_is_refused(tiny_model_dir, lora_a):
    error = refusal(make_engine(tiny_model_dir, max_lora_rank=4), lora_a)
    assert "rank 8 exceeds max_lora_rank=4" in str(error)


def test_unsupported_target_modules_are_refused(tiny_model_dir, adapter_a_dir, tmp_path):
    folder = tmp_path / "embed"
    shutil.copytree(adapter_a_dir, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "embed_tokens", "lm_head"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    error = refusal(make_engine(tiny_model_dir), LoRARequest("embed", 7, str(folder)))
    assert "unsupported target modules embed_tokens, lm_head" in str(error)


def test_adapter_of_another_base_model_is_refused(tiny_model_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    folder = save_random_adapter(other, tmp_path / "other", targets=["q_proj"], r=2,
                                 alpha=2)
    error = refusal(make_engine(tiny_model_dir), LoRARequest("other", 9, str(folder)))
    assert "do not fit the base model's 64x64 projection" in str(error)


def test_a_name_reused_with_another_path_or_id_is_refused(tiny_model_dir, lora_a,
                                                          adapter_b_dir):
    engine = make_engine(tiny_model_dir)
    assert engine.add_lora(lora_a) is True
    assert engine.add_lora(lora_a) is False
    error = refusal(engine, LoRARequest("adapter-a", 1, str(adapter_b_dir)))
    assert "already used for" in str(error)
    error = refusal(engine, LoRARequest("adapter-a", 4, lora_a.lora_path))
    assert "already used with lora_int_id 1" in str(error)
    error = refusal(engine, LoRARequest("other-name", 1, str(adapter_b_dir)))
    assert "lora_int_id 1 is already used by adapter 'adapter-a'" in str(error)


def test_options_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="max_cpu_loras .2. must be at least max_loras .3."):
        make_engine(tiny_model_dir, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        make_engine(tiny_model_dir, max_lora_rank=0)


def test_a_removed_name_comes_back_only_for_the_same_adapter(tiny_model_dir, lora_a,
                                                              adapter_b_dir):
    """KV blocks cached under a name outlive its removal, so the name may return only
    for the same adapter: another one under it would hit blocks computed without it."""
    engine = make_engine(tiny_model_dir)
    tokens_a = run_one(engine, "a1", lora_a).token_ids
    assert engine.remove_lora("adapter-a") == lora_a
    assert engine.list_loras() == []
    with pytest.raises(LoRANotFoundError):
        engine.remove_lora("adapter-a")
    error = refusal(engine, LoRARequest("adapter-a", 1, str(adapter_b_dir)))
    assert "until removed" in str(error)
    again = run_one(engine, "a2", lora_a)
    assert again.token_ids == tokens_a and again.num_cached_tokens == 16
