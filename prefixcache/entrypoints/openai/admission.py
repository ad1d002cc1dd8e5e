"""Admission of generation requests: fairness between tenants, and draining at shutdown.

A generation request is admitted once it is parsed and authenticated, before any
tokenizing, and holds its :class:`Ticket` until its response ends (however it ends). It
is refused with

* **429** (``Retry-After``) when its tenant already holds ``max_requests_per_tenant``
  engine requests, counting the new request's own (``prompts x n``): running and waiting
  ones alike, so one tenant cannot fill the engine's queue and delay every other tenant;
* **503** once the server is draining (``--shutdown-timeout`` after SIGTERM).

Per-tenant figures go to ``/metrics``, one series per tenant of the key file (a bounded
label set: tenants are never taken from requests)::

    prefixcache:tenant_requests_admitted_total{tenant}   counter  API requests admitted
    prefixcache:tenant_requests_rejected_total{tenant}   counter  refused with 429
    prefixcache:tenant_num_requests{tenant}              gauge    engine requests held now
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixcache.entrypoints.openai.errors import APIError

PREFIX = "prefixcache:"
RETRY_AFTER_S = 1


@dataclass(slots=True)
class Ticket:
    """One admitted request's hold on its tenant's share; ``release`` is idempotent."""

    admission: Admission
    tenant: str | None
    num_requests: int
    is_released: bool = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.admission._release(self)


class Admission:
    """The admission gate of one server (see the module docstring).

    ``tenants`` are the key file's (empty in open mode, where only draining applies).
    """

    def __init__(self, tenants: tuple[str, ...], max_requests_per_tenant: int | None,
                 registry: CollectorRegistry) -> None:
        self.max_requests_per_tenant = max_requests_per_tenant
        self.tenant_to_num_requests: dict[str | None, int] = {t: 0 for t in tenants}
        self.num_tickets = 0
        self.is_draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._admitted = Counter(PREFIX + "tenant_requests_admitted",
                                 "API requests admitted, by tenant.", labelnames=("tenant",),
                                 registry=registry)
        self._rejected = Counter(PREFIX + "tenant_requests_rejected",
                                 "API requests refused with 429 (the tenant's limit), by tenant.",
                                 labelnames=("tenant",), registry=registry)
        self._held = Gauge(PREFIX + "tenant_num_requests",
                           "Engine requests (running, waiting or being prepared) a tenant "
                           "holds now.", labelnames=("tenant",), registry=registry)
        for tenant in tenants:  # present from the start, so rates work at zero
            self._admitted.labels(tenant=tenant)
            self._rejected.labels(tenant=tenant)
            self._held.labels(tenant=tenant)

    def admit(self, tenant: str | None, num_requests: int) -> Ticket:
        """A ticket for ``num_requests`` engine requests of ``tenant``, or APIError 429 /
        503 (checked first: a draining server admits nobody)."""
        if self.is_draining:
            raise APIError(503, "the server is shutting down", code="engine_unavailable")
        held = self.tenant_to_num_requests.get(tenant, 0)
        limit = self.max_requests_per_tenant
        if tenant is not None and limit is not None and held + num_requests > limit:
            self._rejected.labels(tenant=tenant).inc()
            raise TooManyRequests(
                f"tenant '{tenant}' has {held} requests running or waiting; this one "
                f"would add {num_requests}, past its limit of {limit}")
        self.tenant_to_num_requests[tenant] = held + num_requests
        self.num_tickets += 1
        self._idle.clear()
        if tenant is not None:
            self._admitted.labels(tenant=tenant).inc()
            self._held.labels(tenant=tenant).set(held + num_requests)
        return Ticket(self, tenant, num_requests)

    def _release(self, ticket: Ticket) -> None:
        held = self.tenant_to_num_requests[ticket.tenant] - ticket.num_requests
        self.tenant_to_num_requests[ticket.tenant] = held
        self.num_tickets -= 1
        if ticket.tenant is not None:
            self._held.labels(tenant=ticket.tenant).set(held)
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
