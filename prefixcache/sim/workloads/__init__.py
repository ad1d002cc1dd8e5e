"""Synthetic workload families: traces in the shapes serving traffic takes, for judging
eviction policies on more than one trace (``prefixcache synth``; docs/workloads.md).

Each family is a frozen dataclass of documented parameters with
``stream(num_requests, rng) -> Iterator[SyntheticRequest]``: the requests in order of
arrival, a pure function of the parameters and ``rng``'s state, drawn one at a time as
they are taken. :func:`stream_requests` runs one by name and seed (checking its
arguments, and that every request is one the replayer reads), :func:`generate_requests`
returns the same requests as a list, and
:func:`~prefixcache.sim.workloads.synthetic_request.write_trace` writes them in the
Mooncake or token-id format the replayer reads.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

from prefixcache.sim.trace import MAX_REQUEST_TOKENS
from prefixcache.sim.workloads.agent import AgentWorkload
from prefixcache.sim.workloads.chat import ChatWorkload
from prefixcache.sim.workloads.mixture import MixtureWorkload
from prefixcache.sim.workloads.parameter_ranges import (
    DRIFTING_COUNTS,
    MAX_NUM_REQUESTS,
    PARAMETER_RANGES,
    check_drift_cost,
    check_parameter,
)
from prefixcache.sim.workloads.rag import RAGWorkload
from prefixcache.sim.workloads.synthetic_request import (
    BlockIdInterner,
    SyntheticRequest,
    write_trace,
)
from prefixcache.sim.workloads.tenants import TenantsWorkload

WORKLOAD_FAMILIES = {family.name: family for family in
                     (ChatWorkload, RAGWorkload, AgentWorkload, TenantsWorkload,
                      MixtureWorkload)}
TRACE_FORMATS = ("mooncake", "token-ids")


def make_workload(family: str, **params):
    """The workload of ``family`` with ``params`` overriding its defaults. Raises
    ValueError for an unknown family or parameter, a value out of the parameter's range
    (:data:`~prefixcache.sim.workloads.parameter_ranges.PARAMETER_RANGES`), or a
    popularity drift too frequent for the number of items it reshuffles
    (:func:`~prefixcache.sim.workloads.parameter_ranges.check_drift_cost`)."""
    try:
        workload_class = WORKLOAD_FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown workload family {family!r}; choose one of "
                         f"{', '.join(WORKLOAD_FAMILIES)}") from None
    known = {f.name for f in dataclasses.fields(workload_class)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"{family} has no parameter {', '.join(unknown)}; its parameters: "
                         f"{', '.join(sorted(known))}")
    for name, value in params.items():
        if name in PARAMETER_RANGES:  # not the families inside a mixture
            check_parameter(name, value)
    workload = workload_class(**params)
    # A mixture's RAG and tenant traffic drift at the mixture's pace.
    parts = [workload.rag, workload.tenants] if family == "mixture" else [workload]
    for part in parts:
        if part.name in DRIFTING_COUNTS:
            check_drift_cost(family if part is workload else f"{family}'s {part.name}",
                             part.name, getattr(part, DRIFTING_COUNTS[part.name]),
                             workload.popularity_drift_every)
    return workload


def generate_requests(family: str, seed: int, num_requests: int,
                      **params) -> list[SyntheticRequest]:
    """``num_requests`` requests of ``family``, a pure function of the arguments.
    ValueError unless 1 <= ``num_requests`` <= :data:`MAX_NUM_REQUESTS`, or as
    :func:`make_workload` raises it, or if the parameters leave no room for a prompt."""
    return list(stream_requests(family, seed, num_requests, **params))


def stream_requests(family: str, seed: int, num_requests: int,
                    **params) -> Iterator[SyntheticRequest]:
    """The requests :func:`generate_requests` returns, drawn one at a time as they are
    taken. The arguments are checked (ValueError) before this returns. Two faults of the
    parameters are found only while drawing, and raise ValueError then: no room for a
    prompt, and a request whose prompt or output is longer than the replayer reads
    (:data:`~prefixcache.sim.trace.MAX_REQUEST_TOKENS`), named by its index."""
    if not 1 <= num_requests <= MAX_NUM_REQUESTS:
        raise ValueError(f"num_requests must be between 1 and {MAX_NUM_REQUESTS:,}, "
                         f"got {num_requests}")
    workload = make_workload(family, **params)
    return _replayable(workload, workload.stream(num_requests, random.Random(seed)))


def _replayable(workload, requests: Iterator[SyntheticRequest]) -> Iterator[SyntheticRequest]:
    """``requests``, each checked to be within what ``prefixcache replay`` reads: a trace
    it would refuse is not written at all."""
    for index, request in enumerate(requests):
        input_length, output_length = request.input_length, request.output_length
        if input_length <= MAX_REQUEST_TOKENS and output_length <= MAX_REQUEST_TOKENS:
            yield request
            continue
        if output_length > MAX_REQUEST_TOKENS:
            lower = "output_tokens"
        else:
            names = [f.name for f in dataclasses.fields(workload)
                     if f.name.endswith("_tokens") and f.name != "output_tokens"]
            names += [name for name in ("follow_up_probability", "max_context_tokens")
                      if hasattr(workload, name)]
            lower = ", ".join(names) or "the prompts' token lengths"
        raise ValueError(
            f"{workload.name}: request {index:,} (counting from 0) has input_length "
            f"{input_length:,} and output_length {output_length:,}, over the "
            f"{MAX_REQUEST_TOKENS:,} tokens per request that prefixcache replay reads: "
            f"these parameters make requests too long for the replayer; lower {lower}")


__all__ = [
    "MAX_NUM_REQUESTS",
    "TRACE_FORMATS",
    "WORKLOAD_FAMILIES",
    "AgentWorkload",
    "BlockIdInterner",
    "ChatWorkload",
    "MixtureWorkload",
    "RAGWorkload",
    "SyntheticRequest",
    "TenantsWorkload",
    "generate_requests",
    "make_workload",
    "stream_requests",
    "write_trace",
]
