"""AsyncLLM: the synchronous engine behind an asyncio front end, for the server.

The engine is not thread-safe, so exactly one thread touches it: the *engine loop*, a
daemon thread that owns it. Everything else talks to that thread through one thread-safe
command queue (add, abort, reset, shutdown) and hears back through the asyncio event loop
of whoever asked (``loop.call_soon_threadsafe``). Requests from every client therefore meet
in one engine and are batched by its scheduler.

This module is the asyncio side. The engine loop's side is
:mod:`prefixcache.engine.engine_loop`; the commands it takes are in
:mod:`prefixcache.engine.engine_commands`.

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
* A step's KV events leave before its outputs do: a client (or a router placing its next
  request by those events) that has a request's answer finds its blocks already published.
  The wait is bounded by ``engine_loop._EVENTS_SENT_TIMEOUT_S``; a stuck publisher
  delays outputs by that much and no more.
* If the engine raises, every live stream and every later call gets
  :class:`EngineDeadError`; ``is_healthy`` turns False. After ``shutdown()`` it is False
  at once, later calls get EngineDeadError, and so does every add or reset still queued
  or held back when the loop stops.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from prefixcache.engine.engine_commands import Abort, Add, Call, NewRequest, Reset, Shutdown
from prefixcache.engine.engine_loop import SHUTDOWN_REASON, EngineLoop
from prefixcache.engine.errors import EngineDeadError
from prefixcache.engine.output_stream import OutputStream
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.stats import EngineStats

if TYPE_CHECKING:
    from prefixcache.engine.arg_utils import EngineArgs, KVEventsArgs
    from prefixcache.engine.sampling_params import SamplingParams
    from prefixcache.events.publisher import EventPublisher
    from prefixcache.lora.request import LoRARequest


class AsyncLLM(EngineLoop):
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
        super().__init__(engine, event_publisher)
        # Set by shutdown() before it queues the stop, so no new work is accepted meanwhile.
        self._is_shutting_down = False
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
        self._put_command(Add(list(requests), stream, loop, done))
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
            self._commands.put(Abort(list(request_ids), None))

    def _abort_stream(self, stream: OutputStream, request_ids: Sequence[str]) -> None:
        # The stream's abort callback: ids it shares with another stream are not its own.
        if request_ids:
            self._commands.put(Abort(list(request_ids), stream))

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
        self._put_command(Reset(wait, abort_running, loop, done, reset_kv_tier))
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
        self._put_command(Call(function, loop, done))
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
            self._commands.put(Shutdown())
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.engine.close()  # the KV tier's queued writes
        if self.event_publisher is not None:
            with self._publish_lock:
                self._publisher_closed = True
                self.event_publisher.close()

    def _put_command(self, command: Add | Reset | Call) -> None:
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
        return SHUTDOWN_REASON if self._is_shutting_down else "the engine loop is not running"


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
