"""``prefixcache generate``: what a user sees when the options or the output go wrong.

Everything that can be checked without the model is checked before it loads (seconds for
a real model), so most of these tests need none: ``no_model_load`` fails the test if the
command tries to load one.
"""

from __future__ import annotations

import pytest

from prefixcache.engine.errors import InvalidRequestError
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.entrypoints.cli import main
from prefixcache.entrypoints.generate_cmd import _about_prompt
from tests.processes import run_with_reader_gone

# What Python makes of the argv bytes b"\xff\xfe bad utf8" (surrogateescape).
INVALID_UTF8 = b"\xff\xfe bad utf8".decode("utf-8", "surrogateescape")


@pytest.fixture
def no_model_load(monkeypatch):
    def load(*args, **kwargs):
        pytest.fail("the model was loaded before the options were checked")
    monkeypatch.setattr(LLMEngine, "from_engine_args", load)


@pytest.mark.parametrize("argv,message", [
    ([INVALID_UTF8], r"argument PROMPT: not valid UTF-8 text: b'\xff\xfe bad utf8'"),
    (["hi", "--chat", "--system", INVALID_UTF8], "argument --system: not valid UTF-8"),
    (["hi", "--stop", INVALID_UTF8], "argument --stop: not valid UTF-8"),
    (["hi", "--seed", str(2**64)], "argument --seed: must be -9,223,372,036,854,775,808 to"),
    (["hi", "--seed", str(-(2**63) - 1)], "argument --seed: must be -9,223,372,036,854,775,808"),
    (["hi", "--temperature", "inf"], "argument --temperature: must be a finite number >= 0"),
    (["hi", "--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
    (["hi", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["hi", "--model", ""], "argument --model: empty path"),
])
def test_bad_values_are_usage_errors(no_model_load, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["first", "", "third"], "prompt 2 is empty"),
    ([""], "the prompt is empty"),
    (["hi", "--system", "Be brief."], "--system needs --chat"),
    (["hi", "--top-p", "nan"], "top_p must be in (0, 1]"),
    (["hi", "--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["hi", "--stop", ""], "stop must be a non-empty string"),
])
def test_bad_prompts_and_options_fail_before_the_model_loads(no_model_load, capsys, argv,
                                                              message):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prefixcache generate: error: {message}")
    assert err.count("\n") == 1  # one line


def test_an_empty_chat_message_is_still_a_prompt(tiny_model_dir, capsys):
    assert main(["generate", "", "--chat", "--model", str(tiny_model_dir),
                 "--max-tokens", "2", "--ignore-eos"]) == 0
    assert "2 generated" in capsys.readouterr().err


def test_errors_about_a_prompt_name_its_position(tiny_model_dir, capsys):
    too_long = "the quick brown fox " * 200  # far beyond the tiny model's 512 positions
    assert main(["generate", "hello", too_long, "--model", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prefixcache generate: error: prompt 2: the prompt (")
    assert "generate-" not in err
    # The engine's refusals carry the request id as a field; the message is worded the
    # same way.
    refusal = InvalidRequestError("generate-2", "prompt token 999 is not a token id", "prompt")
    assert _about_prompt(2, 3, refusal.message) == "prompt 2: prompt token 999 is not a token id"
    assert _about_prompt(1, 1, "x") == "x"


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1])
def test_the_whole_seed_range_samples(tiny_model_dir, capsys, seed):
    assert main(["generate", "hello", "--model", str(tiny_model_dir), "--seed", str(seed),
                 "--temperature", "1", "--max-tokens", "2", "--ignore-eos"]) == 0
    assert "2 generated" in capsys.readouterr().err


def test_a_reader_that_goes_away_stops_the_stream_quietly(tiny_model_dir):
    """``generate ... | head -c 10``: exit 141 (128 + SIGPIPE), nothing on stderr."""
    result = run_with_reader_gone(
        ["generate", "hello", "--model", str(tiny_model_dir), "--max-tokens", "8",
         "--ignore-eos"], timeout=300)
    assert result.stderr == ""
    assert result.returncode == 141
