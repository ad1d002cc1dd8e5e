"""Admission of generation requests: fairness between tenants, and draining at shutdown.

A generation request is admitted once it is parsed and authenticated, before any
tokenizing, and holds its :class:`Ticket` until its response ends (however it ends). It
is refused with

* **429** (``Retry-After``) when its tenant already holds ``max_requests_per_tenant``
  engine requests, counting the new request's own (``prompts x n``): running and waiting
  ones alike, so one tenant cannot fill the engine's queue and delay every other tenant;
* **503** once the server is draining (``--shutdown-timeout`` after SIGTERM).

Per-tenant figures are declared once, as the fields of :class:`TenantStats` (as the
engine's are in :class:`~prefixcache.engine.stats.EngineStats`); ``/metrics`` shows each
as ``prefixcache:<metric>{tenant="..."}``, one series per tenant of the key file (a
bounded label set: tenants are never taken from requests).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prefixcache.engine.stats import COUNTER, GAUGE, stat
from prefixcache.entrypoints.openai.errors import APIError

RETRY_AFTER_S = 1


@dataclass(slots=True)
class TenantStats:
    """One tenant's admission figures: counters since the server started, and the engine
    requests it holds now."""

    requests_admitted: int = stat(
        COUNTER, "API requests admitted, by tenant.", metric="tenant_requests_admitted")
    requests_rejected: int = stat(
        COUNTER, "API requests refused with 429 (the tenant's limit), by tenant.",
        metric="tenant_requests_rejected")
    num_requests: int = stat(
        GAUGE, "Engine requests (running, waiting or being prepared) a tenant holds now.",
        metric="tenant_num_requests")


@dataclass(slots=True)
class Ticket:
    """One admitted request's hold on its tenant's share (``tenant_stats`` None: a request
    of no tenant); ``release`` is idempotent."""

    admission: Admission
    tenant_stats: TenantStats | None
    num_requests: int
    is_released: bool = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.admission._release(self)


class Admission:
    """The admission gate of one server (see the module docstring).

    ``tenants`` are the key file's (empty in open mode, where only draining applies); a
    request admitted for a tenant names one of them.
    """

    def __init__(self, tenants: tuple[str, ...], max_requests_per_tenant: int | None) -> None:
        self.max_requests_per_tenant = max_requests_per_tenant
        self.tenant_to_stats = {tenant: TenantStats() for tenant in tenants}
        self.num_tickets = 0
        self.is_draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self, tenant: str | None, num_requests: int) -> Ticket:
        """A ticket for ``num_requests`` engine requests of ``tenant``, or APIError 429 /
        503 (checked first: a draining server admits nobody)."""
        if self.is_draining:
            raise APIError(503, "the server is shutting down", code="engine_unavailable")
        stats = None if tenant is None else self.tenant_to_stats[tenant]
        if stats is not None:
            held, limit = stats.num_requests, self.max_requests_per_tenant
            if limit is not None and held + num_requests > limit:
                stats.requests_rejected += 1
                raise TooManyRequests(
                    f"tenant '{tenant}' has {held} requests running or waiting; this one "
                    f"would add {num_requests}, past its limit of {limit}")
            stats.requests_admitted += 1
            stats.num_requests = held + num_requests
        self.num_tickets += 1
        self._idle.clear()
        return Ticket(self, stats, num_requests)

    def _release(self, ticket: Ticket) -> None:
        if ticket.tenant_stats is not None:
            ticket.tenant_stats.num_requests -= ticket.num_requests
        self.num_tickets -= 1
        if self.num_tickets == 0:
            self._idle.set()

    def start_draining(self) -> None:
        """Refuse every request from now on (503); those admitted go on."""
        self.is_draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no admitted request remains, at most ``timeout_s``; True if none
        does."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class TooManyRequests(APIError):
    """429 with ``Retry-After``."""

    def __init__(self, message: str) -> None:
        super().__init__(429, message, code="rate_limit_exceeded")
        self.headers = {"Retry-After": str(RETRY_AFTER_S)}
