"""uvicorn's server with what ``prefixcache serve`` adds: the "ready" line, and a shutdown
that stops the engine first so in-flight requests end at once and cleanly.

Why the engine goes first: on Ctrl-C or SIGTERM uvicorn stops accepting connections,
waits up to ``timeout_graceful_shutdown`` for the requests in flight, then cancels them
mid-response (a CancelledError traceback in the log, a plain-text 500 to the client), and
only then runs the app's lifespan shutdown. A generation may run for minutes, so waiting
is no use and the lifespan comes too late. Instead, the moment uvicorn's shutdown starts,
:meth:`AsyncLLM.shutdown` stops the engine loop (after its current step), which hands
every live output stream EngineDeadError("the server is shutting down"). The routes
already answer that as an error: a non-streaming request gets an OpenAI-style 503, a
stream gets an error event and ``data: [DONE]``; requests arriving meanwhile get the 503
too. The connections then close by themselves, well inside the graceful timeout, which
remains only as a bound for a stuck engine step.

The process's exit status is uvicorn's, unchanged: it re-raises the signal it caught, so
Ctrl-C ends in KeyboardInterrupt (the CLI's 130) and SIGTERM in death by SIGTERM (143).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn

from prefixcache.engine.async_llm import AsyncLLM
from prefixcache.entrypoints.openai.serving import ModelInfo

ready_logger = logging.getLogger("prefixcache.serve")
uvicorn_logger = logging.getLogger("uvicorn.error")  # where uvicorn logs its own startup


class UvicornServer(uvicorn.Server):
    """uvicorn's server over the app of ``build_app(llm, ...)``.

    Logs the one "ready" line once the app serves, naming the real port (so ``--port 0``
    is usable: readers take the URL from it). Works the same whether uvicorn binds
    ``config.host``/``config.port`` itself or is handed listening sockets
    (``run(sockets=...)``, as ``prefixcache serve`` does); the line always names the first
    socket actually serving.

    Its shutdown shuts ``llm`` down before waiting for connections (see the module
    docstring); the caller may call ``llm.shutdown()`` again afterwards (it is then a
    no-op), and must when the server never started.
    """

    def __init__(self, config: uvicorn.Config, model_info: ModelInfo, llm: AsyncLLM) -> None:
        super().__init__(config)
        self._model_info = model_info
        self._llm = llm

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        if sockets is not None:
            # uvicorn logs this itself only when it binds (with sockets it assumes a
            # parent process already did); --uvicorn-log-level info still shows it.
            uvicorn_host = self.config.host or "0.0.0.0"
            shown = f"[{uvicorn_host}]" if ":" in uvicorn_host else uvicorn_host
            uvicorn_logger.info("Uvicorn running on %s://%s:%d (Press CTRL+C to quit)",
                                "https" if self.config.ssl else "http", shown, port)
        shown_host = f"[{host}]" if ":" in host else host
        info = self._model_info
        publisher = self._llm.event_publisher
        endpoint = getattr(publisher, "endpoint", None)
        replay_endpoint = getattr(publisher, "replay_endpoint", None)
        events_note = f", KV events on {endpoint}" if endpoint else ""
        if replay_endpoint:
            events_note += f", replay on {replay_endpoint}"
        ready_logger.info("ready: serving %s at http://%s:%d (%d KV blocks of %d tokens%s)",
                          info.served_model_names[0], shown_host, port, info.num_kv_blocks,
                          info.block_size, events_note)

    async def shutdown(self, sockets: Any = None) -> None:
        # In a thread: AsyncLLM.shutdown joins the engine loop, which first finishes its
        # current step, and the event loop must keep serving the answers meanwhile.
        engine_stopped = asyncio.ensure_future(asyncio.to_thread(self._llm.shutdown))
        try:
            await super().shutdown(sockets)
        finally:
            await engine_stopped
