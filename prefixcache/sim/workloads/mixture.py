"""A mixture of the other families whose shares and popularities drift over time."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from prefixcache.sim.workloads.agent import AgentWorkload
from prefixcache.sim.workloads.chat import ChatWorkload
from prefixcache.sim.workloads.rag import RAGWorkload
from prefixcache.sim.workloads.synthetic_request import SyntheticRequest
from prefixcache.sim.workloads.tenants import TenantsWorkload


@dataclass(frozen=True, slots=True)
class MixtureWorkload:
    """Chat, RAG, agent and tenant traffic on one server. The trace is cut into
    ``num_phases`` equal phases; in each, the families' shares of requests are drawn anew
    (Dirichlet with concentration ``share_concentration``: small values give lopsided
    phases), so which shape dominates the cache changes over time. Within the RAG and
    tenant traffic, popularity also drifts: their rankings are redrawn every
    ``popularity_drift_every`` of their requests (of their first requests, for tenants).
    Each family keeps its own request order; arrivals are a Poisson process at
    ``requests_per_s`` (families' own clocks are not kept, so chat think times and tool
    times stretch or shrink with the family's share).
    """

    num_phases: int = 4
    share_concentration: float = 0.7
    popularity_drift_every: int = 400
    requests_per_s: float = 3.0
    chat: ChatWorkload = field(default_factory=ChatWorkload)
    rag: RAGWorkload = field(default_factory=RAGWorkload)
    agent: AgentWorkload = field(default_factory=AgentWorkload)
    tenants: TenantsWorkload = field(default_factory=TenantsWorkload)

    name = "mixture"

    def stream(self, num_requests: int, rng: random.Random) -> Iterator[SyntheticRequest]:
        """``num_requests`` requests, in order of arrival, drawn with ``rng`` one at a
        time as they are taken."""
        drift = self.popularity_drift_every
        families = [self.chat, replace(self.rag, popularity_drift_every=drift), self.agent,
                    replace(self.tenants, popularity_drift_every=drift)]
        # Each family could in the worst case supply every request. Each draws from its own
        # generator, seeded here, so drawing its requests lazily gives the same ones.
        streams = [family.stream(num_requests, random.Random(rng.random()))
                   for family in families]
        num_phases = max(1, min(self.num_phases, num_requests))
        num_written = 0
        now = 0.0
        for phase in range(num_phases):
            weights = [rng.gammavariate(self.share_concentration, 1.0) for _ in families]
            if not any(weights):  # every draw underflowed to 0 (a tiny concentration)
                weights = [1.0] * len(families)
            end = (phase + 1) * num_requests // num_phases
            while num_written < end:
                stream = streams[rng.choices(range(len(families)), weights)[0]]
                now += rng.expovariate(self.requests_per_s)
                request = next(stream)
                yield SyntheticRequest(int(now * 1000), request.segments,
                                       request.output_length)
                num_written += 1
