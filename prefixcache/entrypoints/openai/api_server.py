"""The FastAPI application: routes, authentication, body limits and error mapping.

Every route answers errors with OpenAI's error JSON (see ``errors``). Order of checks on a
generation request: body size (413) -> API key (401) -> JSON and fields (400) -> model name
(404) -> lengths against the model (400) -> the engine (400 if it refuses).

``/health`` and ``/metrics`` need no key (probes and scrapers); everything else does when
keys are configured. ``POST /reset_prefix_cache`` takes optional query flags ``wait`` and
``abort_running`` (``true``/``false``) with AsyncLLM's meanings and answers
``{"success": bool}``.

Once the engine has stopped (the server is shutting down, see ``uvicorn_server``, or the
engine failed), whatever needs it answers 503 ``engine_unavailable``: a request in flight
as soon as its stream learns it, a stream with an error event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixcache.engine.async_llm import AsyncLLM
from prefixcache.engine.errors import EngineDeadError
from prefixcache.entrypoints.openai.errors import (
    APIError,
    bad_request,
    error_body,
    error_json,
    error_response,
    from_validation_error,
)
from prefixcache.entrypoints.openai.metrics import ServerMetrics
from prefixcache.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from prefixcache.entrypoints.openai.serving import EventStream, ModelInfo, OpenAIServing
from prefixcache.entrypoints.openai.tenancy import Authenticator, AuthError, Principal

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Status logged (never sent: nobody is listening) when a client left before its answer.
CLIENT_CLOSED_REQUEST = 499


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(413, f"request body larger than {max_body_bytes} bytes")


class BodySizeLimitMiddleware:
    """Refuses bodies over ``max_body_bytes`` with 413: at once when ``Content-Length``
    says so, otherwise as soon as the streamed body passes the limit (chunked uploads),
    so an oversized body is never buffered whole."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_large = int(value) > limit
                except ValueError:
                    too_large = False  # the server rejects a malformed header itself
                if too_large:
                    await _send_json(send, 413, _too_large_body(limit))
                    return
        num_received = 0

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


def _too_large_body(limit: int) -> dict[str, Any]:
    return error_body(413, f"request body larger than {limit} bytes", code="body_too_large")


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = error_json(body).encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode("ascii"))]})
    await send({"type": "http.response.body", "body": payload})


class _ClosingStreamingResponse(StreamingResponse):
    """Calls ``on_close`` however the response ends, including a client that vanished
    before the body iterator even started (whose own ``finally`` then never runs)."""

    def __init__(self, event_stream: EventStream) -> None:
        super().__init__(event_stream.events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = event_stream.close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def _parse_body(raw_request: Request, model_cls: type[BaseModel]) -> Any:
    body = await raw_request.body()
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _query_flag(raw_request: Request, name: str) -> bool:
    value = raw_request.query_params.get(name)
    if value is None:
        return False
    lowered = value.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no", ""):
        return False
    raise bad_request(f"query parameter {name} must be true or false", param=name)


async def _wait_for_disconnect(raw_request: Request) -> None:
    # The body has been read, so the next message can only be the disconnect.
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_client_leaves(raw_request: Request, work: Any) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its
    engine requests) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # uvicorn gave up waiting for us: take the work along
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - the client is gone; there is no one to tell
        logger.debug("request failed after its client disconnected", exc_info=True)
    return None


def build_app(llm: AsyncLLM, tokenizer: Any, model_info: ModelInfo,
              authenticator: Authenticator | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The server's ASGI app over a running AsyncLLM (which the caller shuts down)."""
    authenticator = authenticator or Authenticator()
    metrics = ServerMetrics(llm.get_stats)
    serving = OpenAIServing(llm, tokenizer, model_info, metrics)
    app = FastAPI(title="prefixcache", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.metrics = metrics

    def authenticate(raw_request: Request) -> Principal:
        try:
            return authenticator.authenticate(raw_request.headers.get("authorization"))
        except AuthError as exc:
            raise APIError(401, str(exc), code="invalid_api_key") from exc

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc.status, exc.to_body())

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> Response:
        # The engine stopped: the server is shutting down, or the engine failed (logged).
        return error_response(503, error_body(503, str(exc), code="engine_unavailable"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        code = "body_too_large" if exc.status_code == 413 else None
        return error_response(exc.status_code,
                              error_body(exc.status_code, str(exc.detail), code=code),
                              headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error while serving a request")
        return error_response(500, error_body(500, f"internal error: {type(exc).__name__}"))

    async def generate(raw_request: Request, request_cls: type[BaseModel],
                       create: Any) -> Response:
        principal = authenticate(raw_request)
        request = await _parse_body(raw_request, request_cls)
        try:
            cache_salt = authenticator.engine_cache_salt(principal, request.cache_salt)
        except AuthError as exc:
            raise APIError(401, str(exc), code="invalid_api_key") from exc
        result = await _unless_client_leaves(raw_request, create(request, cache_salt))
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if isinstance(result, EventStream):
            return _ClosingStreamingResponse(result)
        return Response(result.model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        return await generate(raw_request, CompletionRequest, serving.create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        return await generate(raw_request, ChatCompletionRequest,
                              serving.create_chat_completion)

    @app.get("/v1/models")
    async def models(raw_request: Request) -> Response:
        authenticate(raw_request)
        created = int(time.time())
        cards = [ModelCard(id=name, created=created, root=model_info.root,
                           max_model_len=model_info.max_model_len)
                 for name in model_info.served_model_names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if llm.is_healthy:
            return Response(status_code=200)
        return error_response(503, error_body(503, "the engine is not running"))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw_request: Request) -> JSONResponse:
        authenticate(raw_request)
        wait = _query_flag(raw_request, "wait")
        abort_running = _query_flag(raw_request, "abort_running")
        success = await llm.reset_prefix_cache(wait=wait, abort_running=abort_running)
        return JSONResponse({"success": success})

    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    return app
