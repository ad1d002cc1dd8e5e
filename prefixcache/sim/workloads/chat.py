"""Multi-turn chat: conversations whose every turn extends the previous prompt."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from prefixcache.sim.workloads.sampling import geometric, lognormal_tokens
from prefixcache.sim.workloads.synthetic_request import SyntheticRequest


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Conversations start as a Poisson process (``conversations_per_s``); each opens
    with one of ``num_system_prompts`` system prompts (chosen uniformly) and lasts
    ``mean_turns`` turns on average (geometric). Turn ``t``'s prompt is the system prompt,
    then the transcript so far: every earlier user message and answer, then user message
    ``t``. So each turn's prompt extends the previous one by the previous answer and the new
    message. Between an answer and the next message the user thinks for an exponential
    time of mean ``mean_think_time_s``; meanwhile other conversations interleave, which is
    what makes the cache hold a conversation or lose it. A conversation ends early once its
    prompt would pass ``max_context_tokens``.
    """

    num_system_prompts: int = 4
    system_prompt_tokens: int = 1200
    conversations_per_s: float = 0.5
    mean_turns: float = 6.0
    user_tokens: int = 250
    output_tokens: int = 350
    mean_think_time_s: float = 60.0
    max_context_tokens: int = 32_000

    name = "chat"

    def generate(self, num_requests: int, rng: random.Random) -> list[SyntheticRequest]:
        system_lengths = [lognormal_tokens(rng, self.system_prompt_tokens, 0.3, low=64)
                          for _ in range(self.num_system_prompts)]
        requests: list[SyntheticRequest] = []
        # (time s, conversation id, system prompt, transcript tokens, turns left, last answer)
        pending: list[tuple[float, int, int, int, int, int]] = []
        next_start = 0.0
        num_conversations = 0
        while len(requests) < num_requests:
            if not pending or next_start <= pending[0][0]:
                now, conversation = next_start, num_conversations
                num_conversations += 1
                next_start += rng.expovariate(self.conversations_per_s)
                system, transcript = rng.randrange(self.num_system_prompts), 0
                turns_left, last_answer = geometric(rng, self.mean_turns), 0
            else:
                now, conversation, system, transcript, turns_left, last_answer = \
                    heapq.heappop(pending)
            user = lognormal_tokens(rng, self.user_tokens, 0.6, low=8)
            transcript += last_answer + user
            if system_lengths[system] + transcript > self.max_context_tokens:
                continue
            answer = lognormal_tokens(rng, self.output_tokens, 0.6, low=1)
            requests.append(SyntheticRequest(
                int(now * 1000),
                ((("chat-system", system), system_lengths[system]),
                 (("chat", conversation), transcript)),
                answer))
            if turns_left > 1:
                heapq.heappush(pending, (now + rng.expovariate(1.0 / self.mean_think_time_s),
                                         conversation, system, transcript, turns_left - 1,
                                         answer))
        return requests
