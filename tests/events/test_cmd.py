"""``prefixcache events``: what an operator sees."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from prefixcache.core import kv_events as core
from prefixcache.entrypoints.cli import main
from prefixcache.events.convert import block_hash_to_int64
from prefixcache.events.zmq_publisher import ZmqEventPublisher
from tests.events import VLLM_NUMBERING
from tests.processes import REPO_ROOT, run_with_reader_gone

DIGESTS = [bytes([i]) * 32 for i in range(4)]


def _records() -> list[list[core.KVCacheEvent]]:
    return [
        [core.BlockStored(DIGESTS[:2], None, list(range(8)), 4)],
        [core.BlockStored([DIGESTS[2]], DIGESTS[1], list(range(8, 12)), 4, lora_id=3,
                          lora_name="sql", extra_keys=[(("lora", "sql", "/a"),)])],
        [core.BlockRemoved([DIGESTS[0]]), core.AllBlocksCleared()],
    ]


@pytest.fixture
def publisher_with_history():
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                  block_hash_format="bytes", **VLLM_NUMBERING)
    for step, records in enumerate(_records()):
        publisher.publish(records, ts=1700000000.0 + step)
    deadline = time.monotonic() + 5.0
    while publisher.num_published_batches < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    yield publisher
    publisher.close()


def _events_argv(publisher, *extra: str) -> list[str]:
    return ["events", publisher.endpoint, "--replay-endpoint", publisher.replay_endpoint,
            "--from-seq", "0", "--count", "3", "--timeout", "3", *extra]


def test_json_lines_from_replay(publisher_with_history, capsys):
    assert main(_events_argv(publisher_with_history, "--json")) == 0
    lines = capsys.readouterr().out.splitlines()
    documents = [json.loads(line) for line in lines]
    assert [d["seq"] for d in documents] == [0, 1, 2]
    assert all(d["replayed"] for d in documents)
    assert documents[0]["ts"] == 1700000000.0 and documents[0]["data_parallel_rank"] == 0
    stored = documents[1]["events"][0]
    assert stored["type"] == "BlockStored"
    assert stored["block_hashes"] == [DIGESTS[2].hex()]
    assert stored["parent_block_hash"] == DIGESTS[1].hex()
    assert stored["lora_name"] == "sql" and stored["extra_keys"] == [["sql"]]
    assert [e["type"] for e in documents[2]["events"]] == ["BlockRemoved", "AllBlocksCleared"]


def test_readable_text_from_replay(publisher_with_history, capsys):
    assert main(_events_argv(publisher_with_history)) == 0
    out = capsys.readouterr().out
    assert "seq 0 (replayed)  2023-11-14T22:13:20.000+00:00  dp_rank=0  1 event(s)" in out
    assert "BlockStored      2 block(s) of 4  parent=-" in out
    assert f"parent={DIGESTS[1].hex()[:16]}" in out
    assert "lora=sql(3)" in out
    assert "BlockRemoved     1 block(s)" in out
    assert "  AllBlocksCleared" in out


def test_live_stream_with_int_hashes(capsys):
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                  **VLLM_NUMBERING)
    try:
        # Publish in the background until the command has printed two batches; the
        # replay endpoint fills whatever the just-connected SUB socket missed.
        done = threading.Event()

        def feed():
            while not done.is_set():
                publisher.publish(_records()[0])
                done.wait(0.02)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        try:
            code = main(["events", publisher.endpoint, "--replay-endpoint",
                         publisher.replay_endpoint, "--json", "--count", "2", "--timeout", "3"])
        finally:
            done.set()
            feeder.join(2.0)
    finally:
        publisher.close()
    assert code == 0
    documents = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(documents) == 2
    assert documents[1]["seq"] == documents[0]["seq"] + 1
    expected = [block_hash_to_int64(h) for h in DIGESTS[:2]]
    assert documents[0]["events"][0]["block_hashes"] == expected


def test_timeout_without_batches_exits_1(capsys):
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", **VLLM_NUMBERING)
    try:
        assert main(["events", publisher.endpoint, "--timeout", "0.4"]) == 1
    finally:
        publisher.close()
    assert "no batch for 0.4s" in capsys.readouterr().err


def test_argument_errors(capsys):
    assert main(["events", "tcp://127.0.0.1:1", "--from-seq", "0"]) == 2
    assert "--from-seq needs --replay-endpoint" in capsys.readouterr().err
    for flag in (["--count", "0"], ["--timeout", "0"], ["--timeout", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["events", "tcp://127.0.0.1:1", *flag])
        assert exit_info.value.code == 2
    capsys.readouterr()
    for argv in (["bogus"], ["tcp://127.0.0.1:1", "--replay-endpoint", "nowhere"]):
        assert main(["events", *argv, "--timeout", "0.2"]) == 2
        err = capsys.readouterr().err
        assert "cannot open the endpoint" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://127.0.0.1:5558",
      "--from-seq", "99999999999999999999999"], "must be at most"),
    (["tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://127.0.0.1:5558",
      "--from-seq", "-1"], "must be >= 0"),
    (["tcp://127.0.0.1:99999"], "the port must be a number in 0..65535 or '*'"),
    (["tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://[::1]:65536"],
     "the port must be a number"),
])
def test_out_of_range_numbers_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["events", *argv, "--timeout", "0.2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_host_that_does_not_resolve_is_an_error_not_a_silent_wait(capsys):
    for argv in (["tcp://nonexistent.invalid:5557"],
                 ["tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://nonexistent.invalid:1"]):
        assert main(["events", *argv, "--timeout", "30"]) == 2
        err = capsys.readouterr().err
        assert "cannot resolve the host 'nonexistent.invalid'" in err
    # '*' and interface names are the business of --bind, which resolves nothing.
    assert main(["events", "tcp://no-such-interface.invalid:5557", "--bind",
                 "--timeout", "0.2"]) == 2
    assert "cannot open the endpoint" in capsys.readouterr().err


def test_from_seq_waits_for_the_replay_as_long_as_timeout_says(capsys):
    import zmq

    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes the replay request, never answers
    silent.bind("tcp://127.0.0.1:*")
    try:
        replay_endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
        assert main(["events", "tcp://127.0.0.1:1", "--replay-endpoint", replay_endpoint,
                     "--from-seq", "0", "--timeout", "0.3"]) == 1
    finally:
        silent.close(linger=0)
        context.term()
    assert "within 0.3s" in capsys.readouterr().err


def test_a_reader_that_goes_away_stops_the_command_quietly(publisher_with_history):
    """``events ... --json | head``: exit 141 (128 + SIGPIPE), nothing on stderr."""
    result = run_with_reader_gone([*_events_argv(publisher_with_history), "--json"],
                                  timeout=60)
    assert result.stderr == ""
    assert result.returncode == 141


def test_help_explains_the_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["events", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for phrase in ("BlockStored", "--replay-endpoint", "--from-seq", "--json", "--count"):
        assert phrase in out


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery is POSIX-only here")
def test_ctrl_c_stops_cleanly():
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", **VLLM_NUMBERING)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    process = subprocess.Popen(
        [sys.executable, "-m", "prefixcache", "events", publisher.endpoint, "--timeout", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,
    )
    try:
        # Wait until the subscriber is up: it prints every batch it gets. A reader thread
        # keeps the wait bounded even if the child prints nothing.
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(process.stdout.readline()),
                         daemon=True).start()
        stdout_line = ""
        deadline = time.monotonic() + 10.0
        while not stdout_line and time.monotonic() < deadline:
            publisher.publish([core.AllBlocksCleared()])
            with contextlib.suppress(queue.Empty):
                stdout_line = lines.get(timeout=0.05)
        assert stdout_line.startswith("seq "), "the subscriber never printed a batch"
        process.send_signal(signal.SIGINT)
        returncode = process.wait(timeout=10)
        stderr = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        publisher.close()
    assert returncode == 130
    assert "stopped after" in stderr
    assert "Traceback" not in stderr
