"""The server's protective options, declared once: limits at the edge, time limits,
the operator credential, per-tenant admission, the tokenizer pool and the shutdown grace.

:class:`ServerArgs` is the single declaration: each field carries its default, its flag
and its help; :meth:`ServerArgs.add_cli_args` adds them to ``prefixcache serve`` and
:meth:`ServerArgs.from_cli_args` reads them back, validated once. ``build_app`` and the
uvicorn server take a ``ServerArgs``; tests build one directly with small limits.

Flags are spelled as vLLM spells them where vLLM has the option (``--h11-max-header-count``,
``--h11-max-incomplete-event-size``, ``--shutdown-timeout``).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from prefixcache.arg_types import (
    byte_size,
    non_negative_float,
    positive_float,
    positive_int,
    size_text,
)


def _option(default: Any, help: str, *, type: Any = None, metavar: str | None = None,
            flag: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "type": type, "metavar": metavar,
                                            "flag": flag})


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """Options of the HTTP server in front of the engine (see the module docstring).

    Sizes are in bytes, times in seconds. ``None`` means "no limit" where the help says so.
    """

    admin_api_key: str | None = _option(
        None, "operator key (Authorization: Bearer KEY) for /reset_prefix_cache and every "
        "other operator endpoint; with it set, no other key may call them; with tenants "
        "(--api-key-file) and no admin key, nobody may (403)", metavar="KEY")
    admin_api_key_file: str | None = _option(
        None, "read the operator key from the first non-blank line of FILE, so it stays "
        "out of the process list", metavar="FILE")
    max_request_body_bytes: int = _option(
        16 * 1024 * 1024, "larger bodies get 413", type=byte_size, metavar="SIZE")
    h11_max_incomplete_event_size: int = _option(
        64 * 1024, "most bytes a request head (request line and headers) may take, "
        "however it arrives; a larger one gets 431 and the connection is closed",
        type=byte_size, metavar="SIZE")
    h11_max_header_count: int = _option(
        256, "most header lines a request may carry; more get 431", type=positive_int,
        metavar="N")
    max_url_length: int = _option(
        8 * 1024, "most bytes of a request's target (path and query); longer gets 414",
        type=byte_size, metavar="SIZE")
    request_head_timeout: float = _option(
        10.0, "seconds a connection may take to send a whole request head, counted from "
        "its opening or from its previous response; then it gets 408 (or, if it sent "
        "nothing, is closed)", type=positive_float, metavar="S")
    request_body_timeout: float = _option(
        60.0, "seconds a request may take to send its whole body once its head arrived; "
        "then it gets 408 and the connection is closed", type=positive_float, metavar="S")
    max_json_depth: int = _option(
        64, "most levels of nested JSON arrays and objects in a request body; deeper gets "
        "400", type=positive_int, metavar="N")
    max_prompt_bytes: int = _option(
        1024 * 1024, "most UTF-8 bytes of prompt text (all prompts, or all message "
        "texts) in one request, checked before tokenizing; more gets 400",
        type=byte_size, metavar="SIZE")
    tokenizer_pool_size: int = _option(
        2, "threads that tokenize and render chat templates of large inputs, so the "
        "server keeps answering others meanwhile", type=positive_int, metavar="N")
    max_requests_per_tenant: int | None = _option(
        None, "most engine requests (prompts x n, running or waiting) one tenant may have "
        "at once; past it, 429 with Retry-After (default: no limit)",
        type=positive_int, metavar="N")
    shutdown_timeout: float = _option(
        0.0, "on SIGTERM, stop admitting requests and let running ones finish for up to "
        "this many seconds before aborting them; 0 aborts at once. Ctrl-C always aborts "
        "at once", type=non_negative_float, metavar="S")

    @classmethod
    def add_cli_args(cls, group: Any) -> None:
        """Add every option to ``group`` (an argparse parser or argument group)."""
        for option in fields(cls):
            meta = option.metadata
            flag = meta["flag"] or "--" + option.name.replace("_", "-")
            shown = option.default
            if meta["type"] is byte_size and isinstance(shown, int):
                shown = size_text(shown)
            default_note = "" if "default:" in meta["help"] \
                else f" (default: {'none' if shown is None else shown})"
            group.add_argument(flag, dest=option.name, type=meta["type"],
                               default=option.default, metavar=meta["metavar"],
                               help=meta["help"].replace("%", "%%") + default_note)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """The options parsed by a parser that ``add_cli_args`` set up; ValueError for an
        admin key file that cannot be read."""
        values = {option.name: getattr(args, option.name) for option in fields(cls)}
        server_args = cls(**values)
        server_args.validate()
        return server_args

    def validate(self) -> None:
        """Raise ValueError for contradicting options."""
        if self.admin_api_key is not None and self.admin_api_key_file is not None:
            raise ValueError("use either --admin-api-key or --admin-api-key-file")
        if self.admin_api_key is not None and not self.admin_api_key.strip():
            raise ValueError("--admin-api-key must not be blank")
        for option in fields(self):
            if option.default is not MISSING and option.metadata["type"] is positive_int:
                value = getattr(self, option.name)
                if value is not None and value < 1:
                    raise ValueError(f"{option.name} must be at least 1, got {value}")

