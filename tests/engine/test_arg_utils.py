"""EngineArgs: one declaration gives the Python API, the checks and both commands' flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from prefixcache.engine.arg_utils import EngineArgs, KVEventsArgs
from prefixcache.engine.option_fields import OPTION
from prefixcache.entrypoints.cli import build_parser, main


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    subparsers = next(action for action in build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction))
    return subparsers.choices[name]


def dests(parser: argparse.ArgumentParser) -> set[str]:
    return {action.dest for action in parser._actions}


def test_every_option_has_help_and_every_flagged_option_is_a_flag_of_both_commands():
    serve, generate = dests(subcommand_parser("serve")), dests(subcommand_parser("generate"))
    for field in dataclasses.fields(EngineArgs):
        spec = field.metadata[OPTION]
        assert len(spec.help) > 10, field.name
        if spec.flags:
            assert field.name in serve, field.name
            # generate's --seed seeds each prompt (dest sampling_seed), not the engine.
            assert field.name in generate or field.name == "seed", field.name
    for field in dataclasses.fields(KVEventsArgs):
        assert field.name in serve, field.name


def test_the_checks_run_once_on_construction_naming_the_option():
    with pytest.raises(ValueError, match=r"^block_size must be a positive integer, got True$"):
        EngineArgs(block_size=True)
    with pytest.raises(ValueError, match=r"^num_kv_blocks must be a positive integer or None"):
        EngineArgs(num_kv_blocks=-1)
    with pytest.raises(ValueError, match=r"^hash_seed must be a string or None, got 3$"):
        EngineArgs(hash_seed=3)
    with pytest.raises(ValueError, match="^enable_kv_events must be True or False"):
        EngineArgs(enable_kv_events=1)
    with pytest.raises(ValueError,
                       match=r"^dtype must be one of float32, bfloat16 or None, got 'f16'$"):
        EngineArgs(dtype="f16")
    assert EngineArgs(num_kv_blocks=None, dtype=None, seed=-(2**63)).seed == -(2**63)


def test_options_are_keywords_after_the_model():
    with pytest.raises(TypeError):
        EngineArgs("model", "float32")


def test_kv_events_replay_needs_an_endpoint():
    with pytest.raises(ValueError, match="replay endpoint needs --kv-events-endpoint"):
        KVEventsArgs(kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    with pytest.raises(ValueError, match="data_parallel_rank must be a non-negative integer"):
        KVEventsArgs(data_parallel_rank=-1)


def test_generate_builds_its_engine_from_the_same_flags(monkeypatch, capsys):
    from prefixcache.engine.llm_engine import LLMEngine

    built = []

    def from_engine_args(engine_args):
        built.append(engine_args)
        raise ValueError("no engine in this test")

    monkeypatch.setattr(LLMEngine, "from_engine_args", from_engine_args)
    assert main(["generate", "hi", "--model", "m.gguf", "--block-size", "8",
                 "--no-enable-prefix-caching", "--eviction-policy", "2q",
                 "--seed", "5"]) == 2
    assert capsys.readouterr().err == "prefixcache generate: error: no engine in this test\n"
    # --seed seeds the prompt's sampling; generate runs one prompt at a time.
    assert built == [EngineArgs("m.gguf", block_size=8, enable_prefix_caching=False,
                                eviction_policy="2q", max_num_seqs=1)]


def test_generate_help_shows_its_own_default_for_max_num_seqs(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-num-seqs N most requests running at once; more wait in a queue " \
           "(default: 1)" in text
    assert "--no-enable-prefix-caching" in text
