"""The consumer side of AsyncLLM: a stream of one request group's outputs.

Delivered to by the engine loop thread through ``loop.call_soon_threadsafe``; read with
``async for`` on the event loop that created it. See :mod:`prefixcache.engine.async_llm`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from prefixcache.engine.errors import EngineDeadError
from prefixcache.engine.outputs import RequestOutput

__all__ = ["EngineDeadError", "OutputStream"]


class OutputStream:
    """Outputs of a group of engine requests, in the order the engine produced them.

    Iterate with ``async for``; iteration ends when every request of the group finished.
    Use as an async context manager (or call ``aclose``) so leaving early aborts what is
    still running. Raises EngineDeadError if the engine dies meanwhile.
    """

    def __init__(self, abort: Callable[[list[str]], None], request_ids: Sequence[str]) -> None:
        self._abort = abort  # asks the engine loop to abort these requests
        self.request_ids = list(request_ids)
        self._unfinished = set(self.request_ids)
        self._queue: asyncio.Queue[list[RequestOutput] | BaseException] = asyncio.Queue()
        self._pending: list[RequestOutput] = []

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._pending:
            if not self._unfinished:
                raise StopAsyncIteration
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            self._pending = item
        output = self._pending.pop(0)
        if output.finished:
            self._unfinished.discard(output.request_id)
        return output

    async def aclose(self) -> None:
        """Abort every request of the group that has not finished. Idempotent."""
        self.abort()

    def abort(self) -> None:
        """Synchronous ``aclose`` (safe in ``finally`` blocks of cancelled tasks)."""
        if self._unfinished:
            unfinished = list(self._unfinished)
            self._unfinished.clear()
            self._abort(unfinished)

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()

    # Called on the stream's event loop by the engine loop (call_soon_threadsafe).
    def _put(self, item: list[RequestOutput] | BaseException) -> None:
        self._queue.put_nowait(item)
