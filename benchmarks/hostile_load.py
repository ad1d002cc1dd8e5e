"""A mixed, partly hostile load on a tenant-mode server, for ``serve_load.py --hostile``
and the soak test.

Clients, each looping until the deadline:

* **well-behaved** (tenant ``alice``): small completions, streamed and not, one at a
  time; every latency recorded, every failure kept;
* **flooding** (tenant ``bob``): long completions fired without pause, so it runs into
  its per-tenant limit (429s are expected and counted);
* **invalid** (tenant ``carol``): malformed JSON, JSON nested far too deep, an unknown
  model, a prompt over the byte limit, a wrong key;
* **vanishing** (tenant ``carol``): streams that are dropped after their first chunk.

Every answer's status is counted; a 5xx anywhere is a failure of the server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

KEYS = {"alice": "key-alice", "bob": "key-bob", "carol": "key-carol"}
# Idle connections are dropped by the client before the server's 5 s keep-alive timeout
# closes them: at equal timeouts a reused connection can be closed under the request.
KEEPALIVE_EXPIRY_S = 2.0


def key_file_text() -> str:
    return "".join(f"{key} {tenant}\n" for tenant, key in KEYS.items())


@dataclass
class LoadReport:
    """What a run saw; latencies in seconds."""

    well_behaved_latencies_s: list[float] = field(default_factory=list)
    well_behaved_failures: list[str] = field(default_factory=list)
    status_counts: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)

    def count(self, who: str, status: int, text: str = "") -> None:
        self.status_counts[f"{who}:{status}"] += 1
        if status >= 500:
            self.server_errors.append(f"{who}: {status} {text[:200]}")


def _headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def well_behaved(client: httpx.AsyncClient, model: str, deadline: float,
                       report: LoadReport, index: int, max_requests: int | None = None) -> None:
    for turn in itertools.count():
        if time.monotonic() >= deadline or turn == max_requests:
            return
        body = {"model": model, "prompt": f"client {index} asks question {turn}",
                "max_tokens": 8, "temperature": 0.0}
        start = time.monotonic()
        try:
            if turn % 2:
                async with client.stream("POST", "/v1/completions", headers=_headers("alice"),
                                         json={**body, "stream": True}) as response:
                    lines = [line async for line in response.aiter_lines() if line]
                ok = response.status_code == 200 and lines[-1:] == ["data: [DONE]"] \
                    and not any('"error"' in line for line in lines)
                detail = f"{response.status_code} {lines[-2:]}"
            else:
                response = await client.post("/v1/completions", headers=_headers("alice"),
                                             json=body)
                ok = response.status_code == 200 and response.json()["choices"]
                detail = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            ok, detail = False, repr(exc)
        report.well_behaved_latencies_s.append(time.monotonic() - start)
        if not ok:
            report.well_behaved_failures.append(detail)


async def flooding(client: httpx.AsyncClient, model: str, deadline: float,
                   report: LoadReport) -> None:
    body = {"model": model, "prompt": "flood " * 20, "max_tokens": 64, "ignore_eos": True}
    while time.monotonic() < deadline:
        try:
            response = await client.post("/v1/completions", headers=_headers("bob"), json=body)
        except httpx.HTTPError:
            continue
        report.count("bob", response.status_code, response.text)
        if response.status_code == 429:
            await asyncio.sleep(0.05)  # a tight flood, yet not a busy loop on a shared CPU


async def invalid(client: httpx.AsyncClient, model: str, deadline: float,
                  report: LoadReport, max_prompt_bytes: int) -> None:
    deep = b'{"prompt": ' + b"[" * 20_000 + b"1" + b"]" * 20_000 + b"}"
    bodies = [
        (b'{"prompt": "unterminated', _headers("carol")),
        (deep, _headers("carol")),
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), _headers("carol")),
        (json.dumps({"model": model, "prompt": "x" * (max_prompt_bytes + 1)}).encode(),
         _headers("carol")),
        (json.dumps({"model": model, "prompt": "x"}).encode(),
         {"Authorization": "Bearer wrong"}),
    ]
    for content, headers in itertools.cycle(bodies):
        if time.monotonic() >= deadline:
            return
        try:
            response = await client.post("/v1/completions", content=content,
                                         headers={**headers,
                                                  "Content-Type": "application/json"})
        except httpx.HTTPError:
            continue
        report.count("carol-invalid", response.status_code, response.text)


async def vanishing(client: httpx.AsyncClient, model: str, deadline: float,
                    report: LoadReport) -> None:
    body = {"model": model, "prompt": "a story", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    while time.monotonic() < deadline:
        try:
            async with client.stream("POST", "/v1/completions", headers=_headers("carol"),
                                     json=body) as response:
                report.count("carol-vanishing", response.status_code)
                async for _ in response.aiter_lines():
                    break  # gone after the first chunk
        except httpx.HTTPError:
            continue


async def run_mixed_load(url: str, model: str, duration_s: float, num_clients: int = 64,
                         max_prompt_bytes: int = 1024 * 1024) -> LoadReport:
    """Run the module's clients against ``url`` for ``duration_s``: a quarter
    well-behaved, three eighths flooding, the rest split between invalid and vanishing."""
    report = LoadReport()
    num_good = max(num_clients // 4, 1)
    num_flood = num_clients * 3 // 8
    num_invalid = (num_clients - num_good - num_flood) // 2
    num_vanish = num_clients - num_good - num_flood - num_invalid
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=num_clients + 4,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = [well_behaved(client, model, deadline, report, i) for i in range(num_good)]
        tasks += [flooding(client, model, deadline, report) for _ in range(num_flood)]
        tasks += [invalid(client, model, deadline, report, max_prompt_bytes)
                  for _ in range(num_invalid)]
        tasks += [vanishing(client, model, deadline, report) for _ in range(num_vanish)]
        await asyncio.gather(*tasks)
    return report


async def well_behaved_alone(url: str, model: str, num_requests_per_client: int,
                             num_clients: int) -> LoadReport:
    """The well-behaved clients with nobody else: the unloaded reference."""
    report = LoadReport()
    limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(well_behaved(client, model, float("inf"), report, i,
                                            max_requests=num_requests_per_client)
                               for i in range(num_clients)))
    return report
