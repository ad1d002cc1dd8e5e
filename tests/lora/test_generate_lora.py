"""``prefixcache generate --lora NAME=PATH``."""

from __future__ import annotations

import pytest

from prefixcache import LLM, SamplingParams
from prefixcache.entrypoints.cli import main


def test_generate_with_lora_prints_the_adapters_text(tiny_model_dir, lora_a, capsys):
    argv = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "6",
            "--num-kv-blocks", "64", "--no-stream", "the quick brown fox"]
    assert main([*argv, "--lora", f"adapter-a={lora_a.lora_path}"]) == 0
    adapted = capsys.readouterr().out
    llm = LLM(str(tiny_model_dir), enable_lora=True, num_kv_blocks=64)
    expected = llm.generate("the quick brown fox", SamplingParams(temperature=0, max_tokens=6),
                            lora_request=lora_a)[0].outputs[0].text
    assert adapted == expected + "\n"
    assert main(argv) == 0
    assert capsys.readouterr().out != adapted


@pytest.mark.parametrize("value,message", [
    ("no-equals-sign", "argument --lora: expected NAME=PATH"),
    ("=path", "argument --lora: expected NAME=PATH"),
    ('{"name": "x"}', "argument --lora: expected NAME=PATH"),
])
def test_malformed_lora_is_a_usage_error(capsys, value, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--lora", value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_adapter_folder_is_one_line(tiny_model_dir, tmp_path, capsys):
    code = main(["generate", "--model", str(tiny_model_dir), "--num-kv-blocks", "16",
                 "--lora", f"gone={tmp_path / 'nowhere'}", "hi"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("prefixcache generate: error: LoRA adapter 'gone': no adapter "
                          "folder at") and "Traceback" not in err
