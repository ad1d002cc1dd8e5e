"""``prefixcache fleet``: N ``prefixcache serve`` replicas behind vllm-router, wired and watched.

What it runs, all on one host (docs/fleet.md shows the same topology across hosts):

0. With ``--kv-tier redis-local``, a redis-server of its own for the replicas to share
   (:mod:`.fleet_kv_tier`); any ``--kv-tier`` is handed to every replica.
1. ``--replicas N`` subprocesses ``prefixcache serve MODEL [SERVE OPTIONS]``, each on a free
   loopback port (or ``--replica-base-port P``: P, P+1, ...) with its own KV event PUB and
   replay endpoints. The model and every engine option are handed to each replica verbatim;
   they are parsed once here first, so a typo fails before anything starts.
2. Once every replica has printed its ready line (which names its HTTP and KV event
   addresses), ``vllm-router`` in front: ``--policy`` (``kv_aware`` gets one
   ``--kv-event-source`` and ``--kv-event-replay-source`` per replica, the block size and
   the served model name), health checks every ``--health-check-interval`` seconds, and
   anything given with ``--router-arg``.
3. When the router answers ``/health``, one line on stdout: ``fleet ready: ROUTER_URL``.

Then it waits. Ctrl-C or SIGTERM stops the router, then the replicas (each gets SIGINT
and a bounded wait, then SIGKILL), then the fleet's redis-server, and so does any part
exiting on its own: a fleet with a dead part is stopped as a whole, never left half up.
Exit code 0 after a requested stop (130 for Ctrl-C), 1 when a part died or did not come
up, 2 for bad options, a missing ``vllm-router`` (``pip install 'prefixcache[fleet]'``) or,
for ``redis-local``, a missing redis-server.

Every child (a :class:`~prefixcache.entrypoints.fleet_part.Part`) logs to stderr, each line
tagged ``[replica i]``, ``[router]`` or ``[redis]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from prefixcache.arg_types import port, positive_float, positive_int
from prefixcache.entrypoints import fleet_kv_tier
from prefixcache.entrypoints.fleet_part import Part
from prefixcache.ports import free_loopback_port

POLICIES = ("kv_aware", "cache_aware", "round_robin")
INSTALL_HINT = "pip install 'prefixcache[fleet]'"
# Flags the fleet sets on each replica itself; given among the serve options they would
# break the wiring, so they are refused there.
FLEET_OWNED_SERVE_FLAGS = ("--host", "--port", "--kv-events-endpoint",
                           "--kv-events-replay-endpoint", "--data-parallel-rank")
_READY = re.compile(r"ready: serving \S+ at (http://\S+) \(.*KV events on (tcp://[^,\s)]+), "
                    r"replay on (tcp://[^,\s)]+)\)")
MAX_PORT = 65535
_POLL_S = 0.1

DESCRIPTION = """\
Start N prefixcache serve replicas and vllm-router in front of them, with the replicas' KV
cache events wired to the router, so each request goes to the replica that already holds
its prefix (--policy kv_aware). Prints the router's URL once everything is healthy; Ctrl-C
stops everything.

Everything after the fleet's own options is passed to every replica verbatim: the model
(a Hugging Face folder or .gguf file; default: the bundled SmolLM2) and any prefixcache
serve option (--block-size, --num-kv-blocks, --served-model-name, --api-key, ...), except
the ones the fleet sets itself (--host, --port, --kv-events-*, --data-parallel-rank).
Put -- before them when the first one is an option.

With --kv-tier every replica shares one KV tier: a prefix computed on one replica is
loaded by the others instead of recomputed, whatever replica the router picks.

Needs vllm-router (the vLLM project's router): pip install 'prefixcache[fleet]'.
"""

EPILOG = """\
examples:
  prefixcache fleet --replicas 3                       # 3 x SmolLM2, router on :8000
  prefixcache fleet --replicas 2 --policy round_robin ./my-model --block-size 16
  prefixcache fleet --port 9000 -- --num-kv-blocks 4096 --max-num-seqs 32
  prefixcache fleet --replicas 3 --kv-tier redis-local     # + a shared redis-server
  prefixcache fleet --kv-tier redis://10.0.0.5:6379/0 -- --kv-tier-timeout 0.5
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "fleet", help="N serve replicas behind vllm-router, placed by their KV events",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=positive_int, default=2, metavar="N",
                        help="number of replicas (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the router binds (default: %(default)s)")
    parser.add_argument("--port", type=port, default=8000,
                        help="port the router binds (default: %(default)s)")
    parser.add_argument("--policy", choices=POLICIES, default="kv_aware",
                        help="the router's policy: kv_aware places by the replicas' KV "
                             "events, cache_aware by the router's own guess from request "
                             "text, round_robin ignores caches (default: %(default)s)")
    parser.add_argument("--replica-host", default="127.0.0.1",
                        help="address the replicas bind and the router reaches them at "
                             "(default: %(default)s)")
    parser.add_argument("--replica-base-port", type=port, default=0, metavar="P",
                        help="replica i serves HTTP on P+i; 0 picks free ports "
                             "(default: %(default)s)")
    parser.add_argument("--kv-events-base-port", type=port, default=0, metavar="P",
                        help="replica i publishes KV events on P+2i and answers replay on "
                             "P+2i+1; 0 picks free ports (default: %(default)s)")
    parser.add_argument("--health-check-interval", type=positive_int, default=5,
                        metavar="S",
                        help="seconds between the router's health checks; a replica "
                             "failing two in a row leaves the rotation (default: %(default)s)")
    parser.add_argument("--startup-timeout", type=positive_float, default=600.0,
                        metavar="S",
                        help="seconds to wait for every part to be healthy "
                             "(default: %(default)s)")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for vllm-router, after the fleet's own "
                             "(repeat it; e.g. --router-arg=--log-level=debug)")
    fleet_kv_tier.add_cli_args(parser)
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="MODEL/SERVE OPTIONS",
                        help="passed to every replica's prefixcache serve")
    parser.set_defaults(func=run)


