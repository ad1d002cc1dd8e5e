"""Limits at the edge, checked before a route does any work: the request target's length
(414), the number of header lines (431), the body's size (413) and the time it takes to
arrive (408), then — once the body is read — its JSON nesting depth and its prompt text's
size (400).

The head's size in bytes and the time to receive it are enforced by the HTTP protocol
itself (:mod:`~prefixcache.entrypoints.openai.http_protocol`), before any of this runs.
Every answer here is OpenAI's error JSON (:mod:`~prefixcache.entrypoints.openai.errors`);
those sent before the body was read carry ``Connection: close``, since the connection may
still hold body bytes nobody will read.
"""

from __future__ import annotations

import asyncio
import re
from itertools import accumulate
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixcache.entrypoints.openai.errors import bad_request, error_body, error_json
from prefixcache.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from prefixcache.entrypoints.openai.server_args import ServerArgs

_CLOSE = {"Connection": "close"}


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(413, f"request body larger than {max_body_bytes} bytes",
                         headers=_CLOSE)


class BodyTimeout(StarletteHTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} "
                         "seconds", headers=_CLOSE)


# The error code of each status the edge answers, for the server's HTTP error handler.
STATUS_TO_CODE = {408: "request_timeout", 413: "body_too_large", 414: "url_too_long",
                  431: "headers_too_large"}


class EdgeLimitsMiddleware:
    """Refuses, before the app sees it: a target longer than ``max_url_length`` (414),
    more than ``h11_max_header_count`` header lines (431), a body over
    ``max_request_body_bytes`` (413: at once when ``Content-Length`` says so, otherwise as
    soon as the streamed body passes the limit, so an oversized body is never buffered
    whole), and a body still incomplete ``request_body_timeout`` seconds after the head
    arrived (408, raised from the app's ``receive``).

    The body's time limit applies only until the body's last message: the route's later
    wait for a disconnect is not limited.
    """

    def __init__(self, app: ASGIApp, server_args: ServerArgs) -> None:
        self.app = app
        self.args = server_args

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        args = self.args
        target_length = len(scope.get("raw_path") or b"") + len(scope.get("query_string", b""))
        if target_length > args.max_url_length:
            await send_error(send, 414, f"the request target is longer than "
                             f"{args.max_url_length} bytes")
            return
        headers = scope.get("headers", ())
        if len(headers) > args.h11_max_header_count:
            await send_error(send, 431, f"the request has more than "
                             f"{args.h11_max_header_count} header lines")
            return
        limit = args.max_request_body_bytes
        for name, value in headers:
            if name == b"content-length":
                try:
                    too_large = int(value) > limit
                except ValueError:
                    too_large = False  # the server rejects a malformed header itself
                if too_large:
                    await send_error(send, 413, f"request body larger than {limit} bytes")
                    return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.request_body_timeout
        num_received = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal num_received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                raise BodyTimeout(args.request_body_timeout) from None
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, limited_receive, send)


async def send_error(send: Send, status: int, message: str) -> None:
    """Answer with OpenAI's error JSON and close the connection afterwards."""
    payload = error_json(error_body(status, message, code=STATUS_TO_CODE.get(status))) \
        .encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode("ascii")),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


# A JSON string, escapes included, unrolled so runs of plain characters match in one go.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_BRACKET_TO_STEP = [0] * 256
for _open in b"[{":
    _BRACKET_TO_STEP[_open] = 1
for _close in b"]}":
    _BRACKET_TO_STEP[_close] = -1


def json_nesting_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``body`` (0 for a
    scalar), counted without parsing it, so a body too deep to parse is measured too.
    Brackets inside strings do not count. For malformed JSON the figure is approximate,
    which is enough: the parser refuses it anyway."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return max(0, max(accumulate(map(_BRACKET_TO_STEP.__getitem__, brackets))))


def check_json_depth(body: bytes, max_depth: int) -> None:
    """Raise a 400 APIError if ``body`` nests arrays and objects deeper than
    ``max_depth``."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return  # cannot be deeper: the common case costs two counts
    depth = json_nesting_depth(body)
    if depth > max_depth:
        raise bad_request(f"the body nests JSON arrays and objects {depth} levels deep; "
                          f"at most {max_depth} are allowed", code="json_too_deep")


def check_prompt_bytes(request: Any, max_prompt_bytes: int) -> None:
    """Raise a 400 APIError if the prompt text of ``request`` (a completion's text prompts,
    or a chat's message texts, summed) is over ``max_prompt_bytes`` UTF-8 bytes; token-id
    prompts are bounded by the body's size alone."""
    if isinstance(request, CompletionRequest):
        texts = [p for p in request.prompts() if isinstance(p, str)]
        param = "prompt"
    elif isinstance(request, ChatCompletionRequest):
        texts = [m["content"] for m in request.chat_messages()]
        param = "messages"
    else:
        return
    if 4 * sum(map(len, texts)) <= max_prompt_bytes:
        return  # a character is at most 4 bytes: no need to encode anything
    num_bytes = 0
    for text in texts:
        num_bytes += len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > max_prompt_bytes:
            raise bad_request(f"the prompt text is larger than {max_prompt_bytes} bytes "
                              f"(--max-prompt-bytes)", param=param, code="prompt_too_large")
