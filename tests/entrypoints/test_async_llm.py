"""AsyncLLM's engine loop over a deterministic fake engine: batching, streams, aborts,
resets, failures and event publishing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from prefixcache.engine.async_llm import AsyncLLM, NewRequest
from prefixcache.engine.engine_commands import Add, Reset
from prefixcache.engine.output_stream import EngineDeadError
from prefixcache.engine.sampling_params import SamplingParams
from tests.entrypoints.fake_engine import FakeEngine, RecordingPublisher

TIMEOUT_S = 10


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture
def llm():
    engine = FakeEngine()
    publisher = RecordingPublisher()
    async_llm = AsyncLLM(engine, publisher)
    yield async_llm
    async_llm.shutdown()
    assert publisher.closed


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def collect(llm: AsyncLLM, request_id: str, prompt: list[int], max_tokens: int):
    return [o async for o in llm.generate(request_id, prompt, params(max_tokens))]


def test_generate_yields_each_token_then_finishes(llm):
    outputs = run(collect(llm, "a", [10], 3))
    assert [o.new_token_ids for o in outputs] == [[11], [12], [13]]
    assert [o.finished for o in outputs] == [False, False, True]
    assert outputs[-1].finish_reason == "length"
    assert not llm.engine.running


def test_concurrent_requests_share_engine_steps(llm):
    async def main():
        # Hold the steps until every request is queued, so they must be batched.
        gate = llm.engine.hold_steps()
        tasks = [await start(collect(llm, f"r{i}", [i * 100], 4)) for i in range(8)]
        gate.set()
        return await asyncio.gather(*tasks)

    results = run(main())
    for i, outputs in enumerate(results):
        assert outputs[-1].token_ids == [i * 100 + k for k in range(1, 5)]
    assert max(len(batch) for batch in llm.engine.step_batches) == 8


def test_group_stream_ends_when_all_finished(llm):
    async def main():
        stream = await llm.add_requests([
            NewRequest("g0", [1], params(1)), NewRequest("g1", [5], params(3))])
        async with stream:
            return [o async for o in stream]

    outputs = run(main())
    finished = [o.request_id for o in outputs if o.finished]
    assert sorted(finished) == ["g0", "g1"]
    assert len(outputs) == 4


def test_leaving_a_stream_early_aborts_it(llm):
    async def main():
        # Endless in practice: a finite length could run out before the abort arrives on
        # a loaded machine (the fake engine steps as fast as the loop spins).
        stream = await llm.add_requests([NewRequest("long", [1], params(10**9))])
        async with stream:
            async for output in stream:
                if len(output.token_ids) >= 2:
                    break
        await wait_until(lambda: not llm.engine.running)

    run(main())
    assert llm.engine.aborted == ["long"]


async def wait_until(predicate, timeout_s: float = TIMEOUT_S) -> None:
    """Poll ``predicate`` (a counter or state of the engine loop) until it holds."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