# ---- plan: everything checked and decided before anything starts ------------------------


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """What the fleet must know of the replicas' own options."""

    served_model_name: str
    block_size: int


def parse_serve_args(serve_args: list[str]) -> ServeSettings:
    """Validate ``serve_args`` with ``prefixcache serve``'s own parser.

    Raises ValueError for a flag the fleet owns or a log level that hides the ready line;
    argparse exits (code 2, its message on stderr) for anything serve would refuse.
    """
    from prefixcache.entrypoints.openai import serve_cmd

    for arg in serve_args:
        flag = arg.split("=", 1)[0]
        if flag in FLEET_OWNED_SERVE_FLAGS:
            raise ValueError(f"{flag} is set by the fleet for each replica; see "
                             "--replica-host, --replica-base-port and --kv-events-base-port")
    from prefixcache.engine.arg_utils import EngineArgs, KVEventsArgs
    from prefixcache.entrypoints.openai.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="prefixcache fleet")
    serve_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["serve", *serve_args])
    # What serve checks after parsing, so a bad value fails here, before anything starts.
    server_args = ServerArgs.from_cli_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    KVEventsArgs.from_cli_args(args)
    if server_args.log_level not in ("debug", "info"):
        raise ValueError("the fleet reads each replica's ready line: use --log-level info "
                         "or debug for the replicas")
    names = serve_cmd.served_model_names(server_args, engine_args.model)
    return ServeSettings(names[0], engine_args.block_size)


@dataclass(frozen=True, slots=True)
class ReplicaAddress:
    """Where one ready replica serves and publishes (read from its ready line)."""

    url: str
    kv_events_endpoint: str
    replay_endpoint: str


def replica_command(serve_args: list[str], host: str, http_port: int,
                    kv_events_port: int, replay_port: int) -> list[str]:
    """The ``prefixcache serve`` command of one replica (port 0: the OS picks one)."""
    def endpoint(port_number: int) -> str:
        return f"tcp://{host}:{port_number or '*'}"

    return [sys.executable, "-m", "prefixcache", "serve", *serve_args,
            "--host", host, "--port", str(http_port),
            "--kv-events-endpoint", endpoint(kv_events_port),
            "--kv-events-replay-endpoint", endpoint(replay_port)]


def router_command(replicas: list[ReplicaAddress], *, policy: str, host: str, port_number: int,
                   prometheus_port: int, block_size: int, served_model_name: str,
                   health_check_interval_s: int = 5, extra_args: list[str] = ()) -> list[str]:
    """The ``vllm-router`` command in front of ``replicas`` (run with this interpreter)."""
    command = [sys.executable, "-m", "vllm_router.launch_router",
               "--host", host, "--port", str(port_number), "--policy", policy,
               "--worker-urls", *[r.url for r in replicas],
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
               "--health-check-interval-secs", str(health_check_interval_s),
               "--health-failure-threshold", "2", "--health-success-threshold", "1",
               "--log-level", "warning"]
    if policy == "kv_aware":
        for replica in replicas:
            command += ["--kv-event-source", f"{replica.url}={replica.kv_events_endpoint}",
                        "--kv-event-replay-source", f"{replica.url}={replica.replay_endpoint}"]
        command += ["--kv-event-block-size", str(block_size),
                    "--kv-event-model", served_model_name]
    return command + list(extra_args)


def has_vllm_router() -> bool:
    return importlib.util.find_spec("vllm_router") is not None


# ---- running the parts ------------------------------------------------------------------


