"""``prefixcache serve`` refuses bad configuration with exit code 2 and a one-line message.
The listening socket comes first, before the model loads: a port it cannot have costs no
model load, and no error path leaves a socket open."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from prefixcache.arg_types import byte_size, size_text
from prefixcache.config import (
    DEFAULT_DTYPE,
    DEFAULT_EVICTION_POLICY,
    DEFAULT_HASH_ALGO,
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)
from prefixcache.core.eviction import LearnedReuseFreeBlockQueue
from prefixcache.engine.arg_utils import EngineArgs, KVEventsArgs
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.entrypoints.cli import build_parser, main
from prefixcache.entrypoints.openai.listen import listen_sockets
from prefixcache.entrypoints.openai.server_args import ServerArgs
from tests.entrypoints.conftest import MODEL_NAME, ServerProcess, assert_clean_exit
from tests.processes import free_loopback_ports


def test_flags_map_to_engine_args_in_vllm_spelling():
    args = build_parser().parse_args([
        "serve", "/models/m", "--block-size", "32", "--no-enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor", "--num-gpu-blocks-override", "100",
        "--kv-cache-memory", "1GiB", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--dtype", "bfloat16", "--seed", "3", "--eviction-policy", "2q"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(
        "/models/m", enable_prefix_caching=False, block_size=32, num_kv_blocks=100,
        dtype="bfloat16", hash_algo="sha256_cbor", eviction_policy="2q",
        enable_chunked_prefill=True, seed=3, kv_cache_memory_bytes=1 << 30,
        max_num_seqs=8, max_num_batched_tokens=512)
    # The aliases set the same options.
    aliases = build_parser().parse_args(["serve", "--num-kv-blocks", "7",
                                         "--kv-cache-memory-bytes", "1000"])
    aliased = EngineArgs.from_cli_args(aliases)
    assert (aliased.num_kv_blocks, aliased.kv_cache_memory_bytes) == (7, 1000)
    # No flag: the engine's own defaults, exactly as the Python API has them.
    assert EngineArgs.from_cli_args(build_parser().parse_args(["serve"])) == EngineArgs()
    assert EngineArgs().eviction_policy == DEFAULT_EVICTION_POLICY == "lru"


def test_server_flags_map_to_server_args():
    args = build_parser().parse_args([
        "serve", "--host", "0.0.0.0", "--port", "0", "--served-model-name", "a", "b",
        "--api-key", "k", "--log-level", "debug", "--uvicorn-log-level", "info",
        "--max-request-body-bytes", "1MiB", "--request-head-timeout", "2.5",
        "--max-requests-per-tenant", "3", "--shutdown-timeout", "0"])
    assert ServerArgs.from_cli_args(args) == ServerArgs(
        host="0.0.0.0", port=0, served_model_name=["a", "b"], api_key="k",
        log_level="debug", uvicorn_log_level="info", max_request_body_bytes=1 << 20,
        request_head_timeout=2.5, max_requests_per_tenant=3, shutdown_timeout=0.0)
    # No flag: the defaults the Python API has; every option is a flag of serve.
    assert ServerArgs.from_cli_args(build_parser().parse_args(["serve"])) == ServerArgs()
    serve_dests = {action.dest for action in serve_parser()._actions}
    assert {option.name for option in dataclasses.fields(ServerArgs)} <= serve_dests


@pytest.mark.parametrize(("values", "message"), [
    ({"port": 70000}, "port must be a port in 0..65535, got 70000"),
    ({"max_json_depth": True}, "max_json_depth must be a positive integer, got True"),
    ({"max_requests_per_tenant": 0},
     "max_requests_per_tenant must be a positive integer or None, got 0"),
    ({"request_body_timeout": 0}, "request_body_timeout must be a finite number > 0, got 0"),
    ({"shutdown_timeout": float("inf")},
     "shutdown_timeout must be a finite number >= 0, got inf"),
    ({"log_level": "loud"}, "log_level must be one of debug, info, warning, error, got 'loud'"),
    ({"served_model_name": ["ok", " "]}, "served_model_name must be a list of non-blank names"),
    ({"admin_api_key": " "}, "admin_api_key must be a non-blank key or None, got ' '"),
    ({"api_key": "k", "api_key_file": "keys.txt"}, "use either --api-key"),
    ({"admin_api_key": "a", "admin_api_key_file": "f"}, "use either --admin-api-key"),
])
def test_server_args_refuse_bad_values_naming_the_option(values, message):
    with pytest.raises(ValueError) as excinfo:
        ServerArgs(**values)
    assert str(excinfo.value).startswith(message)


def test_eviction_policy_flag_reaches_the_engines_block_pool(tiny_model_dir):
    from prefixcache.engine.async_llm import AsyncLLM

    args = build_parser().parse_args([
        "serve", str(tiny_model_dir), "--eviction-policy", "learned-reuse",
        "--block-size", "4", "--num-kv-blocks", "16"])
    # As `run` builds it, minus uvicorn.
    llm = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args),
                                    KVEventsArgs.from_cli_args(args))
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
        "--kv-events-block-hash-format", "bytes", "--data-parallel-rank", "3"])
    assert KVEventsArgs.from_cli_args(args) == KVEventsArgs(
        kv_events_endpoint="tcp://127.0.0.1:5557",
        kv_events_replay_endpoint="tcp://127.0.0.1:5558", kv_events_topic="kv",
        kv_events_block_hash_format="bytes", data_parallel_rank=3)
    defaults = KVEventsArgs.from_cli_args(build_parser().parse_args(["serve"]))
    assert defaults == KVEventsArgs() and not defaults.enabled
    assert defaults.kv_events_block_hash_format == "int64"  # vLLM's default
    assert defaults.data_parallel_rank == 0  # endpoints bound as given


def test_data_parallel_rank_offsets_both_endpoints_and_stamps_the_engines_batches(
        tiny_model_dir):
    from prefixcache.engine.async_llm import AsyncLLM
    from prefixcache.events.subscriber import EventSubscriber
    from prefixcache.events.wire import BlockStored

    live_port, replay_port = free_loopback_ports(2)
    # Replica 2 started with the flags every replica shares, two below the free ports.
    args = build_parser().parse_args([
        "serve", str(tiny_model_dir), "--block-size", "4", "--num-kv-blocks", "16",
        "--kv-events-endpoint", f"tcp://127.0.0.1:{live_port - 2}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port - 2}",
        "--data-parallel-rank", "2"])
    # As `run` builds it, minus uvicorn.
    llm = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args),
                                    KVEventsArgs.from_cli_args(args))
    try:
        publisher = llm.event_publisher
        assert publisher.endpoint == f"tcp://127.0.0.1:{live_port}"
        assert publisher.replay_endpoint == f"tcp://127.0.0.1:{replay_port}"

        async def generate():
            params = SamplingParams(temperature=0, max_tokens=2)
            return [o async for o in llm.generate("r", list(range(10, 20)), params)]

        assert asyncio.run(asyncio.wait_for(generate(), 60))[-1].finished
        # Outputs follow the step's publish() call; the send happens on the publisher's
        # thread, so poll its counter (bounded) before asking for a replay.
        deadline = time.monotonic() + 10
        while publisher.num_published_batches == 0:
            assert time.monotonic() < deadline, "the engine's events were never sent"
            time.sleep(0.005)
        with EventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint) as sub:
            replayed = sub.replay(0, timeout_s=10)
        assert replayed
        assert {r.batch.data_parallel_rank for r in replayed} == {2}
        assert any(isinstance(event, BlockStored) for r in replayed for event in r.batch.events)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("flags", "message"), [
    (["--kv-events-endpoint", "tcp://127.0.0.1:65534", "--data-parallel-rank", "2"],
     "KV events endpoint 'tcp://127.0.0.1:65534' offset by data-parallel rank 2 gives port "
     "65536, above 65535"),
    (["--kv-events-endpoint", "tcp://127.0.0.1:*",
      "--kv-events-replay-endpoint", "tcp://127.0.0.1:65535", "--data-parallel-rank", "1"],
     "KV events endpoint 'tcp://127.0.0.1:65535' offset by data-parallel rank 1 gives port "
     "65536, above 65535"),
    (["--kv-events-endpoint", "ws://127.0.0.1:5557", "--data-parallel-rank", "1"],
     "cannot derive a KV events endpoint for data-parallel rank 1 from "
     "'ws://127.0.0.1:5557': expected tcp://HOST:PORT, tcp://HOST:*, ipc://PATH or "
     "inproc://NAME"),
], ids=["past-last-port", "replay-past-last-port", "other-transport"])
def test_data_parallel_rank_bad_endpoint_exits_2_with_one_line_before_the_model_loads(
        flags, message, monkeypatch, capsys):
    from prefixcache.engine.llm_engine import LLMEngine

    def from_engine_args(*_):
        # Fail, not load the default model and serve forever, if the endpoint is accepted.
        pytest.fail("the model was loaded although the KV events endpoint is unusable")

    monkeypatch.setattr(LLMEngine, "from_engine_args", from_engine_args)
    created = record_sockets(monkeypatch)
    assert main(["serve", "--port", "0", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"prefixcache serve: {message}\n"
    assert captured.out == ""
    assert created and all(sock.fileno() == -1 for sock in created)


def test_negative_data_parallel_rank_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["serve", "--data-parallel-rank", "-1"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "argument --data-parallel-rank: must be >= 0, got -1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["serve", "--api-key-file", "/nonexistent/keys.txt"],
    ["serve", "--api-key", "k", "--api-key-file", "{keys}"],
    ["serve", "{missing_model}"],
    ["serve", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"],
    ["serve", "--kv-events-endpoint", "bogus"],
    ["serve", "--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "x"],
], ids=["missing-key-file", "key-and-key-file", "missing-model", "replay-without-endpoint",
        "bad-events-endpoint", "bad-replay-endpoint"])
def test_bad_configuration_exits_2(argv, tmp_path, capsys, monkeypatch):
    keys = tmp_path / "keys.txt"
    keys.write_text("k1 tenant\n")
    argv = [a.format(keys=keys, missing_model=tmp_path / "no-model") for a in argv]
    created = record_sockets(monkeypatch)
    # --port 0: the engine errors come after the bind, which must not depend on port 8000.
    assert main([*argv, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "prefixcache serve:" in err and "Traceback" not in err
    assert all(sock.fileno() == -1 for sock in created)  # the listening socket too


def record_sockets(monkeypatch) -> list[socket.socket]:
    """Every socket.socket made from now on in this test, to check that all were closed."""
    created: list[socket.socket] = []

    class RecordingSocket(socket.socket):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(socket, "socket", RecordingSocket)
    return created


def forbid_engine(monkeypatch) -> None:
    from prefixcache.engine.async_llm import AsyncLLM

    def from_engine_args(*_):
        pytest.fail("the engine (and the model) was built although the port is unusable")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", from_engine_args)


@pytest.fixture
def taken_port():
    """A port something else already listens on (127.0.0.1), as another server would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        yield blocker.getsockname()[1]


