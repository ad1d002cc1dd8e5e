"""AsyncLLM: the synchronous engine behind an asyncio front end, for the server.

The engine is not thread-safe, so exactly one thread touches it: the *engine loop*, a
daemon thread that owns it. Everything else talks to that thread through one thread-safe
command queue (add, abort, reset, shutdown) and hears back through the asyncio event loop
of whoever asked (``loop.call_soon_threadsafe``). Requests from every client therefore meet
in one engine and are batched by its scheduler.

Loop iteration::

    take commands (block only when the engine is idle) -> apply them in arrival order
    -> engine.step() if there is work -> publish the step's KV events
    -> refresh the stats snapshot -> deliver outputs, grouped per stream
    -> admit the adds held back, if nothing holds them any more

Contracts:

* An :class:`OutputStream` carries the outputs of the engine requests added together (the
  ``n`` choices of one prompt, or a batch of prompts) and ends once all of them finished.
  Leaving it early (``aclose``, ``async with``, cancellation, a client disconnect) aborts
  the unfinished ones, so their KV blocks are freed.
* ``add_requests`` returns only once the engine accepted every request, so the engine's
  :class:`~prefixcache.engine.errors.InvalidRequestError` (a bad prompt, bad sampling
  params) reaches the caller as raised, before it commits to a response. A partial batch
  is never left running.
* An aborted request's stream ends with the engine's own final output for it, which the
  engine's next step reports: ``finish_reason="abort"``, with the cumulative text and
  tokens so far (text held back for a possible stop string included). Nothing else the
  engine reports for that request reaches any stream.
* Leaving a stream aborts only that stream's requests: a cancelled ``add_requests`` whose
  ids clashed with another caller's live requests leaves those running.
* An aborted id can be reused at once. The engine refuses it until its next step has
  reported the aborted request's end, so an add that reuses it is held back for that one
  step (as are the adds queued after it, to keep arrival order); old and new outputs
  never meet in one stream.
* If the engine raises, every live stream and every later call gets
  :class:`EngineDeadError`; ``is_healthy`` turns False. After ``shutdown()`` it is False
  at once, later calls get EngineDeadError, and so does every add or reset still queued
  or held back when the loop stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixcache.engine.errors import EngineDeadError, InvalidRequestError
from prefixcache.engine.output_stream import OutputStream
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.stats import EngineStats

if TYPE_CHECKING:
    from prefixcache.engine.arg_utils import EngineArgs, KVEventsArgs
    from prefixcache.engine.sampling_params import SamplingParams
    from prefixcache.events.publisher import EventPublisher
    from prefixcache.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# How long an idle engine loop sleeps on the command queue before re-checking its state.
# Commands wake it at once; this only bounds how stale an idle loop's view can get.
_IDLE_WAIT_S = 0.5

_SHUTDOWN_REASON = "the server is shutting down"


@dataclass(frozen=True, slots=True)
class NewRequest:
    """One engine request to add: the arguments of ``LLMEngine.add_request``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float | None = None
    lora_request: LoRARequest | None = None


# ---- commands (event loop -> engine loop) ---------------------------------------------


@dataclass(slots=True)
class _Add:
    requests: list[NewRequest]
    stream: OutputStream
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]
    # Abort only the ids that belong to this stream; None aborts whoever holds them.
    stream: OutputStream | None


@dataclass(slots=True)
class _Reset:
    wait: bool
    abort_running: bool
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    reset_kv_tier: bool = False


@dataclass(slots=True)
class _Call:
    """Run ``function(engine)`` on the engine loop's thread; its result or exception
    settles ``done``."""

    function: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass(slots=True)
class _Shutdown:
    pass


@dataclass(slots=True)
class _Tracked:
    """Engine-loop side: where the outputs of one engine request go, from its add until
    the engine reports its final output. ``is_aborted``: aborted here, the engine's
    final output (the next step's) is still to come and is the only one delivered."""

    stream: OutputStream
    loop: asyncio.AbstractEventLoop
    is_aborted: bool = False


