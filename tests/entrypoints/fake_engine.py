"""A deterministic stand-in for LLMEngine, for testing AsyncLLM's loop without a model.

Each request emits one token per step: ``prompt[-1] + 1, + 2, ...`` until ``max_tokens``.
As in LLMEngine, an aborted request's final output (``"abort"``, with its text and tokens
so far) comes first in the next step, and its id is refused until then.
A running request holds one "block"; ``reset_prefix_cache`` fails while any is held. Every
step appends one core-shaped event so publishing can be checked.

``hold_steps()`` makes every step wait until the returned gate is set, so a test can hold
requests running while it acts; ``in_step`` is set while a step waits at the gate, so the
test knows the engine loop is inside that step (and its commands queue up meanwhile).

A step takes ``STEP_S`` (1 ms), as a real one takes a few: without it the engine-loop thread
spins on a long request, each output copying every token so far (quadratic), and starves
the test's event loop of the GIL on a loaded machine — a flaky timeout.
"""

from __future__ import annotations

import threading
import time

from prefixcache.engine.outputs import RequestMetrics, RequestOutput
from prefixcache.engine.stats import EngineStats

STEP_S = 0.001


class FakeEngine:
    def __init__(self) -> None:
        self.running: dict[str, dict] = {}
        self.pending_outputs: list[RequestOutput] = []
        self.step_batches: list[list[str]] = []
        self.aborted: list[str] = []
        self.num_resets = 0
        self.events: list[str] = []
        self.step_gate: threading.Event | None = None
        self.in_step = threading.Event()
        self.fail_next_step = False
        self.generation_tokens = 0

    def add_request(self, request_id, prompt_token_ids, sampling_params, cache_salt=None,
                    arrival_time=None, lora_request=None):
        if lora_request is not None:
            raise ValueError("the fake engine serves no LoRA adapters")
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        if request_id in self.running:
            raise ValueError(f"duplicate request id {request_id}")
        if any(output.request_id == request_id for output in self.pending_outputs):
            raise ValueError(f"request id {request_id} was aborted, not yet reported")
        sampling_params.validate()
        self.running[request_id] = {
            "prompt": list(prompt_token_ids), "tokens": [], "params": sampling_params,
            "salt": cache_salt, "arrival": arrival_time or time.time(),
        }

    def abort_request(self, request_ids):
        for request_id in request_ids:
            state = self.running.pop(request_id, None)
            if state is not None:
                self.aborted.append(request_id)
                self.pending_outputs.append(RequestOutput(
                    request_id=request_id, prompt_token_ids=state["prompt"],
                    text=" ".join(map(str, state["tokens"])),
                    token_ids=list(state["tokens"]), finished=True, finish_reason="abort",
                    metrics=RequestMetrics(arrival_time=state["arrival"])))

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.pending_outputs)

    def hold_steps(self) -> threading.Event:
        """Hold the next step (and every later one) until the returned gate is set."""
        self.in_step.clear()
        self.step_gate = threading.Event()
        return self.step_gate

    def step(self) -> list[RequestOutput]:
        gate = self.step_gate
        if gate is not None and not gate.is_set():
            self.in_step.set()
            gate.wait(10)
            self.in_step.clear()
        time.sleep(STEP_S)
        if self.fail_next_step:
            raise RuntimeError("boom")
        self.step_batches.append(sorted(self.running))
        outputs, self.pending_outputs = self.pending_outputs, []
        for request_id, state in list(self.running.items()):
            token = state["prompt"][-1] + len(state["tokens"]) + 1
            state["tokens"].append(token)
            self.generation_tokens += 1
            finished = len(state["tokens"]) >= state["params"].max_tokens
            outputs.append(RequestOutput(
                request_id=request_id, prompt_token_ids=state["prompt"],
                text=" ".join(map(str, state["tokens"])), token_ids=list(state["tokens"]),
                new_text=f" {token}", new_token_ids=[token], finished=finished,
                finish_reason="length" if finished else None,
                metrics=RequestMetrics(arrival_time=state["arrival"])))
            if finished:
                del self.running[request_id]
        self.events.append(f"step{len(self.step_batches)}")
        return outputs

    def reset_prefix_cache(self, reset_kv_tier: bool = False) -> bool:
        if self.running:
            return False
        self.num_resets += 1
        return True

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running),
                           generation_tokens=self.generation_tokens,
                           kv_cache_usage=0.1 * len(self.running))

    def take_kv_events(self):
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        self.is_closed = True


class RecordingPublisher:
    """An EventPublisher that keeps what it is given."""

    num_dropped_batches = 0
    num_published_batches = 0

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.closed = False

    def publish(self, events, ts=None) -> None:
        self.batches.append(list(events))
        self.num_published_batches += 1

    def close(self) -> None:
        self.closed = True
