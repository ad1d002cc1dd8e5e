"""``prefixcache serve``: the OpenAI-compatible server on uvicorn.

Flags use vLLM's spelling where vLLM has the option. Every flag is declared once, as a
field: the engine's and the KV events' in :mod:`prefixcache.engine.arg_utils`
(``EngineArgs``, ``KVEventsArgs``), the server's own in
:mod:`prefixcache.entrypoints.openai.server_args` (``ServerArgs``); this module lists
none. Importing it is cheap (no torch, no FastAPI); ``run`` pays for them.

Check first, then commit: ``run`` binds and listens on ``--host``/``--port`` before it loads
the model, so a taken port, a bad host or a refused privileged port costs the user a second,
not a model load (:mod:`prefixcache.entrypoints.openai.listen`); uvicorn then serves on
the already-listening sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from prefixcache.config import DEFAULT_MODEL_NAME
from prefixcache.engine.arg_utils import EngineArgs, KVEventsArgs
from prefixcache.entrypoints.openai.listen import host_port, listen_sockets, os_error_reason
from prefixcache.entrypoints.openai.server_args import ServerArgs
from prefixcache.lora.modules import number_lora_modules

logger = logging.getLogger("prefixcache.serve")

DESCRIPTION = """\
Serve a model over an OpenAI-compatible HTTP API with automatic prefix caching.

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream, n, max_tokens,
temperature, top_p, seed, stop, cache_salt), GET /v1/models, GET /health, GET /metrics
(Prometheus), POST /reset_prefix_cache[?wait=true|abort_running=true|reset_kv_tier=true].

Every response's usage.prompt_tokens_details.cached_tokens counts the prompt tokens
served from the prefix cache (with n > 1: per prompt, the least over its n choices).

With --api-key-file, every request needs 'Authorization: Bearer <key>' and each key's
tenant gets its own prefix-cache partition, whatever cache_salt its requests carry.
/reset_prefix_cache is an operator endpoint: with --admin-api-key only that key may call
it; with tenants and no admin key, nobody may.

With --enable-lora, a request whose "model" is a LoRA adapter's name runs with that
adapter; /v1/models lists the adapters (parent: the base model), and the operator
endpoints POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"} change them at run time. Adapters never share
cached KV blocks with each other or with the base model.

Slow, oversized and hostile requests are refused at the edge (408, 413, 414, 431, 400)
with the limits below; --max-requests-per-tenant answers 429 with Retry-After.
"""

EPILOG = """\
examples:
  prefixcache serve                                   # the default SmolLM2-135M-Instruct
  prefixcache serve ./my-hf-model --port 8080 --served-model-name mine
  prefixcache serve --api-key-file keys.txt --kv-events-endpoint tcp://127.0.0.1:5557
  prefixcache serve ./my-hf-model --max-loras 4 --lora-modules sql=./sql poet=./poet
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    EngineArgs.add_cli_args(parser, positional=("model",))
    KVEventsArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def served_model_names(server_args: ServerArgs, model: object) -> tuple[str, ...]:
    """The names the server answers to, first one first, each once.

    A repeated ``--served-model-name`` is served once, with a warning, rather than
    refused: ``a b a`` can only mean "serve a and b", so there is nothing to resolve, and
    a deployment should not fail over it; the warning still shows a likely typo. Each
    name must be listed once in ``/v1/models``, as OpenAI's list has unique ids.
    """
    given = list(server_args.served_model_name or [str(model or DEFAULT_MODEL_NAME)])
    names = tuple(dict.fromkeys(given))
    if len(names) < len(given):
        repeated = [name for name in names if given.count(name) > 1]
        logger.warning("--served-model-name: %s given more than once; serving each once",
                       ", ".join(repr(name) for name in repeated))
    return names