class AsyncLLM:
    """Drives one engine from a dedicated thread; the server's only way to the engine.

    ``engine`` must follow ``LLMEngine``'s contract (``add_request``, ``abort_request``,
    ``step``, ``has_unfinished_requests``, ``reset_prefix_cache``, ``get_stats``,
    ``take_kv_events``, ``close``, called once the loop has stopped); in particular the
    next step reports each aborted request's final output, and ``add_request`` refuses
    its id until then. ``event_publisher`` receives each step's KV events (and the
    AsyncLLM closes it on shutdown); None publishes nothing. The engine loop starts in
    the constructor.
    """

    def __init__(self, engine: Any, event_publisher: EventPublisher | None = None) -> None:
        self.engine = engine
        self.event_publisher = event_publisher
        # Shutdown may close the publisher while a slow step is still running (its join
        # timed out); the lock and flag keep that step from publishing into it.
        self._publish_lock = threading.Lock()
        self._publisher_closed = False
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._request_id_to_tracked: dict[str, _Tracked] = {}
        # Resets waiting for the running requests to finish (wait=True).
        self._reset_waiters: list[_Reset] = []
        # Adds not yet applied, in arrival order: behind a waiting reset, or reusing an
        # id whose aborted request the engine has not yet reported finished.
        self._held_adds: list[_Add] = []
        self._stats: EngineStats = copy.copy(engine.get_stats())
        self._dead_reason: str | None = None
        # Set by shutdown() before it queues the stop, so no new work is accepted meanwhile.
        self._is_shutting_down = False
        # Set by the loop before its last drain of the queue; a command put after that
        # must be answered by whoever put it.
        self._has_stopped_taking_commands = False
        self.num_steps = 0
        self._thread = threading.Thread(target=self._run, name="prefixcache-engine-loop",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs,
                         kv_events_args: KVEventsArgs | None = None) -> AsyncLLM:
        """Build the engine (``LLMEngine.from_engine_args``) and, when ``kv_events_args``
        names an endpoint, a ZMQ KV event publisher bound to it (events are then switched
        on in the engine).

        Both endpoints are passed through ``endpoint_for_rank`` with the
        ``data_parallel_rank`` first, so replicas given the same endpoints bind distinct
        ones (rank 0 binds them as given). Everything about the endpoints is checked
        before the model loads: an endpoint the rank cannot be applied to raises
        ValueError, a bad or taken one ``zmq.ZMQError``."""
        from prefixcache.engine.llm_engine import LLMEngine

        publisher = None
        if kv_events_args is not None and kv_events_args.enabled:
            publisher = _make_publisher(kv_events_args)
            engine_args = dataclasses.replace(engine_args, enable_kv_events=True)
        try:
            engine = LLMEngine.from_engine_args(engine_args)
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
        return cls(engine, publisher)

    # ---- public API (call from an asyncio event loop) ----------------------------------

    @property
    def is_healthy(self) -> bool:
        """False once the engine failed or ``shutdown()`` was called."""
        return (self._dead_reason is None and not self._is_shutting_down
                and self._thread.is_alive())

    def get_stats(self) -> EngineStats:
        """The engine's stats as of the end of the engine loop's last iteration, with the
        event publisher's counters as of now (it sends on a thread of its own)."""
        stats = copy.copy(self._stats)
        publisher = self.event_publisher
        if publisher is not None:
            stats.kv_events_published = publisher.num_published_batches
            stats.kv_events_dropped = publisher.num_dropped_batches
        return stats

    async def add_requests(self, requests: Sequence[NewRequest]) -> OutputStream:
        """Add ``requests`` to the engine as one group; returns their output stream.

        Raises the engine's InvalidRequestError (a ValueError; other ValueErrors of a
        non-conforming engine as ValueError) and adds nothing if the engine refuses any
        of them, and EngineDeadError if the engine loop is gone.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        stream = OutputStream(lambda request_ids: self._abort_stream(stream, request_ids),
                              [r.request_id for r in requests])
        done = loop.create_future()
        self._put_command(_Add(list(requests), stream, loop, done))
        try:
            await done
        except asyncio.CancelledError:
            # The add may still land after we stop waiting: abort it so it cannot leak.
            # Scoped to this stream: ids refused as duplicates belong to someone else.
            stream.abort()
            raise
        return stream

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling_params: SamplingParams, cache_salt: str | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield one request's outputs until it finishes; aborts it if the caller stops
        early."""
        stream = await self.add_requests([NewRequest(
            request_id, list(prompt_token_ids), sampling_params, cache_salt, arrival_time)])
        async with stream:
            async for output in stream:
                yield output

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Does not wait; never
        blocks, so it is safe from ``finally`` blocks and other threads."""
        if request_ids:
            self._commands.put(_Abort(list(request_ids), None))

    def _abort_stream(self, stream: OutputStream, request_ids: Sequence[str]) -> None:
        # The stream's abort callback: ids it shares with another stream are not its own.
        if request_ids:
            self._commands.put(_Abort(list(request_ids), stream))

    async def reset_prefix_cache(self, wait: bool = False, abort_running: bool = False,
                                 reset_kv_tier: bool = False) -> bool:
        """Drop every cached block that no request holds; True if the cache is now empty.

        - default: try now; False if running requests hold blocks.
        - ``abort_running``: abort every unfinished request first (their streams end with
          ``finish_reason="abort"``), then reset.
        - ``wait``: new requests are held back (not refused) until the running ones have
          finished, then the reset happens and the held requests are admitted. This
          cannot starve under steady load, and waits as long as the longest running
          request.
        - ``reset_kv_tier``: a successful reset also deletes this engine's blocks from
          its KV tier (which other replicas may share).
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._put_command(_Reset(wait, abort_running, loop, done, reset_kv_tier))
        return await done

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """``LLMEngine.add_lora`` on the engine's thread (loads the adapter there)."""
        return await self._call_engine(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_name: str) -> LoRARequest:
        """``LLMEngine.remove_lora`` on the engine's thread."""
        return await self._call_engine(lambda engine: engine.remove_lora(lora_name))

    async def _call_engine(self, function: Callable[[Any], Any]) -> Any:
        self._check_alive()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._put_command(_Call(function, loop, done))
        return await done

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine loop (live streams get EngineDeadError), close the publisher.

        From the call on, ``is_healthy`` is False and new calls raise EngineDeadError;
        adds and resets already queued or held back get it too.

        Waits up to ``timeout_s`` for the loop's current step. If it takes longer, the
        publisher is closed anyway and that step's events are dropped; the loop stops
        once the step ends."""
        self._is_shutting_down = True
        if self._thread.is_alive():
            self._commands.put(_Shutdown())
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.engine.close()  # the KV tier's queued writes
        if self.event_publisher is not None:
            with self._publish_lock:
                self._publisher_closed = True
                self.event_publisher.close()

    def _put_command(self, command: _Add | _Reset | _Call) -> None:
        self._commands.put(command)
        if self._has_stopped_taking_commands or not self._thread.is_alive():
            # The loop stopped between our check and the put; nobody else will answer.
            self._drain_commands(EngineDeadError(self._stopped_reason()))

    def _check_alive(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(self._stopped_reason())

    def _stopped_reason(self) -> str:
        if self._dead_reason is not None:
            return self._dead_reason
        return _SHUTDOWN_REASON if self._is_shutting_down else "the engine loop is not running"

    # ---- engine loop (the only thread that touches self.engine) ------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._take_and_apply_commands():
                    self._fail_all(EngineDeadError(_SHUTDOWN_REASON))
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
            if isinstance(command, _Add):
                self._admit(command)
            elif isinstance(command, _Abort):
                self._apply_abort(command.request_ids, command.stream)
            elif isinstance(command, _Reset):
                self._apply_reset(command)
            elif isinstance(command, _Call):
                try:
                    result = command.function(self.engine)
                except Exception as exc:  # noqa: BLE001 - the caller's to handle
                    _resolve(command.loop, command.done, exception=exc)
                else:
                    _resolve(command.loop, command.done, result=result)
            elif isinstance(command, _Shutdown):
                # Already taken off the queue, so the final drain would never see them.
                _refuse(commands[index + 1:], EngineDeadError(_SHUTDOWN_REASON))
                return False
        return True

    def _admit(self, command: _Add) -> None:
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

    def _apply_add(self, command: _Add) -> None:
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

    def _apply_reset(self, command: _Reset) -> None:
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
                if not self._publisher_closed:
                    self.event_publisher.publish(events)

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


def _make_publisher(kv_events_args: KVEventsArgs) -> EventPublisher:
    from prefixcache.events.endpoint import endpoint_for_rank
    from prefixcache.events.publisher import make_event_publisher

    rank = kv_events_args.data_parallel_rank
    replay_endpoint = kv_events_args.kv_events_replay_endpoint
    if replay_endpoint is not None:
        replay_endpoint = endpoint_for_rank(replay_endpoint, rank)
    return make_event_publisher(endpoint_for_rank(kv_events_args.kv_events_endpoint, rank),
                                replay_endpoint=replay_endpoint,
                                topic=kv_events_args.kv_events_topic,
                                data_parallel_rank=rank,
                                block_hash_format=kv_events_args.kv_events_block_hash_format)


def _refuse(commands: Sequence[Any], error: BaseException) -> None:
    """Answer every add, reset and call among ``commands`` with ``error``; aborts need no
    answer."""
    for command in commands:
        if isinstance(command, (_Add, _Reset, _Call)):
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
