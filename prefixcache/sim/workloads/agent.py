"""Agent loops: long tool contexts, extended by one observation and action per step."""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from dataclasses import dataclass

from prefixcache.sim.workloads.parameter_ranges import MAX_SKIPPED_IN_A_ROW, no_room
from prefixcache.sim.workloads.sampling import geometric, lognormal_tokens
from prefixcache.sim.workloads.synthetic_request import SyntheticRequest


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    """Sessions start as a Poisson process (``sessions_per_s``). A session belongs to one
    of ``num_agents`` agents (uniformly), whose prompt opens with a long, shared tool and
    instruction context (``tool_context_tokens``), then the session's task
    (``task_tokens``). Each of its ``mean_steps`` steps (geometric) calls the model on the
    whole history: the step's prompt is the previous step's prompt, plus the action the
    model generated (``output_tokens``), plus the tool's observation
    (``observation_tokens``, log-normal and widely spread: a file, a search result). The
    tool runs for an exponential time of mean ``mean_tool_time_s`` between steps. A session
    stops once its prompt would pass ``max_context_tokens``.
    """

    num_agents: int = 3
    tool_context_tokens: int = 6000
    task_tokens: int = 300
    sessions_per_s: float = 0.2
    mean_steps: float = 10.0
    output_tokens: int = 150
    observation_tokens: int = 700
    mean_tool_time_s: float = 8.0
    max_context_tokens: int = 48_000

    name = "agent"

    def stream(self, num_requests: int, rng: random.Random) -> Iterator[SyntheticRequest]:
        """``num_requests`` requests, in order of arrival, drawn with ``rng`` one at a
        time as they are taken."""
        tool_lengths = [lognormal_tokens(rng, self.tool_context_tokens, 0.3, low=256)
                        for _ in range(self.num_agents)]
        num_written = 0
        # (time s, session id, agent, history tokens, steps left, last action)
        pending: list[tuple[float, int, int, int, int, int]] = []
        next_start = 0.0
        num_sessions = 0
        num_skipped_in_a_row = 0
        while num_written < num_requests:
            if not pending or next_start <= pending[0][0]:
                now, session = next_start, num_sessions
                num_sessions += 1
                next_start += rng.expovariate(self.sessions_per_s)
                agent = rng.randrange(self.num_agents)
                history = lognormal_tokens(rng, self.task_tokens, 0.5, low=16)
                steps_left, last_action = geometric(rng, self.mean_steps), 0
            else:
                now, session, agent, history, steps_left, last_action = heapq.heappop(pending)
                history += last_action + lognormal_tokens(rng, self.observation_tokens, 1.0,
                                                          low=16, high=16_000)
            if tool_lengths[agent] + history > self.max_context_tokens:
                num_skipped_in_a_row += 1
                if num_skipped_in_a_row == MAX_SKIPPED_IN_A_ROW:
                    raise no_room(self.name, self.max_context_tokens,
                                  "tool_context_tokens or task_tokens")
                continue
            num_skipped_in_a_row = 0
            action = lognormal_tokens(rng, self.output_tokens, 0.5, low=1)
            yield SyntheticRequest(
                int(now * 1000),
                ((("agent-tools", agent), tool_lengths[agent]), (("agent", session), history)),
                action)
            num_written += 1
            if steps_left > 1:
                heapq.heappush(pending, (now + rng.expovariate(1.0 / self.mean_tool_time_s),
                                         session, agent, history, steps_left - 1, action))