def test_taken_port_exits_2_with_one_line_and_never_builds_the_engine(taken_port, tiny_model_dir,
                                                                     monkeypatch, capsys):
    forbid_engine(monkeypatch)
    created = record_sockets(monkeypatch)
    code = main(["serve", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(taken_port)])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err == (f"prefixcache serve: cannot listen on 127.0.0.1:{taken_port}: "
                            "address already in use\n")
    assert captured.out == ""
    assert created and all(sock.fileno() == -1 for sock in created)


def test_unassignable_host_exits_2_naming_host_and_port(monkeypatch, capsys):
    forbid_engine(monkeypatch)
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): numeric, so no DNS, and on no interface.
    assert main(["serve", "--host", "192.0.2.1", "--port", "8123"]) == 2
    assert capsys.readouterr().err == (
        "prefixcache serve: cannot listen on 192.0.2.1:8123: cannot assign requested address\n")


def test_the_port_listens_before_the_engine_loads_and_closes_if_it_fails(tiny_model_dir,
                                                                        monkeypatch, capsys):
    from prefixcache.engine.async_llm import AsyncLLM

    created = record_sockets(monkeypatch)
    seen = {}

    def from_engine_args(*_):
        [listener] = created
        seen["port"] = listener.getsockname()[1]
        # Already listening: a client connects (and would wait in the backlog).
        with socket.create_connection(("127.0.0.1", seen["port"]), timeout=5):
            pass
        raise ValueError("no engine in this test")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", from_engine_args)
    assert main(["serve", str(tiny_model_dir), "--port", "0"]) == 2
    assert capsys.readouterr().err == "prefixcache serve: no engine in this test\n"
    assert seen["port"] != 0
    assert all(sock.fileno() == -1 for sock in created)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", seen["port"]), timeout=5).close()


