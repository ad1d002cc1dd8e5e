"""The real vllm-router (``kv_aware``) in front of real replicas, wired as ``fleet`` wires them.

Replicas are ``prefixcache serve`` on the tiny random model, on fixed free loopback ports
(so a replica can be restarted where the router expects it); the router command is the
fleet's own (``fleet.router_command``). Which replica served a request shows in its
``cached_tokens``: only the replica holding the document's blocks can report them.
"""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import time

import httpx
import pytest

from prefixcache.entrypoints.fleet import (
    ReplicaAddress,
    router_command,
    wait_until_healthy,
)
from prefixcache.events.subscriber import EventSubscriber
from prefixcache.events.wire import BlockStored
from prefixcache.ports import free_loopback_port
from tests.entrypoints.conftest import MODEL_NAME, ServerProcess
from tests.processes import free_loopback_ports

BLOCK_SIZE = 16
REPLICA_ARGS = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "256",
                "--max-num-seqs", "16")
ROUTER_TIMEOUT_S = 60
WORDS = ("fox", "dog", "breeze", "leaves", "children", "prefix", "blocks", "tokens",
         "salts", "tenants", "requests", "value", "key", "world", "hello", "gentle")


def document(index: int) -> str:
    """A distinct document of ~40 words (a few hundred tokens for the tiny tokenizer)."""
    words = [WORDS[(index * 7 + k * (index + 3)) % len(WORDS)] for k in range(40)]
    return f"Document {index}: " + " ".join(words) + "."