async def start(coro) -> asyncio.Future:
    """Run ``coro`` as a task up to its first wait for the engine loop: one turn of the
    event loop does it, as nothing before that wait suspends. Its command is then queued
    (taken at once by an idle loop, or when a held step ends)."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    assert not task.done()
    return task


async def until_held(llm: AsyncLLM) -> None:
    """Return once the engine loop is inside a held step (``FakeEngine.hold_steps``): what
    is queued from now on is taken together, when the step ends."""
    assert await asyncio.to_thread(llm.engine.in_step.wait, TIMEOUT_S), "no step was held"


async def round_trip(llm: AsyncLLM) -> None:
    """Return once the engine loop finished the iteration it is in (delivery and the
    admission of held-back adds included): a reset is answered in the command phase of a
    later iteration. The reset is refused while requests run, so it changes nothing
    there."""
    await llm.reset_prefix_cache()


def test_cancelling_the_consumer_aborts(llm):
    async def main():
        task = asyncio.create_task(collect(llm, "c", [1], 100_000))
        await wait_until(lambda: "c" in llm.engine.running)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: not llm.engine.running)

    run(main())
    assert llm.engine.aborted == ["c"]


def test_refused_request_raises_and_rolls_back_its_group(llm):
    async def main():
        with pytest.raises(ValueError, match="empty prompt"):
            await llm.add_requests([NewRequest("ok", [1], params(50)),
                                    NewRequest("bad", [], params(5))])
        return llm.engine.running

    assert run(main()) == {}
    assert llm.engine.aborted == ["ok"]


def test_reset_fails_while_running_and_succeeds_when_idle(llm):
    async def main():
        stream = await llm.add_requests([NewRequest("r", [1], params(100_000))])
        await wait_until(lambda: llm.num_steps > 0)
        refused = await llm.reset_prefix_cache()
        await stream.aclose()  # commands apply in order: the abort lands before the reset
        return refused, await llm.reset_prefix_cache()

    refused, accepted = run(main())
    assert (refused, accepted) == (False, True)
    assert llm.engine.num_resets == 1


def test_reset_abort_running_ends_streams_with_abort(llm):
    async def main():
        stream = await llm.add_requests([NewRequest("r", [1], params(100_000))])
        success = await llm.reset_prefix_cache(abort_running=True)
        async with stream:
            outputs = [o async for o in stream]
        return success, outputs

    success, outputs = run(main())
    assert success
    assert outputs[-1].finish_reason == "abort"
    assert llm.engine.aborted == ["r"] and not llm.engine.running


def test_reset_wait_holds_new_requests_until_running_ones_finish(llm):
    async def main():
        gate = llm.engine.hold_steps()
        first = await llm.add_requests([NewRequest("first", [1], params(3))])
        await until_held(llm)
        # Queued in this order while the step is held: the reset waits for "first", and
        # "later" is held back behind it.
        reset = await start(llm.reset_prefix_cache(wait=True))
        later = await start(collect(llm, "later", [50], 2))
        gate.set()
        async with first:
            first_outputs = [o async for o in first]
        return await reset, first_outputs, await later

    success, first_outputs, later_outputs = run(main())
    assert success and llm.engine.num_resets == 1
    assert first_outputs[-1].finish_reason == "length"
    assert later_outputs[-1].token_ids == [51, 52]
    assert not any("later" in batch and "first" in batch for batch in llm.engine.step_batches)


def test_an_aborted_stream_ends_with_everything_generated_so_far(llm):
    async def main():
        stream = await llm.add_requests([NewRequest("r", [10], params(100_000))])
        async with stream:
            outputs = []
            async for output in stream:
                outputs.append(output)
                if len(outputs) == 3:
                    await llm.reset_prefix_cache(abort_running=True)
        return outputs

    outputs = run(main())
    final = outputs[-1]
    assert final.finish_reason == "abort"
    # Cumulative, as RequestOutput promises: the server reads text and token_ids of the
    # final output alone for a non-streaming response and its usage.
    assert final.token_ids == outputs[-2].token_ids and len(final.token_ids) >= 3
    assert final.text == outputs[-2].text
    assert [o.finish_reason for o in outputs[:-1]] == [None] * (len(outputs) - 1)


async def add_and_give_up(llm: AsyncLLM, request: NewRequest) -> None:
    """Call ``add_requests`` and cancel it while the (blocked) engine loop has not yet
    answered, as a client that disconnects at once."""
    pending = await start(llm.add_requests([request]))
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending


def test_an_aborted_id_can_be_reused_at_once(llm):
    async def main():
        first = await llm.add_requests([NewRequest("a", [1], params(100_000))])
        await wait_until(lambda: llm.num_steps > 0)
        gate = llm.engine.hold_steps()
        await until_held(llm)
        await first.aclose()
        # The abort and the re-add reach the loop together, before the engine reported
        # the aborted request's end.
        second = await start(collect(llm, "a", [50], 3))
        gate.set()
        outputs = await second
        await wait_until(lambda: not llm.engine.has_unfinished_requests())
        return outputs

    outputs = run(main())
    assert [o.new_token_ids for o in outputs] == [[51], [52], [53]]
    assert outputs[-1].finish_reason == "length"
    assert llm.engine.aborted == ["a"] and not llm.engine.running
    assert llm._request_id_to_tracked == {}


def test_a_cancelled_add_does_not_abort_another_streams_request(llm):
    async def main():
        owner = await llm.add_requests([NewRequest("a", [1], params(100_000))])
        await wait_until(lambda: llm.num_steps > 0)
        gate = llm.engine.hold_steps()
        await until_held(llm)
        # Another caller reuses the live id and gives up before the loop answers: its
        # add fails as a duplicate, and its clean-up abort must not touch "a".
        await add_and_give_up(llm, NewRequest("a", [7], params(5)))
        gate.set()
        num_steps = llm.num_steps
        await wait_until(lambda: llm.num_steps >= num_steps + 3)
        assert llm.engine.aborted == [] and "a" in llm.engine.running
        outputs = []
        async with owner:
            async for output in owner:
                outputs.append(output)
                if len(output.token_ids) >= 5:
                    break
        await wait_until(lambda: not llm.engine.has_unfinished_requests())
        return outputs

    outputs = run(main())
    assert not any(o.finished for o in outputs)
    assert llm.engine.aborted == ["a"]  # by its owner leaving, not before


def test_a_cancelled_add_held_back_behind_an_abort_never_runs(llm):
    async def main():
        first = await llm.add_requests([NewRequest("a", [1], params(100_000))])
        await wait_until(lambda: llm.num_steps > 0)
        gate = llm.engine.hold_steps()
        await until_held(llm)
        await first.aclose()
        # Held back until the abort is reported, then cancelled before it is applied.
        await add_and_give_up(llm, NewRequest("a", [7], params(100_000)))
        gate.set()
        # The step after the abort reports it; a wrongly admitted add would then run.
        await wait_until(lambda: not llm.engine.has_unfinished_requests())
        await round_trip(llm)

    run(main())
    assert not llm.engine.running and llm.engine.aborted == ["a"]
    assert llm._held_adds == [] and llm._request_id_to_tracked == {}


def test_shutdown_refuses_new_work_at_once_and_answers_what_is_queued_behind_it():
    engine = FakeEngine()
    async_llm = AsyncLLM(engine)

    async def main():
        stream = await async_llm.add_requests([NewRequest("a", [1], params(100_000))])
        await wait_until(lambda: async_llm.num_steps > 0)
        gate = engine.hold_steps()
        await until_held(async_llm)
        async_llm.shutdown(timeout_s=0.01)  # gives up waiting; the loop still runs
        assert async_llm._thread.is_alive() and not async_llm.is_healthy
        with pytest.raises(EngineDeadError, match="shutting down"):
            await async_llm.add_requests([NewRequest("b", [1], params(1))])
        with pytest.raises(EngineDeadError, match="shutting down"):
            await async_llm.reset_prefix_cache()
        # Calls that passed their check just before shutdown() queued their commands
        # behind the stop; the loop takes them in the same batch as the stop.
        loop = asyncio.get_running_loop()
        add = Add([NewRequest("c", [1], params(1))], stream, loop, loop.create_future())
        reset = Reset(False, False, loop, loop.create_future())
        async_llm._commands.put(add)
        async_llm._commands.put(reset)
        gate.set()
        for future in (add.done, reset.done):
            with pytest.raises(EngineDeadError, match="shutting down"):
                await future
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    run(main())
    async_llm.shutdown()


def test_engine_failure_fails_streams_and_later_calls(llm):
    async def main():
        llm.engine.fail_next_step = True
        with pytest.raises(EngineDeadError):
            await collect(llm, "x", [1], 5)
        await wait_until(lambda: not llm.is_healthy)
        with pytest.raises(EngineDeadError):
            await llm.add_requests([NewRequest("y", [1], params(1))])
        with pytest.raises(EngineDeadError):
            await llm.reset_prefix_cache()

    run(main())


def test_each_step_publishes_its_events(llm):
    run(collect(llm, "e", [1], 3))
    assert llm.event_publisher.batches == [["step1"], ["step2"], ["step3"]]


def test_a_steps_outputs_wait_until_its_events_are_sent(llm):
    """A router reads the events to place the next request of the same prefix: nobody may
    have a step's answer before its events are on the wire."""
    publisher = llm.event_publisher
    publisher.send_gate = threading.Event()

    async def main():
        task = asyncio.ensure_future(collect(llm, "e", [1], 1))
        await wait_until(lambda: publisher.num_waits == 1)
        # The engine loop is inside wait_until_sent for the only step: not delivered yet.
        assert publisher.batches == [["step1"]] and not task.done()
        publisher.send_gate.set()
        outputs = await task
        assert outputs[-1].finished

    run(main())


