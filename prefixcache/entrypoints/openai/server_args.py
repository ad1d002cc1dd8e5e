"""The server's options, declared once: :class:`ServerArgs`.

Where it listens, who may call it (API keys, the operator key), its logs, the limits it
enforces at the edge, per-tenant admission, the tokenizer pool and the shutdown grace.
Each field declares its default, flags, check and help with
:func:`~prefixcache.engine.option_fields.option`, exactly as the engine's options
(:class:`~prefixcache.engine.arg_utils.EngineArgs`) are declared, so adding a server
option is adding a field here: ``prefixcache serve`` builds its flags with
:meth:`ServerArgs.add_cli_args` and reads them back with :meth:`ServerArgs.from_cli_args`;
``build_app`` and the uvicorn server take a ``ServerArgs``; tests build one directly with
small limits.

Sizes are in bytes, times in seconds. Flags are spelled as vLLM spells them where vLLM has
the option (``--h11-max-header-count``, ``--h11-max-incomplete-event-size``,
``--shutdown-timeout``, ``--uvicorn-log-level``).

Torch- and FastAPI-free: ``prefixcache serve`` imports this to build its parser.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from prefixcache.arg_types import (
    byte_size,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    size_text,
)
from prefixcache.engine.option_fields import (
    DeclaredOptions,
    is_int,
    is_non_blank_str,
    is_non_negative_number,
    is_positive_int,
    is_positive_number,
    is_str,
    option,
)
from prefixcache.lora.modules import lora_module
from prefixcache.lora.request import LoRARequest

LOG_LEVELS = ("debug", "info", "warning", "error")
LIMITS_GROUP = "limits, roles and shutdown (every refusal is an OpenAI-style error)"


def model_name(text: str) -> str:
    """A ``--served-model-name``: not empty nor blank (the usual result of an unset shell
    variable), which no client would mean to send."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"a model name must not be blank, got {text!r}")
    return text


def _is_port(value: Any) -> bool:
    return is_int(value) and 0 <= value <= 65535


