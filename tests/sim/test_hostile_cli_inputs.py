"""The trace tools (``replay``, ``merge``, ``synth``) against inputs and surroundings their
authors did not plan for: each ends with a one-line error and a non-zero exit code, never a
traceback, and never writes a status line into the data it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prefixcache.entrypoints.cli import main
from tests.data_paths import REPO_ROOT
from tests.processes import prefixcache_env, run_with_stderr_closed
from tests.sim.helpers import write_trace_head


@pytest.fixture
def small_trace(tmp_path):
    """The first 5 requests of the Mooncake trace in data/."""
    return write_trace_head(tmp_path / "head.jsonl", 5)


@pytest.mark.skipif(sys.platform == "win32", reason="closes a file descriptor in the child")
def test_with_standard_error_closed_stdout_holds_only_the_data(small_trace):
    merged = run_with_stderr_closed(["merge", str(small_trace), "--skip-bad-lines"], 120)
    assert merged.returncode == 0
    lines = merged.stdout.decode().splitlines()
    assert len(lines) == 5 and all("hash_ids" in json.loads(line) for line in lines)

    synth = run_with_stderr_closed(["synth", "chat", "--num-requests", "3"], 120)
    assert synth.returncode == 0
    assert len(synth.stdout.decode().splitlines()) == 3

    with small_trace.open("a") as handle:
        handle.write("not json\n")
    replay = run_with_stderr_closed(["replay", str(small_trace), "--num-blocks", "40",
                                     "--block-size", "512", "--skip-bad-lines",
                                     "--json", "-"], 120)
    assert replay.returncode == 0
    assert json.loads(replay.stdout)["num_bad_lines"] == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("options", [["--num-blocks", "40"],
                                     ["--sweep", "20,40", "--no-belady"],
                                     ["--num-blocks", "40", "--json", "-"]])
def test_a_full_disk_under_stdout_is_a_one_line_error(small_trace, options):
    # Buffered, as stdout is unless PYTHONUNBUFFERED says otherwise: the write that fails
    # is then the final flush.
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "prefixcache", "replay", str(small_trace),
                               "--block-size", "512", *options], cwd=REPO_ROOT, stdout=full,
                              stderr=subprocess.PIPE, env=prefixcache_env(PYTHONUNBUFFERED=None),
                              timeout=120, check=False)
    assert done.returncode == 1
    assert done.stderr.decode().endswith("prefixcache replay: error: cannot write the figures "
                                         "to standard output: No space left on device\n")
    assert "Traceback" not in done.stderr.decode()


HUGE = "1" + "0" * 320
MAX_NUM_BLOCKS = f"{10**30:,}"


@pytest.mark.parametrize("argv,message", [
    (["--num-blocks", HUGE], f"argument --num-blocks: must be 1 to {MAX_NUM_BLOCKS}"),
    (["--sweep", f"5,{HUGE}"], f"argument --sweep: must be 1 to {MAX_NUM_BLOCKS}"),
    (["--sweep", "1e308%"], "a share of the working set must be at most 10,000%, got 1e308%"),
    (["--sweep", "1e400%"], "must be a finite number > 0, got 1e400"),
    (["--num-blocks", "5", "--kv-bytes-per-token", HUGE],
     "argument --kv-bytes-per-token: must be 1 to 1,073,741,824"),
    (["--sweep", "5,10", "--plot", "-"], "argument --plot: give a file name"),
    (["--num-blocks", "5", "--json", ""], "argument --json: empty file name"),
    (["--num-blocks", "5", "--block-size", HUGE], "argument --block-size: must be 1 to 16,"),
])
def test_out_of_range_options_are_usage_errors(small_trace, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", str(small_trace), "--block-size", "512", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["replay", "", "--num-blocks", "5"], "argument trace: empty file name"),
    (["merge", ""], "argument TRACE: empty file name"),
    (["merge", "x.jsonl", "-o", ""], "argument -o/--output: empty file name"),
    (["synth", "chat", "--num-requests", "2", "-o", ""], "argument -o/--output: empty file name"),
])
def test_an_empty_file_name_is_named_as_such(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