class FleetStopped(Exception):
    """A stop was asked for (SIGTERM), or a part died; ``exit_code`` says which."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(slots=True)
class Fleet:
    """The running parts; ``stop()`` ends them all: router, replicas, then the tier."""

    replicas: list[Part] = field(default_factory=list)
    router: Part | None = None
    kv_tier: Part | None = None  # the fleet's own redis-server

    @property
    def parts(self) -> list[Part]:
        return [part for part in (self.router, *self.replicas, self.kv_tier)
                if part is not None]

    def check_alive(self) -> None:
        for part in self.parts:
            code = part.process.poll()
            if code is not None:
                raise FleetStopped(f"{part.name} exited with code {code}; stopping the fleet",
                                   1)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop(signal.SIGTERM)
        # Replicas stop in parallel: each finishes its requests and closes its publisher.
        threads = [threading.Thread(target=replica.stop) for replica in self.replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # Last: replicas flush their tier writes as they stop.
        if self.kv_tier is not None:
            self.kv_tier.stop(signal.SIGTERM)


def _wait_for_ready_line(part: Part, fleet: Fleet, deadline: float) -> ReplicaAddress:
    seen = 0
    while time.monotonic() < deadline:
        lines = part.lines
        for line in lines[seen:]:
            match = _READY.search(line)
            if match:
                return ReplicaAddress(*match.groups())
        seen = len(lines)
        fleet.check_alive()
        time.sleep(_POLL_S)
    raise FleetStopped(f"{part.name} was not ready in time; stopping the fleet", 1)


def wait_until_healthy(url: str, deadline: float, check_alive=lambda: None) -> bool:
    """Poll ``url``/health until it answers 200 (True) or ``deadline`` passes (False);
    ``check_alive`` runs before each try and may raise to stop waiting."""
    import httpx

    while time.monotonic() < deadline:
        check_alive()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def _on_sigterm(signum, frame) -> None:
    raise FleetStopped("stopping the fleet (SIGTERM)", 0)


def run(args: argparse.Namespace) -> int:
    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    if not has_vllm_router():
        print("prefixcache fleet: vllm-router is not installed; get it with "
              f"{INSTALL_HINT}", file=sys.stderr)
        return 2
    try:
        tier = fleet_kv_tier.plan_kv_tier(args.kv_tier, args.redis_maxmemory, serve_args)
        serve_args += tier.replica_args()
        settings = parse_serve_args(serve_args)
    except ValueError as exc:
        print(f"prefixcache fleet: {exc}", file=sys.stderr)
        return 2
    try:
        ports = _replica_ports(args)
    except ValueError as exc:
        print(f"prefixcache fleet: {exc}", file=sys.stderr)
        return 2
    fleet = Fleet()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        deadline = time.monotonic() + args.startup_timeout
        if tier.local_redis_command is not None:
            _start_local_redis(fleet, tier, deadline)
        for index, (http_port, events_port, replay_port) in enumerate(ports):
            command = replica_command(serve_args, args.replica_host, http_port, events_port,
                                      replay_port)
            fleet.replicas.append(Part.start(f"replica {index}", command))
        addresses = [_wait_for_ready_line(part, fleet, deadline) for part in fleet.replicas]
        router_url = f"http://{args.host}:{args.port}"
        fleet.router = Part.start("router", router_command(
            addresses, policy=args.policy, host=args.host, port_number=args.port,
            prometheus_port=free_loopback_port(), block_size=settings.block_size,
            served_model_name=settings.served_model_name,
            health_check_interval_s=args.health_check_interval,
            extra_args=args.router_arg))
        if not wait_until_healthy(router_url, deadline, fleet.check_alive):
            raise FleetStopped("the router did not answer /health in time; stopping the "
                               "fleet", 1)
        tier_text = f", KV tier {tier.url}" if tier.url is not None else ""
        print(f"fleet ready: {router_url} ({len(addresses)} replicas of "
              f"{settings.served_model_name}, policy {args.policy}: "
              f"{' '.join(a.url for a in addresses)}{tier_text})", flush=True)
        while True:
            fleet.check_alive()
            time.sleep(_POLL_S * 5)
    except FleetStopped as exc:
        print(f"prefixcache fleet: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        # Ctrl-C (KeyboardInterrupt) passes through here too; the CLI turns it into 130.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fleet.stop()
        signal.signal(signal.SIGTERM, previous)


def _start_local_redis(fleet: Fleet, tier: fleet_kv_tier.KVTierPlan, deadline: float
                       ) -> None:
    from prefixcache.kv_tier.local_redis import wait_until_answering

    fleet.kv_tier = Part.start("redis", tier.local_redis_command)
    if not wait_until_answering(tier.local_redis_port, deadline,
                                lambda: fleet.kv_tier.is_running):
        fleet.check_alive()
        raise FleetStopped(f"redis-server did not answer on port {tier.local_redis_port} in "
                           "time; stopping the fleet", 1)


def _replica_ports(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(http, kv events, replay) ports of each replica; 0 leaves the choice to the OS."""
    ports = []
    for index in range(args.replicas):
        http_port = args.replica_base_port + index if args.replica_base_port else 0
        events_port = args.kv_events_base_port + 2 * index if args.kv_events_base_port else 0
        replay_port = events_port + 1 if events_port else 0
        if max(http_port, replay_port) > MAX_PORT:
            raise ValueError(f"replica {index} would need a port above {MAX_PORT}; lower "
                             "--replica-base-port or --kv-events-base-port")
        ports.append((http_port, events_port, replay_port))
    return ports
