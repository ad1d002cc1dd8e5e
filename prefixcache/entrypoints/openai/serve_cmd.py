"""``prefixcache serve``: the OpenAI-compatible server on uvicorn.

Flags use vLLM's spelling where vLLM has the option. The engine's flags and the KV events
flags are declared once, in :mod:`prefixcache.engine.arg_utils` (``EngineArgs``,
``KVEventsArgs``); the server's own are declared here. Importing this module is cheap (no
torch, no FastAPI); ``run`` pays for them.

Check first, then commit: ``run`` binds and listens on ``--host``/``--port`` before it loads
the model, so a taken port, a bad host or a refused privileged port costs the user a second,
not a model load (:mod:`prefixcache.entrypoints.openai.listen`); uvicorn then serves on
the already-listening sockets.
"""

from __future__ import annotations

import argparse
import logging
import sys

from prefixcache.arg_types import byte_size, port, size_text
from prefixcache.config import DEFAULT_MODEL_NAME
from prefixcache.engine.arg_utils import EngineArgs, KVEventsArgs
from prefixcache.entrypoints.openai.listen import host_port, listen_sockets, os_error_reason

logger = logging.getLogger("prefixcache.serve")

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
LOG_LEVELS = ("debug", "info", "warning", "error")

DESCRIPTION = """\
Serve a model over an OpenAI-compatible HTTP API with automatic prefix caching.

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream, n, max_tokens,
temperature, top_p, seed, stop, cache_salt), GET /v1/models, GET /health, GET /metrics
(Prometheus), POST /reset_prefix_cache[?wait=true|abort_running=true].

Every response's usage.prompt_tokens_details.cached_tokens counts the prompt tokens
served from the prefix cache (with n > 1: per prompt, the least over its n choices).

With --api-key-file, every request needs 'Authorization: Bearer <key>' and each key's
tenant gets its own prefix-cache partition, whatever cache_salt its requests carry.
"""

EPILOG = """\
examples:
  prefixcache serve                                   # the default SmolLM2-135M-Instruct
  prefixcache serve ./my-hf-model --port 8080 --served-model-name mine
  prefixcache serve --api-key-file keys.txt --kv-events-endpoint tcp://127.0.0.1:5557
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    net.add_argument("--port", type=port, default=8000,
                     help="port to bind; 0 picks a free one (default: %(default)s)")
    net.add_argument("--served-model-name", nargs="+", type=model_name, default=None,
                     metavar="NAME",
                     help="model name(s) clients use; the first is reported, a repeated "
                          "one is served once (default: the model argument)")
    net.add_argument("--api-key", default=None,
                     help="require this key (Authorization: Bearer KEY); no tenants")
    net.add_argument("--api-key-file", default=None, metavar="FILE",
                     help="lines of 'key tenant': require a listed key and isolate each "
                          "tenant's prefix cache")
    net.add_argument("--max-request-body-bytes", type=byte_size,
                     default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="SIZE",
                     help="larger bodies get 413 "
                          f"(default: {size_text(DEFAULT_MAX_REQUEST_BODY_BYTES)})")
    net.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                     help="prefixcache's own logs: the ready line, engine failures "
                          "(default: %(default)s)")
    net.add_argument("--uvicorn-log-level", default="warning", choices=LOG_LEVELS,
                     help="uvicorn's own logs, access log included at info "
                          "(default: %(default)s)")
    EngineArgs.add_cli_args(parser, positional=("model",))
    KVEventsArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def model_name(text: str) -> str:
    """A ``--served-model-name``: not empty nor blank (the usual result of an unset shell
    variable), which no client would mean to send."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"a model name must not be blank, got {text!r}")
    return text


def served_model_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The names the server answers to, first one first, each once.

    A repeated ``--served-model-name`` is served once, with a warning, rather than
    refused: ``a b a`` can only mean "serve a and b", so there is nothing to resolve, and
    a deployment should not fail over it; the warning still shows a likely typo. Each
    name must be listed once in ``/v1/models``, as OpenAI's list has unique ids.
    """
    given = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    names = tuple(dict.fromkeys(given))
    if len(names) < len(given):
        repeated = [name for name in names if given.count(name) > 1]
        logger.warning("--served-model-name: %s given more than once; serving each once",
                       ", ".join(repr(name) for name in repeated))
    return names


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from prefixcache.entrypoints.openai.tenancy import Authenticator, load_api_key_file

    names = served_model_names(args)

    try:
        key_to_tenant = None if args.api_key_file is None else load_api_key_file(
            args.api_key_file)
        authenticator = Authenticator(key_to_tenant, args.api_key)
    except (OSError, ValueError) as exc:
        print(f"prefixcache serve: {exc}", file=sys.stderr)
        return 2

    try:
        sockets = listen_sockets(args.host, args.port)
    except OSError as exc:
        print(f"prefixcache serve: cannot listen on {host_port(args.host, args.port)}: "
              f"{os_error_reason(exc)}", file=sys.stderr)
        return 2
    try:
        return _run_engine(args, names, authenticator, sockets)
    finally:
        # uvicorn closes them on a clean shutdown; every other way out lands here.
        for sock in sockets:
            sock.close()


def _run_engine(args: argparse.Namespace, names: tuple[str, ...], authenticator,
                sockets: list) -> int:
    import zmq

    from prefixcache.engine.async_llm import AsyncLLM

    try:
        llm = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args),
                                        KVEventsArgs.from_cli_args(args))
    except (OSError, ValueError) as exc:
        print(f"prefixcache serve: {exc}", file=sys.stderr)
        return 2
    except zmq.ZMQError as exc:  # a malformed or taken KV events address
        print(f"prefixcache serve: cannot open a KV events endpoint: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args, names, llm, authenticator, sockets)
    finally:
        llm.shutdown()


def _serve(args: argparse.Namespace, names: tuple[str, ...], llm, authenticator,
           sockets: list) -> int:
    import uvicorn

    from prefixcache.entrypoints.openai.api_server import build_app
    from prefixcache.entrypoints.openai.serving import ModelInfo
    from prefixcache.entrypoints.openai.uvicorn_server import UvicornServer

    engine = llm.engine
    model_info = ModelInfo(served_model_names=names, root=str(args.model or DEFAULT_MODEL_NAME),
                           max_model_len=engine.max_model_len,
                           num_kv_blocks=engine.num_kv_blocks, block_size=engine.block_size)
    app = build_app(llm, engine.tokenizer, model_info, authenticator,
                    max_body_bytes=args.max_request_body_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5,
                            access_log=args.uvicorn_log_level in ("debug", "info"))
    server = UvicornServer(config, model_info, llm)
    server.run(sockets=sockets)
    return 0 if server.started else 1