def test_port_0_ready_line_names_the_port_that_serves(server):
    # The session server runs with --port 0; its URL comes from its "ready" line.
    port = urlsplit(server.url).port
    assert port and port != 0
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200


def test_listen_sockets_port_0_on_every_interface_shares_one_port():
    sockets = listen_sockets("", 0)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1 and 0 not in ports
        assert {sock.family for sock in sockets} >= {socket.AF_INET}
    finally:
        for sock in sockets:
            sock.close()


def test_listen_sockets_ipv6_loopback():
    try:
        sockets = listen_sockets("::1", 0)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    try:
        assert [sock.family for sock in sockets] == [socket.AF_INET6]
        port = sockets[0].getsockname()[1]
        with socket.create_connection(("::1", port), timeout=5):
            pass
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize("flag", [["--port", "70000"], ["--block-size", "0"],
                                  ["--kv-cache-memory", "lots"], ["--dtype", "int4"],
                                  ["--eviction-policy", "mru"],
                                  ["--data-parallel-rank", "-1"],
                                  ["--data-parallel-rank", "two"]])
def test_bad_flag_values_are_usage_errors(flag):
    with pytest.raises(SystemExit) as excinfo:
        build_parser().parse_args(["serve", *flag])
    assert excinfo.value.code == 2


