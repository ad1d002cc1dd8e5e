"""uvicorn's server with what ``prefixcache serve`` adds: the "ready" line, and a shutdown
that drains, then stops the engine before uvicorn's own shutdown, so in-flight requests end
cleanly.

The shutdown, in order (:meth:`UvicornServer.shutdown`):

1. stop accepting connections, and admit no more requests (503; ``/health`` answers 503
   so load balancers move on);
2. on SIGTERM with ``shutdown_timeout_s`` > 0 (``--shutdown-timeout``), wait up to that
   long for the requests admitted so far to finish by themselves. Ctrl-C skips this, and a
   second signal during the wait cuts it short;
3. stop the engine (below): whatever still runs ends with an error and frees its blocks;
4. uvicorn's own shutdown: its ``timeout_graceful_shutdown`` bounds only the delivery of
   those last answers. Its clock starts after the engine has stopped, so an engine step
   longer than that grace is waited for, never cancelled mid-step.

Why the engine goes before uvicorn's shutdown: uvicorn waits up to
``timeout_graceful_shutdown`` for the requests in flight, then cancels them mid-response
(a CancelledError traceback in the log, a plain-text 500 to the client), and only then
runs the app's lifespan shutdown. A generation may run for minutes, so that wait is no use
and the lifespan comes too late. Instead :meth:`AsyncLLM.shutdown` stops the engine loop
(after its current step), which hands every live output stream
EngineDeadError("the server is shutting down"). The routes already answer that as an
error: a non-streaming request gets an OpenAI-style 503, a stream gets an error event and
``data: [DONE]``; requests arriving meanwhile get the 503 too. The connections then close
by themselves, well inside uvicorn's graceful timeout.

The process's exit status is uvicorn's, unchanged: it re-raises the signal it caught, so
Ctrl-C ends in KeyboardInterrupt (the CLI's 130) and SIGTERM in death by SIGTERM (143).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from types import FrameType
from typing import Any

import uvicorn

from prefixcache.engine.async_llm import AsyncLLM
from prefixcache.entrypoints.openai.admission import Admission
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

    Its shutdown drains ``admission`` and shuts ``llm`` down before waiting for
    connections (see the module docstring); the caller may call ``llm.shutdown()`` again
    afterwards (it is then a no-op), and must when the server never started.
    """

    def __init__(self, config: uvicorn.Config, model_info: ModelInfo, llm: AsyncLLM,
                 admission: Admission | None = None, shutdown_timeout_s: float = 0.0) -> None:
        super().__init__(config)
        self._model_info = model_info
        self._llm = llm
        self._admission = admission
        self._shutdown_timeout_s = shutdown_timeout_s
        self._exit_signals: list[int] = []
        self._hurry: asyncio.Event | None = None  # set by a signal during the shutdown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._exit_signals.append(sig)
        if len(self._exit_signals) > 1 and self._hurry is not None:
            self._hurry.set()
        super().handle_exit(sig, frame)

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
        self._hurry = asyncio.Event()
        if len(self._exit_signals) > 1:
            self._hurry.set()
        for server in self.servers:  # uvicorn closes them again later: harmless
            server.close()
        admission = self._admission
        if admission is not None:
            admission.start_draining()
            if self._shutdown_timeout_s > 0 and self._exit_signals[:1] == [signal.SIGTERM]:
                ready_logger.info("draining: waiting up to %gs for %d request(s) in flight",
                                  self._shutdown_timeout_s, admission.num_tickets)
                drained = await self._unless_hurried(
                    admission.wait_idle(self._shutdown_timeout_s))
                if not drained:
                    ready_logger.info("drain ended with %d request(s) still in flight; "
                                      "aborting them", admission.num_tickets)
        await self._unless_hurried(_in_daemon_thread(self._llm.shutdown, None))
        await super().shutdown(sockets)

    async def _unless_hurried(self, work: Any) -> Any:
        """Await ``work``, or stop waiting (returning False) once another signal came."""
        task = asyncio.ensure_future(work)
        hurry = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait({task, hurry}, return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return False


def _in_daemon_thread(work: Any, *args: Any) -> asyncio.Future:
    """``work(*args)`` in a daemon thread, as a future of this loop.

    AsyncLLM.shutdown joins the engine loop, which first finishes its current step however
    long it takes, and the event loop must keep serving meanwhile. A daemon thread, unlike
    ``asyncio.to_thread``'s, does not hold the process's exit when a second signal made us
    stop waiting for it."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def target() -> None:
        try:
            work(*args)
            error = None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=target, name="engine-shutdown", daemon=True).start()
    return done
