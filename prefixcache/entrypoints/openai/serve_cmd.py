"""``prefixcache serve``: the OpenAI-compatible server on uvicorn.

Flags use vLLM's spelling where vLLM has the option. Importing this module is cheap (no
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

from prefixcache.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DTYPE,
    DEFAULT_EVICTION_POLICY,
    DEFAULT_HASH_ALGO,
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_QUANTIZATION,
    DTYPES,
    EVICTION_POLICIES,
    HASH_ALGOS,
    QUANTIZATION_METHODS,
)
from prefixcache.entrypoints.arg_types import byte_size, non_negative_int, port, positive_int
from prefixcache.entrypoints.openai.listen import host_port, listen_sockets, os_error_reason

logger = logging.getLogger("prefixcache.serve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# prefixcache.events.convert.BLOCK_HASH_FORMATS, not imported here: it loads msgspec.
BLOCK_HASH_FORMATS = ("int64", "bytes")
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

def size_text(num_bytes: int) -> str:
    """``num_bytes`` as the largest binary unit that divides it (``2GiB``), as
    ``--kv-cache-memory`` and ``--max-request-body-bytes`` take it."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model folder or .gguf file "
                             f"(default: {DEFAULT_MODEL_NAME})")
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
    eng = parser.add_argument_group("engine")
    eng.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPES,
                     help="dtype of the weights and the KV cache (default: %(default)s)")
    eng.add_argument("--quantization", "-q", choices=QUANTIZATION_METHODS,
                     default=DEFAULT_QUANTIZATION,
                     help="weight-only quantized weights for few-token steps (decode); prefill "
                     "keeps the dense weights. auto: int4 from a 4-bit GGUF's own blocks (the "
                     "default model), int8 for other quantized GGUFs, none for float weights "
                     "(default: %(default)s)")
    eng.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                     help="tokens per KV block (default: %(default)s)")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                     default=True,
                     help="reuse cached KV blocks across requests (default: enabled)")
    eng.add_argument("--prefix-caching-hash-algo", default=DEFAULT_HASH_ALGO,
                     choices=HASH_ALGOS,
                     help="hash of the KV block keys (KV events publish them): the sha256 "
                          "ones resist collisions, the xxhash ones are faster, the *_cbor "
                          "ones equal vLLM's byte for byte (default: %(default)s)")
    eng.add_argument("--eviction-policy", default=DEFAULT_EVICTION_POLICY,
                     choices=list(EVICTION_POLICIES),
                     help="which free cached block is evicted first: lru (the design's "
                          "order), unhashed-first (vLLM 0.33's order), 2q (protects "
                          "content referenced twice), learned-reuse (learns which kinds of "
                          "requests leave reused content), document-liveness (evicts first "
                          "what belongs to documents least likely to be asked about again) "
                          "(default: %(default)s)")
    eng.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks",
                     type=positive_int, default=None, metavar="N",
                     help="KV pool size in blocks, overriding --kv-cache-memory "
                          "(default: as many as --kv-cache-memory holds)")
    eng.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory",
                     type=byte_size, default=None, metavar="SIZE",
                     help="memory for the KV pool, e.g. 512MiB; the pool never exceeds "
                          "--max-num-seqs full-context sequences "
                          f"(default: {size_text(DEFAULT_KV_CACHE_MEMORY_BYTES)})")
    eng.add_argument("--max-num-seqs", type=positive_int, default=None, metavar="N",
                     help="most requests running at once; more wait in a queue "
                          f"(default: {DEFAULT_MAX_NUM_SEQS})")
    eng.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="N",
                     help="most tokens one step computes, prompt chunks and decodes "
                          f"together (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    eng.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                     default=True,
                     help="split prompts longer than a step's token budget over several "
                          "steps; without it such a prompt is refused (default: enabled)")
    eng.add_argument("--seed", type=int, default=None,
                     help="seed for requests that bring no seed of their own "
                          "(default: none, so those sample differently each time)")
    events = parser.add_argument_group("KV cache events (vLLM-compatible ZMQ)")
    events.add_argument("--kv-events-endpoint", default=None, metavar="E",
                        help="publish KV events on this PUB endpoint, "
                             "e.g. tcp://127.0.0.1:5557")
    events.add_argument("--kv-events-replay-endpoint", default=None, metavar="E",
                        help="answer replay requests on this ROUTER endpoint")
    events.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                        help="first frame of every message, for subscribers to filter on "
                             "(default: empty)")
    events.add_argument("--kv-events-block-hash-format", default="int64",
                        choices=BLOCK_HASH_FORMATS,
                        help="block hashes as vLLM's 64-bit integers (the digest's low 8 "
                             "bytes, big-endian) or as raw digests (default: %(default)s)")
    events.add_argument("--data-parallel-rank", type=non_negative_int, default=0, metavar="R",
                        help="this replica's rank among the engines behind one router; "
                             "stamped into every KV event batch and added to the port of the "
                             "KV event endpoints (ipc/inproc paths get a _dpR suffix), so "
                             "replicas on one host can be started with the same flags "
                             "(default: %(default)s)")
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


def engine_options(args: argparse.Namespace) -> dict:
    """The ``LLMEngine.from_options`` keywords the flags set (unset ones left out, so the
    engine's defaults apply)."""
    options = {
        "model": args.model,
        "enable_prefix_caching": args.enable_prefix_caching,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "hash_algo": args.prefix_caching_hash_algo,
        "eviction_policy": args.eviction_policy,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "seed": args.seed,
    }
    for flag, option in (("kv_cache_memory", "kv_cache_memory_bytes"),
                         ("max_num_seqs", "max_num_seqs"),
                         ("max_num_batched_tokens", "max_num_batched_tokens")):
        value = getattr(args, flag)
        if value is not None:
            options[option] = value
    return options


def kv_events_options(args: argparse.Namespace) -> dict:
    """The ``AsyncLLM.from_options`` keywords of the KV events flags."""
    return {
        "kv_events_endpoint": args.kv_events_endpoint,
        "kv_events_replay_endpoint": args.kv_events_replay_endpoint,
        "kv_events_topic": args.kv_events_topic,
        "kv_events_block_hash_format": args.kv_events_block_hash_format,
        "kv_events_data_parallel_rank": args.data_parallel_rank,
    }


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
        llm = AsyncLLM.from_options(**kv_events_options(args), **engine_options(args))
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
    logger.info("weights: %.1f MiB dense + %.1f MiB quantized decode copies (%s); KV cache: "
                "%d blocks of %d tokens", engine.dense_weight_bytes / 2**20,
                engine.decode_weight_bytes / 2**20, engine.quantization,
                engine.num_kv_blocks, engine.block_size)
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
