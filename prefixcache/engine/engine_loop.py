"""The engine loop: the one thread that touches the engine, and the half of
:class:`~prefixcache.engine.async_llm.AsyncLLM` that runs on it.

AsyncLLM's callers put commands (:mod:`prefixcache.engine.engine_commands`) on one
thread-safe queue; this loop takes them, applies them to the engine, steps it and answers
each caller through its own asyncio event loop (``loop.call_soon_threadsafe``). The
contracts it keeps are AsyncLLM's, stated in :mod:`prefixcache.engine.async_llm`.

Loop iteration::

    take commands (block only when the engine is idle) -> apply them in arrival order
    -> engine.step() if there is work -> publish the step's KV events and wait (bounded)
    until they are on the wire -> refresh the stats snapshot -> deliver outputs, grouped
    per stream
    -> admit the adds held back, if nothing holds them any more
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixcache.engine.engine_commands import Abort, Add, Call, Reset, Shutdown
from prefixcache.engine.errors import EngineDeadError, InvalidRequestError
from prefixcache.engine.output_stream import OutputStream
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.stats import EngineStats

if TYPE_CHECKING:
    from prefixcache.events.publisher import EventPublisher

logger = logging.getLogger(__name__)

# How long an idle engine loop sleeps on the command queue before re-checking its state.
# Commands wake it at once; this only bounds how stale an idle loop's view can get.
_IDLE_WAIT_S = 0.5

SHUTDOWN_REASON = "the server is shutting down"
# Longest wait for a step's KV events to be sent before its outputs are delivered anyway.
_EVENTS_SENT_TIMEOUT_S = 0.5


@dataclass(slots=True)
class _Tracked:
    """Engine-loop side: where the outputs of one engine request go, from its add until
    the engine reports its final output. ``is_aborted``: aborted here, the engine's
    final output (the next step's) is still to come and is the only one delivered."""

    stream: OutputStream
    loop: asyncio.AbstractEventLoop
    is_aborted: bool = False


class EngineLoop:
    """The engine loop's state, and the methods only the engine loop's thread runs
    (``_run`` is its target). :class:`~prefixcache.engine.async_llm.AsyncLLM`, the
    subclass, starts that thread and is the only way in: it puts commands on
    ``_commands``."""

    def __init__(self, engine: Any, event_publisher: EventPublisher | None) -> None:
        self.engine = engine
        self.event_publisher = event_publisher
        # Shutdown may close the publisher while a slow step is still running (its join
        # timed out); the lock and flag keep that step from publishing into it.
        self._publish_lock = threading.Lock()
        self._publisher_closed = False
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._request_id_to_tracked: dict[str, _Tracked] = {}
        # Resets waiting for the running requests to finish (wait=True).
        self._reset_waiters: list[Reset] = []
        # Adds not yet applied, in arrival order: behind a waiting reset, or reusing an
        # id whose aborted request the engine has not yet reported finished.
        self._held_adds: list[Add] = []
        self._stats: EngineStats = copy.copy(engine.get_stats())
        self._dead_reason: str | None = None
        # Set by the loop before its last drain of the queue; a command put after that
        # must be answered by whoever put it.
        self._has_stopped_taking_commands = False
        self.num_steps = 0

    def _run(self) -> None:
        try:
            while True:
                if not self._take_and_apply_commands():
                    self._fail_all(EngineDeadError(SHUTDOWN_REASON))
                    return
                outputs = []
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self.num_steps += 1
                self._maybe_finish_pending_reset()
                self._publish_events()
                # Stats before delivery: a client that has its answer sees it counted.
                self._stats = copy.copy(self.engine.get_stats())
                self._deliver(outputs)
                # After delivery: an id that finished in this step is free only now.
                self._admit_held_adds()
        except BaseException as exc:  # the engine is in an unknown state: stop serving
            logger.exception("engine loop failed; the server stops serving requests")
            self._dead_reason = f"engine failed: {type(exc).__name__}: {exc}"
            self._fail_all(EngineDeadError(self._dead_reason))

    def _take_and_apply_commands(self) -> bool:
        """Apply every queued command; False on shutdown. Blocks only when idle."""
        commands = []
        idle = not self.engine.has_unfinished_requests()
        try:
            if idle:
                commands.append(self._commands.get(timeout=_IDLE_WAIT_S))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        for index, command in enumerate(commands):
            if isinstance(command, Add):
                self._admit(command)
            elif isinstance(command, Abort):
                self._apply_abort(command.request_ids, command.stream)
            elif isinstance(command, Reset):
                self._apply_reset(command)
            elif isinstance(command, Call):
                try:
                    result = command.function(self.engine)
                except Exception as exc:  # noqa: BLE001 - the caller's to handle
                    _resolve(command.loop, command.done, exception=exc)
                else:
                    _resolve(command.loop, command.done, result=result)
            elif isinstance(command, Shutdown):
                # Already taken off the queue, so the final drain would never see them.
                _refuse(commands[index + 1:], EngineDeadError(SHUTDOWN_REASON))
                return False
        return True

    def _admit(self, command: Add) -> None:
        """Apply an add now, or hold it back (see ``_held_adds``) behind a waiting reset,
        an earlier held add, or an aborted request of one of its ids that the engine has
        not yet reported finished (the engine would refuse the id)."""
        tracked = self._request_id_to_tracked
        if (self._reset_waiters or self._held_adds
                or any(request.request_id in tracked and tracked[request.request_id].is_aborted
                       for request in command.requests)):
            self._held_adds.append(command)
        else:
            self._apply_add(command)

    def _admit_held_adds(self) -> None:
        held, self._held_adds = self._held_adds, []
        for command in held:  # in arrival order; what is still held stays in order
            self._admit(command)

    def _apply_add(self, command: Add) -> None:
        added: list[str] = []
        try:
            for request in command.requests:
                self.engine.add_request(request.request_id, request.prompt_token_ids,
                                        request.sampling_params, cache_salt=request.cache_salt,
                                        arrival_time=request.arrival_time or time.time(),
                                        lora_request=request.lora_request)
                added.append(request.request_id)
                self._request_id_to_tracked[request.request_id] = _Tracked(
                    command.stream, command.loop)
        except (ValueError, TypeError) as exc:
            # Their final outputs go to this stream, which nobody will read.
            self._apply_abort(added, command.stream)
            refusal = exc if isinstance(exc, InvalidRequestError) else ValueError(str(exc))
            _resolve(command.loop, command.done, exception=refusal)
            return
        _resolve(command.loop, command.done, result=None)

    def _apply_abort(self, request_ids: list[str], stream: OutputStream | None) -> None:
        """Abort the live requests among ``request_ids`` (only ``stream``'s, unless None);
        their streams get the engine's final outputs with the next step."""
        request_id_to_tracked = self._request_id_to_tracked
        live = []
        for request_id in request_ids:
            tracked = request_id_to_tracked.get(request_id)
            if tracked is None or tracked.is_aborted:
                continue
            if stream is not None and tracked.stream is not stream:
                continue
            tracked.is_aborted = True
            live.append(request_id)
        if live:
            self.engine.abort_request(live)
        if stream is not None and self._held_adds:
            # Only the cancelled add_requests call itself can abort a stream it has not
            # yet returned: drop its add before it ever reaches the engine.
            for add in self._held_adds:
                if add.stream is stream:
                    _call(add.loop, add.done.cancel)
            self._held_adds = [add for add in self._held_adds if add.stream is not stream]

    def _apply_reset(self, command: Reset) -> None:
        if command.abort_running:
            self._apply_abort(list(self._request_id_to_tracked), None)
        if command.wait and self.engine.has_unfinished_requests():
            self._reset_waiters.append(command)  # one reset serves everyone waiting
            return
        success = bool(self.engine.reset_prefix_cache(command.reset_kv_tier))
        _resolve(command.loop, command.done, result=success)

    def _maybe_finish_pending_reset(self) -> None:
        # The adds it held back are admitted after this step's outputs are delivered.
        if not self._reset_waiters or self.engine.has_unfinished_requests():
            return
        waiters, self._reset_waiters = self._reset_waiters, []
        success = bool(self.engine.reset_prefix_cache(
            any(waiter.reset_kv_tier for waiter in waiters)))
        for waiter in waiters:
            _resolve(waiter.loop, waiter.done, result=success)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One call_soon_threadsafe per stream per step, not per output: fewer wake-ups.
        stream_to_batch: dict[int, tuple[_Tracked, list[RequestOutput]]] = {}
        request_id_to_tracked = self._request_id_to_tracked
        for output in outputs:
            tracked = request_id_to_tracked.get(output.request_id)
            if tracked is None:  # not an id this loop added; nobody to tell
                continue
            if output.finished:
                del request_id_to_tracked[output.request_id]
            elif tracked.is_aborted:  # only the engine's final output ends an abort
                continue
            key = id(tracked.stream)
            if key not in stream_to_batch:
                stream_to_batch[key] = (tracked, [])
            stream_to_batch[key][1].append(output)
        for tracked, batch in stream_to_batch.values():
            _call(tracked.loop, tracked.stream._put, batch)

    def _publish_events(self) -> None:
        if self.event_publisher is None:
            return
        events = self.engine.take_kv_events()
        if events:
            with self._publish_lock:
                if self._publisher_closed:
                    return
                self.event_publisher.publish(events)
            self.event_publisher.wait_until_sent(_EVENTS_SENT_TIMEOUT_S)

    def _fail_all(self, error: BaseException) -> None:
        self._has_stopped_taking_commands = True  # before the drain below: see _put_command
        for tracked in self._request_id_to_tracked.values():
            _call(tracked.loop, tracked.stream._put, error)
        self._request_id_to_tracked.clear()
        waiters, self._reset_waiters = self._reset_waiters, []
        held, self._held_adds = self._held_adds, []
        _refuse([*waiters, *held], error)
        self._drain_commands(error)

    def _drain_commands(self, error: BaseException) -> None:
        # Commands queued after the loop stopped would otherwise wait forever.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            _refuse([command], error)


def _refuse(commands: Sequence[Any], error: BaseException) -> None:
    """Answer every add, reset and call among ``commands`` with ``error``; aborts need no
    answer."""
    for command in commands:
        if isinstance(command, (Add, Reset, Call)):
            _resolve(command.loop, command.done, exception=error)


def _call(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    # A closed event loop raises RuntimeError: nobody is listening there any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, *,
             result: Any = None, exception: BaseException | None = None) -> None:
    def settle() -> None:
        if future.done():  # the waiter was cancelled
            return
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)

    _call(loop, settle)