def serve_parser() -> argparse.ArgumentParser:
    subparsers = next(action for action in build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction))
    return subparsers.choices["serve"]


# Flags whose absence is the setting itself: nothing to show as a default.
NO_DEFAULT_DESTS = {"help", "api_key", "api_key_file", "kv_events_endpoint",
                    "kv_events_replay_endpoint"}


def test_every_serve_flag_says_what_it_does_and_its_default():
    for action in serve_parser()._actions:
        if action.dest == "help":
            continue
        assert action.help and len(action.help) > 20, action.option_strings or action.dest
        if action.dest not in NO_DEFAULT_DESTS:
            assert "(default: " in action.help, action.option_strings or action.dest


def test_serve_help_shows_the_engines_actual_defaults(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["serve", "--help"])
    assert excinfo.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert "the engine's" not in text
    assert f"(default: {DEFAULT_KV_CACHE_MEMORY_BYTES // 1024**3}GiB)" in text
    assert f"(default: {DEFAULT_MAX_NUM_SEQS})" in text
    assert f"(default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})" in text
    for flag, default in (("--dtype", DEFAULT_DTYPE), ("--log-level", "info"),
                          ("--prefix-caching-hash-algo", DEFAULT_HASH_ALGO)):
        after_flag = text.split(f" {flag} ", 1)[1]
        assert f"(default: {default})" in after_flag.split(" --", 1)[0], flag