class ClosingPublisher(RecordingPublisher):
    """Like the real publisher: publishing after close() is an error."""

    def publish(self, events, ts=None) -> None:
        if self.closed:
            raise RuntimeError("publish() on a closed publisher")
        super().publish(events, ts)


def test_a_step_outlasting_the_shutdown_wait_does_not_publish_into_the_closed_publisher(
        caplog):
    engine = FakeEngine()
    publisher = ClosingPublisher()
    async_llm = AsyncLLM(engine, publisher)

    async def main():
        gate = engine.hold_steps()
        task = await start(collect(async_llm, "slow", [1], 5))
        await until_held(async_llm)
        async_llm.shutdown(timeout_s=0.05)  # gives up waiting: the step still runs
        assert publisher.closed and async_llm._thread.is_alive()
        gate.set()
        await wait_until(lambda: not async_llm._thread.is_alive())
        with pytest.raises(EngineDeadError):
            await task

    run(main())
    assert "engine loop failed" not in caplog.text
    assert publisher.batches == []


def test_stats_snapshot_follows_the_engine(llm):
    run(collect(llm, "s", [1], 4))

    async def settled():
        await wait_until(lambda: llm.get_stats().generation_tokens == 4)

    run(settled())
    assert llm.get_stats().num_running == 0
