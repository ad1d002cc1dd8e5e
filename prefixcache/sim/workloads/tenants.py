"""Many tenants, each with its own system prompt, sending mostly one-off requests."""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from dataclasses import dataclass

from prefixcache.sim.workloads.sampling import ZipfChooser, lognormal_tokens
from prefixcache.sim.workloads.synthetic_request import SyntheticRequest


@dataclass(frozen=True, slots=True)
class TenantsWorkload:
    """Requests arrive as a Poisson process (``requests_per_s``) from ``num_tenants``
    tenants of Zipf popularity (exponent ``zipf_s``). A tenant's prompts all open with its
    own system prompt (``system_prompt_tokens``, log-normal with a wide spread: a short
    instruction or a long few-shot prompt), then a user input (``user_tokens``, shared
    only by its follow-up). With probability ``follow_up_probability`` a first request
    gets one follow-up ``follow_up_delay_s`` seconds later on average (exponential): the
    first prompt, its answer and a new input. Every ``popularity_drift_every`` first
    requests (0: never) the tenants' ranking is redrawn.
    """

    num_tenants: int = 300
    zipf_s: float = 1.1
    system_prompt_tokens: int = 1500
    user_tokens: int = 700
    output_tokens: int = 250
    follow_up_probability: float = 0.25
    follow_up_delay_s: float = 30.0
    requests_per_s: float = 4.0
    popularity_drift_every: int = 0

    name = "tenants"

    def stream(self, num_requests: int, rng: random.Random) -> Iterator[SyntheticRequest]:
        """``num_requests`` requests, in order of arrival, drawn with ``rng`` one at a
        time as they are taken."""
        system_lengths = [lognormal_tokens(rng, self.system_prompt_tokens, 0.9, low=64,
                                           high=24_000)
                          for _ in range(self.num_tenants)]
        chooser = ZipfChooser(rng, self.num_tenants, self.zipf_s)
        num_written = 0
        follow_ups: list[tuple[float, int, SyntheticRequest]] = []  # (time s, order, parent)
        now = 0.0
        num_first = 0
        while num_written < num_requests:
            next_arrival = now + rng.expovariate(self.requests_per_s)
            if follow_ups and follow_ups[0][0] <= next_arrival:
                when, _, parent = heapq.heappop(follow_ups)
                now = when  # arrivals are memoryless: the next one is drawn from here
                tenant_segment, (thread, length) = parent.segments
                extra = parent.output_length + lognormal_tokens(rng, self.user_tokens, 0.7,
                                                                low=8)
                yield SyntheticRequest(
                    int(when * 1000), (tenant_segment, (thread, length + extra)),
                    lognormal_tokens(rng, self.output_tokens, 0.6, low=1))
                num_written += 1
                continue
            now = next_arrival
            if self.popularity_drift_every and num_first and \
                    num_first % self.popularity_drift_every == 0:
                chooser.reshuffle()
            num_first += 1
            tenant = chooser.draw()
            request = SyntheticRequest(
                int(now * 1000),
                ((("tenant-system", tenant), system_lengths[tenant]),
                 (("tenant-thread", num_first), lognormal_tokens(rng, self.user_tokens, 0.7,
                                                                 low=8))),
                lognormal_tokens(rng, self.output_tokens, 0.6, low=1))
            yield request
            num_written += 1
            if rng.random() < self.follow_up_probability:
                heapq.heappush(follow_ups, (now + rng.expovariate(1.0 / self.follow_up_delay_s),
                                            num_first, request))