class Replica:
    """A serve process on fixed ports, restartable in place."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        http_port, events_port, replay_port = free_loopback_ports(3)
        self.address = ReplicaAddress(f"http://127.0.0.1:{http_port}",
                                      f"tcp://127.0.0.1:{events_port}",
                                      f"tcp://127.0.0.1:{replay_port}")
        self.args = (*REPLICA_ARGS, "--port", str(http_port),
                     "--kv-events-endpoint", self.address.kv_events_endpoint,
                     "--kv-events-replay-endpoint", self.address.replay_endpoint)
        self.process: ServerProcess | None = None
        self.start()

    def start(self) -> None:
        self.process = ServerProcess(self.model_dir, *self.args)

    def stored_token_prefixes(self) -> list[list[int]]:
        """Token ids of every BlockStored this replica has published (its replay)."""
        with EventSubscriber(self.address.kv_events_endpoint,
                             replay_endpoint=self.address.replay_endpoint) as sub:
            batches = sub.replay(0, timeout_s=10)
        return [e.token_ids for b in batches for e in b.batch.events
                if isinstance(e, BlockStored)]


class Router:
    def __init__(self, replicas: list[Replica]) -> None:
        self.url = f"http://127.0.0.1:{free_loopback_port()}"
        command = router_command([r.address for r in replicas], policy="kv_aware",
                                 host="127.0.0.1", port_number=int(self.url.rsplit(":", 1)[1]),
                                 prometheus_port=free_loopback_port(), block_size=BLOCK_SIZE,
                                 served_model_name=MODEL_NAME, health_check_interval_s=1)
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        def check_alive() -> None:
            assert self.process.poll() is None, "vllm-router exited"

        assert wait_until_healthy(self.url, time.monotonic() + ROUTER_TIMEOUT_S, check_alive), \
            "vllm-router never became healthy"

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def fleet(tiny_model_dir):
    replicas = [Replica(tiny_model_dir), Replica(tiny_model_dir)]
    router = None
    try:
        router = Router(replicas)
        yield router, replicas
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.process.stop()


def complete(http: httpx.Client, prompt: str) -> dict:
    response = http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def wait_until_published(replicas: list[Replica], http: httpx.Client, prompts: list[str]):
    """Until some replica has published the first block of every prompt."""
    firsts = [http.post("/tokenize", json={"prompt": p}).json()["tokens"][:BLOCK_SIZE]
              for p in prompts]
    deadline = time.monotonic() + 30
    while True:
        stored = [t[:BLOCK_SIZE] for r in replicas for t in r.stored_token_prefixes()]
        if all(first in stored for first in firsts):
            return
        assert time.monotonic() < deadline, "the replicas never published the documents"
        time.sleep(0.05)


def test_concurrent_follow_ups_land_where_their_document_is_cached(fleet):
    """Documents placed one per replica, then their follow-ups through the router two at a
    time, one per replica, with no pause after the documents: each lands on its document's
    replica. (vllm-router's kv_aware cost multiplies a worker's uncached tokens in flight by
    its number of requests in flight plus one, so follow-ups of short documents on the
    *same* replica in flight together may split; docs/fleet.md.)"""
    router, replicas = fleet
    documents = [document(i) for i in range(6)]

    def send_direct(index: int) -> dict:
        with httpx.Client(base_url=replicas[index % 2].address.url, timeout=120) as direct:
            return complete(direct, documents[index])

    with httpx.Client(base_url=router.url, timeout=120) as http, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(send_direct, range(len(documents))))
        # No waiting: a replica publishes a step's blocks before it answers the step's
        # requests, so the router knows the documents by the time their follow-ups arrive.
        answers = []
        for question in range(2):
            for pair in range(0, len(documents), 2):
                prompts = [f"{documents[pair + k]} Question {question}: which {WORDS[k]}?"
                           for k in range(2)]
                answers += list(pool.map(lambda p: complete(http, p), prompts))
        doc_tokens = [http.post("/tokenize", json={"prompt": d}).json()["count"]
                      for d in documents]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    # Only the document's replica holds its blocks, so a follow-up that reuses the
    # document's full blocks (the last one may tokenize differently) landed there.
    for index, num_cached in enumerate(cached):
        num_doc_tokens = doc_tokens[index % len(documents)]
        assert num_cached >= (num_doc_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE, cached


def worker_health(http: httpx.Client) -> dict[str, bool]:
    return {w["url"]: w["is_healthy"] for w in http.get("/workers").json()["workers"]}


def wait_for_health(http: httpx.Client, url: str, healthy: bool) -> None:
    deadline = time.monotonic() + 60
    while worker_health(http).get(url) is not healthy:
        assert time.monotonic() < deadline, f"the router never saw {url} healthy={healthy}"
        time.sleep(0.1)


def test_a_killed_replica_leaves_the_rotation_and_a_restarted_one_is_reindexed(fleet):
    router, replicas = fleet
    killed = replicas[1]
    with httpx.Client(base_url=router.url, timeout=120) as http:
        killed.process.stop(signal.SIGKILL)
        # Requests succeed while the router finds out (it retries elsewhere) ...
        for index in range(4):
            complete(http, document(100 + index))
        wait_for_health(http, killed.address.url, healthy=False)
        # ... and once the replica is out of the rotation.
        for index in range(4, 8):
            complete(http, document(100 + index))

        killed.start()  # same ports: the router's static sources find it again
        wait_for_health(http, killed.address.url, healthy=True)
        fresh = document(200)
        with httpx.Client(base_url=killed.address.url, timeout=120) as direct:
            assert complete(direct, fresh)["usage"]["prompt_tokens_details"][
                "cached_tokens"] == 0
        wait_until_published([killed], http, [fresh])
        # Only the restarted replica holds the document: the router must have indexed the
        # new incarnation's events to send the follow-up there.
        answer = complete(http, f"{fresh} Question: which fox?")
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK_SIZE


def test_a_replica_killed_after_one_batch_leaves_no_stale_blocks_in_the_router(fleet):
    """Replica 1 caches a long document (one batch of blocks), is killed and restarted on
    the same ports; replica 0 then caches only the document's first part. A follow-up on
    the whole document must go to replica 0: a router still holding the dead replica's
    blocks would credit replica 1 with all of them. (With engines numbering their batches
    from 0, the restarted replica's first batch repeated the dead one's only number, the
    router dropped it as seen, and the dead blocks stayed.)"""
    router, replicas = fleet
    restarted, other = replicas[1], replicas[0]
    words = document(300).split() + document(301).split()
    long_doc, first_part = " ".join(words), " ".join(words[:len(words) // 3])
    with httpx.Client(base_url=router.url, timeout=120) as http:
        with httpx.Client(base_url=restarted.address.url, timeout=120) as direct:
            complete(direct, long_doc)
        wait_until_published([restarted], http, [long_doc])
        restarted.process.stop(signal.SIGKILL)
        restarted.start()
        wait_for_health(http, restarted.address.url, healthy=True)
        with httpx.Client(base_url=other.address.url, timeout=120) as direct:
            complete(direct, first_part)
        wait_until_published([other], http, [first_part])
        num_first_part = http.post("/tokenize", json={"prompt": first_part}).json()["count"]
        answer = complete(http, f"{long_doc} Question: which fox?")
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (num_first_part // BLOCK_SIZE - 1) * BLOCK_SIZE > 0, cached