@pytest.mark.parametrize(("num_bytes", "text"), [(2 * 1024**3, "2GiB"), (16 * 1024**2, "16MiB"),
                                                 (1536 * 1024**2, "1536MiB"), (1000, "1000")])
def test_size_text_reads_back_as_the_same_size(num_bytes, text):
    assert size_text(num_bytes) == text
    assert byte_size(text) == num_bytes


@pytest.mark.parametrize(("make", "message"), [
    (lambda tmp: tmp / "absent.txt",
     "cannot read the API key file {path}: no such file or directory"),
    (lambda tmp: tmp,
     "cannot read the API key file {path}: is a directory"),
    (lambda tmp: write(tmp / "keys.bin", b"k1 \xff\n"),
     "the API key file {path} is not UTF-8 text (byte 3 cannot be decoded)"),
    (lambda tmp: write(tmp / "keys.txt", b"# no keys yet\n"),
     "the API key file {path} holds no API keys"),
], ids=["missing", "folder", "not-utf8", "no-keys"])
def test_unusable_api_key_file_is_named_with_the_reason_in_words(make, message, tmp_path,
                                                                  monkeypatch, capsys):
    forbid_engine(monkeypatch)
    path = make(tmp_path)
    assert main(["serve", "--api-key-file", str(path), "--port", "0"]) == 2
    assert capsys.readouterr().err == f"prefixcache serve: {message.format(path=path)}\n"


def write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("file_name", "content", "problem"), [
    ("config.json", b'{"model_type": "llama"\n"vocab_size": 8}',
     "is not valid JSON: Expecting ',' delimiter: line 2 column 1 (char 23)"),
    ("config.json", b"[1, 2]", "must hold a JSON object, not an array"),
    ("config.json", b"null", "must hold a JSON object, not null"),
    ("config.json", b"\xff{}", "is not UTF-8 text (byte 0 cannot be decoded)"),
    ("tokenizer_config.json", b'"chat"', "must hold a JSON object, not a string"),
], ids=["syntax", "array", "null", "not-utf8", "tokenizer-config-string"])
def test_broken_json_in_the_model_folder_is_named(file_name, content, problem, tiny_model_dir,
                                                  tmp_path, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / file_name).write_bytes(content)
    assert main(["serve", str(model_dir), "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"prefixcache serve: cannot load {model_dir}: {model_dir / file_name} {problem}\n")


def test_a_repeated_served_model_name_is_listed_and_served_once(tiny_model_dir):
    process = ServerProcess(tiny_model_dir, "--served-model-name", MODEL_NAME, "b", MODEL_NAME,
                            "b", "c")
    try:
        with httpx.Client(base_url=process.url, timeout=60) as client:
            response = client.get("/v1/models")
            assert response.status_code == 200
            assert [card["id"] for card in response.json()["data"]] == [MODEL_NAME, "b", "c"]
            for name in (MODEL_NAME, "b", "c"):
                response = client.post("/v1/completions",
                                       json={"model": name, "prompt": [1, 2], "max_tokens": 1})
                assert response.status_code == 200 and response.json()["model"] == name
    finally:
        assert_clean_exit(process)
    log = "".join(process.log)
    assert (f"--served-model-name: '{MODEL_NAME}', 'b' given more than once; serving each "
            "once") in log


@pytest.mark.parametrize("name", ["", "  "], ids=["empty", "blank"])
def test_blank_served_model_name_is_a_usage_error(name, capsys):
    with pytest.raises(SystemExit) as excinfo:  # parsing only: never serve if accepted
        build_parser().parse_args(["serve", "--served-model-name", "ok", name])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --served-model-name: a model name must not be blank, got {name!r}" in err
