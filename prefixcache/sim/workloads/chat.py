"""Multi-turn chat: conversations whose every turn extends the previous prompt."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from prefixcache.sim.workloads.parameter_ranges import MAX_SKIPPED_IN_A_ROW, no_room
from prefixcache.sim.workloads.sampling import ZipfChooser, lognormal_tokens, pareto_count
from prefixcache.sim.workloads.synthetic_request import SyntheticRequest


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Conversations start as a Poisson process (``conversations_per_s``); each opens
    with one of ``num_system_prompts`` system prompts, shared across conversations with
    Zipf popularity (``system_prompt_zipf_s``: a few applications carry most traffic).
    A conversation's number of turns is long-tailed (discrete Pareto of tail index
    ``turns_tail_index``, at most ``max_turns``): most conversations are short, a few run
    for dozens of turns. Turn ``t``'s prompt is the system prompt, then the transcript so
    far: every earlier user message and answer, then user message ``t``; the first
    message is long-tailed too (pasted text or code), later ones are short. Between an
    answer and the next message the user thinks for a log-normal time (median
    ``think_time_s``, spread ``think_time_sigma``: seconds for most, many minutes for
    some); meanwhile other conversations interleave, which is what makes the cache hold a
    conversation or lose it. A conversation ends early once its prompt would pass
    ``max_context_tokens``.
    """

    num_system_prompts: int = 16
    system_prompt_zipf_s: float = 1.0
    system_prompt_tokens: int = 1200
    conversations_per_s: float = 0.5
    turns_tail_index: float = 1.5
    max_turns: int = 64
    first_message_tokens: int = 1000
    first_message_sigma: float = 1.5
    user_tokens: int = 120
    output_tokens: int = 350
    think_time_s: float = 40.0
    think_time_sigma: float = 1.2
    max_context_tokens: int = 32_000

    name = "chat"

    def stream(self, num_requests: int, rng: random.Random) -> Iterator[SyntheticRequest]:
        """``num_requests`` requests, in order of arrival, drawn with ``rng`` one at a
        time as they are taken."""
        system_lengths = [lognormal_tokens(rng, self.system_prompt_tokens, 0.5, low=64)
                          for _ in range(self.num_system_prompts)]
        system_chooser = ZipfChooser(rng, self.num_system_prompts, self.system_prompt_zipf_s)
        num_written = 0
        # (time s, conversation id, system prompt, transcript tokens, turns left, last answer)
        pending: list[tuple[float, int, int, int, int, int]] = []
        next_start = 0.0
        num_conversations = 0
        num_skipped_in_a_row = 0
        while num_written < num_requests:
            if not pending or next_start <= pending[0][0]:
                now, conversation = next_start, num_conversations
                num_conversations += 1
                next_start += rng.expovariate(self.conversations_per_s)
                system, transcript = system_chooser.draw(), 0
                turns_left = pareto_count(rng, self.turns_tail_index, self.max_turns)
                last_answer = 0
                user = lognormal_tokens(rng, self.first_message_tokens,
                                        self.first_message_sigma, low=8)
            else:
                now, conversation, system, transcript, turns_left, last_answer = \
                    heapq.heappop(pending)
                user = lognormal_tokens(rng, self.user_tokens, 0.8, low=4)
            transcript += last_answer + user
            if system_lengths[system] + transcript > self.max_context_tokens:
                num_skipped_in_a_row += 1
                if num_skipped_in_a_row == MAX_SKIPPED_IN_A_ROW:
                    raise no_room(self.name, self.max_context_tokens,
                                  "system_prompt_tokens or first_message_tokens")
                continue
            num_skipped_in_a_row = 0
            answer = lognormal_tokens(rng, self.output_tokens, 0.7, low=1)
            yield SyntheticRequest(
                int(now * 1000),
                ((("chat-system", system), system_lengths[system]),
                 (("chat", conversation), transcript)),
                answer)
            num_written += 1
            if turns_left > 1:
                think = self.think_time_s * math.exp(rng.gauss(0.0, self.think_time_sigma))
                heapq.heappush(pending, (now + think, conversation, system, transcript,
                                         turns_left - 1, answer))