def run(args: argparse.Namespace) -> int:
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as exc:
        print(f"prefixcache serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server_args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = served_model_names(server_args, args.model)
    try:
        lora_modules = tuple(number_lora_modules(server_args.lora_modules or ()))
    except ValueError as exc:
        print(f"prefixcache serve: {exc}", file=sys.stderr)
        return 2
    clashes = [m.lora_name for m in lora_modules if m.lora_name in names]
    if clashes:
        print(f"prefixcache serve: LoRA adapter name {clashes[0]!r} is also a served model "
              "name", file=sys.stderr)
        return 2
    if lora_modules:
        args.enable_lora = True
    try:
        authenticator = _authenticator(server_args)
    except (OSError, ValueError) as exc:
        print(f"prefixcache serve: {exc}", file=sys.stderr)
        return 2

    host, port = server_args.host, server_args.port
    try:
        sockets = listen_sockets(host, port)
    except OSError as exc:
        print(f"prefixcache serve: cannot listen on {host_port(host, port)}: "
              f"{os_error_reason(exc)}", file=sys.stderr)
        return 2
    try:
        return _run_engine(args, names, authenticator, server_args, sockets, lora_modules)
    finally:
        # uvicorn closes them on a clean shutdown; every other way out lands here.
        for sock in sockets:
            sock.close()


def _authenticator(server_args: ServerArgs):
    """The server's keys and roles, read from the key files the options name; ValueError
    for a file that cannot be used."""
    from prefixcache.entrypoints.openai.tenancy import (
        Authenticator,
        load_admin_api_key_file,
        load_api_key_file,
    )

    key_to_tenant = None if server_args.api_key_file is None else load_api_key_file(
        server_args.api_key_file)
    admin_key = server_args.admin_api_key
    if server_args.admin_api_key_file is not None:
        admin_key = load_admin_api_key_file(server_args.admin_api_key_file)
    return Authenticator(key_to_tenant, server_args.api_key, admin_key)


def _run_engine(args: argparse.Namespace, names: tuple[str, ...], authenticator,
                server_args: ServerArgs, sockets: list, lora_modules: tuple) -> int:
    import zmq

    from prefixcache.engine.async_llm import AsyncLLM

    try:
        engine_args = EngineArgs.from_cli_args(args)
        llm = AsyncLLM.from_engine_args(engine_args, KVEventsArgs.from_cli_args(args))
    except (OSError, ValueError) as exc:
        print(f"prefixcache serve: {exc}", file=sys.stderr)
        return 2
    except zmq.ZMQError as exc:  # a malformed or taken KV events address
        print(f"prefixcache serve: cannot open a KV events endpoint: {exc}", file=sys.stderr)
        return 2
    try:
        for lora_request in lora_modules:
            try:
                asyncio.run(llm.add_lora(lora_request))
            except ValueError as exc:  # a LoRAError: missing folder, unusable adapter
                print(f"prefixcache serve: {exc}", file=sys.stderr)
                return 2
        return _serve(engine_args, names, llm, authenticator, server_args, sockets,
                      lora_modules)
    finally:
        llm.shutdown()


def _serve(engine_args: EngineArgs, names: tuple[str, ...], llm, authenticator,
           server_args: ServerArgs, sockets: list, lora_modules: tuple) -> int:
    import uvicorn

    from prefixcache.entrypoints.openai.api_server import build_app
    from prefixcache.entrypoints.openai.http_protocol import h11_buffer_bytes, protocol_factory
    from prefixcache.entrypoints.openai.serving import ModelInfo
    from prefixcache.entrypoints.openai.serving_models import ServedModels
    from prefixcache.entrypoints.openai.uvicorn_server import UvicornServer

    engine = llm.engine
    model_info = ModelInfo(served_model_names=names,
                           root=str(engine_args.model or DEFAULT_MODEL_NAME),
                           max_model_len=engine.max_model_len,
                           num_kv_blocks=engine.num_kv_blocks, block_size=engine.block_size)
    served_models = ServedModels(llm, names, model_info.root, engine.max_model_len,
                                 lora_modules, engine_args.enable_lora)
    app = build_app(llm, engine.tokenizer, model_info, authenticator, server_args,
                    served_models)
    head_bytes = server_args.h11_max_incomplete_event_size
    log_level = server_args.uvicorn_log_level
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                            log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=log_level in ("debug", "info"),
                            http=protocol_factory(head_bytes,
                                                  server_args.request_head_timeout),
                            h11_max_incomplete_event_size=h11_buffer_bytes(head_bytes))
    server = UvicornServer(config, model_info, llm, app.state.admission,
                           server_args.shutdown_timeout)
    try:
        server.run(sockets=sockets)
    finally:
        app.state.tokenizer_pool.shutdown()
    return 0 if server.started else 1