def _are_model_names(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 \
        and all(map(is_non_blank_str, value))


def _are_lora_modules(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 \
        and all(isinstance(module, LoRARequest) for module in value)


def _size(default: int, *flags: str, help: str) -> Any:
    """A size option in bytes, given on the command line as ``64KiB``, ``16MiB``, ..."""
    return option(default, *flags, accepts=is_positive_int, wanted="a positive integer",
                  parse=byte_size, metavar="SIZE", default_text=size_text(default),
                  group=LIMITS_GROUP, help=help)


def _count(default: int | None, *flags: str, help: str, default_text: str | None = None,
           group: str | None = LIMITS_GROUP) -> Any:
    return option(default, *flags, accepts=is_positive_int, wanted="a positive integer",
                  parse=positive_int, metavar="N", default_text=default_text, group=group,
                  help=help)


def _seconds(default: float, *flags: str, help: str, may_be_zero: bool = False) -> Any:
    if may_be_zero:
        return option(default, *flags, accepts=is_non_negative_number,
                      wanted="a finite number >= 0", parse=non_negative_float, metavar="S",
                      group=LIMITS_GROUP, help=help)
    return option(default, *flags, accepts=is_positive_number, wanted="a finite number > 0",
                  parse=positive_float, metavar="S", group=LIMITS_GROUP, help=help)


@dataclass(frozen=True)
class ServerArgs(DeclaredOptions):
    """Options of the HTTP server in front of the engine (see the module docstring),
    checked once on construction (ValueError naming the option); frozen, so they stay
    checked.

    ``served_model_name`` None means the model argument's name; ``api_key`` requires one
    shared key, ``api_key_file`` (lines of ``key tenant``) tenants; ``admin_api_key`` (or
    the first line of ``admin_api_key_file``) is the operator key (see
    :mod:`~prefixcache.entrypoints.openai.tenancy`). ``max_requests_per_tenant`` None
    means no limit.
    """

    CLI_GROUP = "server"

    host: str = option(
        "127.0.0.1", "--host", accepts=is_non_blank_str, wanted="a host name or address",
        metavar="HOST", help="address to bind")
    port: int = option(
        8000, "--port", accepts=_is_port, wanted="a port in 0..65535", parse=port,
        metavar="PORT", help="port to bind; 0 picks a free one")
    served_model_name: list[str] | None = option(
        None, "--served-model-name", nargs="+", accepts=_are_model_names,
        wanted="a list of non-blank names", parse=model_name, metavar="NAME",
        default_text="the model argument",
        help="model name(s) clients use; the first is reported, a repeated one is served "
             "once")
    api_key: str | None = option(
        None, "--api-key", accepts=is_non_blank_str, wanted="a non-blank key",
        metavar="KEY", help="require this key (Authorization: Bearer KEY); no tenants")
    api_key_file: str | None = option(
        None, "--api-key-file", accepts=is_str, wanted="a path", metavar="FILE",
        help="lines of 'key tenant': require a listed key and isolate each tenant's "
             "prefix cache")
    log_level: str = option(
        "info", "--log-level", choices=LOG_LEVELS,
        help="prefixcache's own logs: the ready line, engine failures")
    uvicorn_log_level: str = option(
        "warning", "--uvicorn-log-level", choices=LOG_LEVELS,
        help="uvicorn's own logs, access log included at info")
    lora_modules: list[LoRARequest] | None = option(
        None, "--lora-modules", nargs="+", accepts=_are_lora_modules,
        wanted="a list of LoRARequest", parse=lora_module, metavar="NAME=PATH",
        default_text="none",
        help="LoRA adapters (PEFT folders) to serve from the start, each as NAME=PATH or "
             "JSON {\"name\": ..., \"path\": ...}; clients ask for one by its NAME as the "
             "model; implies --enable-lora")

    admin_api_key: str | None = option(
        None, "--admin-api-key", accepts=is_non_blank_str, wanted="a non-blank key",
        metavar="KEY", default_text="none", group=LIMITS_GROUP,
        help="operator key (Authorization: Bearer KEY) for /reset_prefix_cache and every "
             "other operator endpoint; with it set, no other key may call them; with "
             "tenants (--api-key-file) and no admin key, nobody may (403)")
    admin_api_key_file: str | None = option(
        None, "--admin-api-key-file", accepts=is_str, wanted="a path", metavar="FILE",
        default_text="none", group=LIMITS_GROUP,
        help="read the operator key from the first non-blank line of FILE, so it stays "
             "out of the process list")
    max_request_body_bytes: int = _size(
        16 * 1024 * 1024, "--max-request-body-bytes", help="larger bodies get 413")
    h11_max_incomplete_event_size: int = _size(
        64 * 1024, "--h11-max-incomplete-event-size",
        help="most bytes a request head (request line and headers) may take, however it "
             "arrives; a larger one gets 431 and the connection is closed")
    h11_max_header_count: int = _count(
        256, "--h11-max-header-count", help="most header lines a request may carry; more "
        "get 431")
    max_url_length: int = _size(
        8 * 1024, "--max-url-length",
        help="most bytes of a request's target (path and query); longer gets 414")
    request_head_timeout: float = _seconds(
        10.0, "--request-head-timeout",
        help="seconds a connection may take to send a whole request head, counted from "
             "its opening or from its previous response; then it gets 408 (or, if it sent "
             "nothing, is closed)")
    request_body_timeout: float = _seconds(
        60.0, "--request-body-timeout",
        help="seconds a request may take to send its whole body once its head arrived; "
             "then it gets 408 and the connection is closed")
    max_json_depth: int = _count(
        64, "--max-json-depth", help="most levels of nested JSON arrays and objects in a "
        "request body; deeper gets 400")
    max_prompt_bytes: int = _size(
        1024 * 1024, "--max-prompt-bytes",
        help="most UTF-8 bytes of prompt text (all prompts, or all message texts) in one "
             "request, checked before tokenizing; more gets 400")
    tokenizer_pool_size: int = _count(
        2, "--tokenizer-pool-size", help="threads that tokenize and render chat templates "
        "of large inputs, so the server keeps answering others meanwhile")
    max_requests_per_tenant: int | None = _count(
        None, "--max-requests-per-tenant", default_text="no limit",
        help="most engine requests (prompts x n, running or waiting) one tenant may have "
             "at once; past it, 429 with Retry-After")
    shutdown_timeout: float = _seconds(
        0.0, "--shutdown-timeout", may_be_zero=True,
        help="on SIGTERM, stop admitting requests and let running ones finish for up to "
             "this many seconds before aborting them; 0 aborts at once. Ctrl-C always "
             "aborts at once")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("use either --api-key (one shared key) or --api-key-file "
                             "(tenants)")
        if self.admin_api_key is not None and self.admin_api_key_file is not None:
            raise ValueError("use either --admin-api-key or --admin-api-key-file")
