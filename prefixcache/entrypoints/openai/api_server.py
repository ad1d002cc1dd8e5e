"""The FastAPI application: routes, authentication, limits and error mapping.

Every route answers errors with OpenAI's error JSON (see ``errors``). Order of checks on a
generation request: the head's size and arrival time (431, 408: ``http_protocol``) ->
target length, header count, body size (414, 431, 413: ``limits``) -> API key (401) ->
body arrival time (408) -> JSON nesting depth, JSON and fields (400) -> tenant (403 for
the operator key) -> prompt text size (400) -> admission (429 past the tenant's limit,
503 while draining: ``admission``) -> model name (404) -> lengths against the model (400)
-> the engine (400 if it refuses).

``/health`` and ``/metrics`` need no key (probes and scrapers); everything else does when
keys are configured. ``POST /reset_prefix_cache`` is an operator endpoint (403 for others,
see ``tenancy``'s roles); it takes optional query flags ``wait``, ``abort_running`` and
``reset_kv_tier`` (``true``/``false``) with AsyncLLM's meanings and answers
``{"success": bool}``.
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``), vLLM's runtime adapter endpoints, are
operator endpoints too; they answer vLLM's plain-text success line, or 404 for an unknown
adapter or a missing folder, 400 for anything else wrong (see ``serving_models``).

A client that disconnects before its body has arrived is logged as one DEBUG line (no
traceback) and answered with nothing. While the server drains (``--shutdown-timeout``),
``/health`` answers 503 so load balancers stop sending requests.

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
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from prefixcache.engine.async_llm import AsyncLLM
from prefixcache.engine.errors import EngineDeadError
from prefixcache.entrypoints.openai.admission import Admission, TenantStats
from prefixcache.entrypoints.openai.errors import (
    APIError,
    bad_request,
    error_body,
    error_response,
    from_validation_error,
)
from prefixcache.entrypoints.openai.limits import (
    STATUS_TO_CODE,
    EdgeLimitsMiddleware,
    check_json_depth,
    check_prompt_bytes,
)
from prefixcache.entrypoints.openai.metrics import ServerMetrics
from prefixcache.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from prefixcache.entrypoints.openai.server_args import ServerArgs
from prefixcache.entrypoints.openai.serving import EventStream, ModelInfo, OpenAIServing
from prefixcache.entrypoints.openai.serving_models import ServedModels
from prefixcache.entrypoints.openai.tenancy import (
    Authenticator,
    AuthError,
    ForbiddenError,
    Principal,
)
from prefixcache.entrypoints.openai.worker_pool import TokenizerPool

logger = logging.getLogger(__name__)

# Status logged (never sent: nobody is listening) when a client left before its answer.
CLIENT_CLOSED_REQUEST = 499


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


async def _parse_body(raw_request: Request, model_cls: type[BaseModel],
                      max_json_depth: int) -> Any:
    body = await raw_request.body()
    check_json_depth(body, max_json_depth)
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
              server_args: ServerArgs | None = None,
              served_models: ServedModels | None = None) -> FastAPI:
    """The server's ASGI app over a running AsyncLLM (which the caller shuts down).
    ``served_models``: the base model's names and the LoRA adapters (default: the base
    model's names of ``model_info`` alone).

    ``app.state.admission`` is its admission gate (the shutdown drains it) and
    ``app.state.tokenizer_pool`` its worker pool (the caller may shut it down)."""
    authenticator = authenticator or Authenticator()
    server_args = server_args or ServerArgs()
    metrics = ServerMetrics(llm.get_stats)
    admission = Admission(authenticator.tenants, server_args.max_requests_per_tenant)
    metrics.add_stats(TenantStats, lambda: admission.tenant_to_stats, label="tenant")
    tokenizer_pool = TokenizerPool(server_args.tokenizer_pool_size)
    serving = OpenAIServing(llm, tokenizer, model_info, metrics, tokenizer_pool,
                            served_models)
    served_models = serving.served_models
    app = FastAPI(title="prefixcache", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.admission = admission
    app.state.tokenizer_pool = tokenizer_pool

    def authenticate(raw_request: Request) -> Principal:
        try:
            return authenticator.authenticate(raw_request.headers.get("authorization"))
        except AuthError as exc:
            raise APIError(401, str(exc), code="invalid_api_key") from exc

    def check_operator(principal: Principal) -> None:
        try:
            authenticator.check_operator(principal)
        except ForbiddenError as exc:
            raise APIError(403, str(exc), code="permission_denied") from exc

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc.status, exc.to_body(), headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(raw_request: Request, _: ClientDisconnect) -> Response:
        # Client-caused, not a server fault: one quiet line, and nobody to answer.
        logger.debug("client disconnected before sending its whole request: %s %s",
                     raw_request.method, raw_request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> Response:
        # The engine stopped: the server is shutting down, or the engine failed (logged).
        return error_response(503, error_body(503, str(exc), code="engine_unavailable"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        code = STATUS_TO_CODE.get(exc.status_code)
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
        request = await _parse_body(raw_request, request_cls, server_args.max_json_depth)
        try:
            cache_salt = authenticator.engine_cache_salt(principal, request.cache_salt)
        except ForbiddenError as exc:
            raise APIError(403, str(exc), code="permission_denied") from exc
        check_prompt_bytes(request, server_args.max_prompt_bytes)
        num_prompts = len(request.prompts()) if isinstance(request, CompletionRequest) else 1
        ticket = admission.admit(principal.tenant, num_prompts * request.n)
        try:
            result = await _unless_client_leaves(raw_request, create(request, cache_salt))
        except BaseException:
            ticket.release()
            raise
        if result is None:
            ticket.release()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if isinstance(result, EventStream):
            def close() -> None:
                try:
                    result.close()
                finally:
                    ticket.release()

            return _ClosingStreamingResponse(EventStream(result.events, close))
        ticket.release()
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
        cards = served_models.model_cards(int(time.time()))
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if admission.is_draining:
            return error_response(503, error_body(503, "the server is shutting down"))
        if llm.is_healthy:
            return Response(status_code=200)
        return error_response(503, error_body(503, "the engine is not running"))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw_request: Request) -> JSONResponse:
        check_operator(authenticate(raw_request))
        wait = _query_flag(raw_request, "wait")
        abort_running = _query_flag(raw_request, "abort_running")
        reset_kv_tier = _query_flag(raw_request, "reset_kv_tier")
        success = await llm.reset_prefix_cache(wait=wait, abort_running=abort_running,
                                               reset_kv_tier=reset_kv_tier)
        return JSONResponse({"success": success})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request) -> Response:
        check_operator(authenticate(raw_request))
        body = await _parse_body(raw_request, LoadLoRAAdapterRequest,
                                 server_args.max_json_depth)
        message = await served_models.load_lora_adapter(body.lora_name, body.lora_path,
                                                        body.load_inplace)
        return Response(message, media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request) -> Response:
        check_operator(authenticate(raw_request))
        body = await _parse_body(raw_request, UnloadLoRAAdapterRequest,
                                 server_args.max_json_depth)
        message = await served_models.unload_lora_adapter(body.lora_name)
        return Response(message, media_type="text/plain")

    app.add_middleware(EdgeLimitsMiddleware, server_args=server_args)
    return app
