"""``prefixcache events``: watch an engine's KV-cache events, for operators.

Prints each batch as it arrives: readable text by default, one JSON object per batch with
``--json`` (hashes that are raw bytes are written as hex strings).
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

from prefixcache.arg_types import non_negative_int, positive_float, positive_int

MAX_SEQ = 2**63 - 1  # sequence numbers travel as signed 64-bit integers
MAX_TCP_PORT = 65535
_DECIMAL = re.compile(r"[0-9]+")

DESCRIPTION = """\
Subscribe to a prefixcache (or vLLM) KV-cache event stream and print each batch.

A batch is one engine step's events: BlockStored (blocks became cached: their hashes,
parent hash, tokens), BlockRemoved (hashes evicted) and AllBlocksCleared (prefix cache
reset). With --replay-endpoint and --from-seq, batches still buffered by the engine from
that sequence number on are printed first, then the live stream continues without
duplicates; with --replay-endpoint alone, gaps in the live stream are filled from replay.
Stops after --count batches, after --timeout seconds without one, or on Ctrl-C.
"""

EPILOG = """\
examples:
  prefixcache events tcp://127.0.0.1:5557
  prefixcache events tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --from-seq 0
  prefixcache events ipc:///tmp/kv-events --json --count 10
"""


def _sequence_number(text: str) -> int:
    """A batch sequence number: 0 .. 2**63 - 1."""
    value = non_negative_int(text)
    if value > MAX_SEQ:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_SEQ} (a signed 64-bit sequence number), got {text}")
    return value


def _endpoint(text: str) -> str:
    """A ZMQ endpoint whose tcp port, if any, is a number 0..65535 or '*'.

    libzmq accepts a larger port and retries the connection for ever, so it is checked
    here; other malformed addresses libzmq itself rejects when the socket opens.
    """
    transport, sep, address = text.partition("://")
    if sep and transport == "tcp":
        _, colon, port_text = address.rpartition(":")
        if colon and port_text != "*" and (_DECIMAL.fullmatch(port_text) is None
                                           or int(port_text) > MAX_TCP_PORT):
            raise argparse.ArgumentTypeError(
                f"{text!r}: the port must be a number in 0..{MAX_TCP_PORT} or '*', "
                f"got {port_text!r}")
    return text


def _tcp_host(endpoint: str) -> str | None:
    """The host a tcp ``endpoint`` connects to (libzmq's ``source;host:port`` form
    included), or None: not tcp, or ``*``."""
    transport, sep, address = endpoint.partition("://")
    if not sep or transport != "tcp":
        return None
    host = address.rpartition(";")[2].rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return None if host in ("", "*") else host


def _why_unreachable(endpoint: str) -> str | None:
    """Why a connection to ``endpoint`` can never succeed, or None. libzmq resolves host
    names in the background and retries a failed lookup for ever, so a mistyped host
    would otherwise look like an engine that publishes nothing."""
    host = _tcp_host(endpoint)
    if host is None:
        return None
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a host name"
        return f"cannot resolve the host {host!r} of {endpoint}: {reason}"
    return None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "events",
        help="print an engine's KV-cache events (vLLM-compatible ZMQ stream)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("endpoint", type=_endpoint,
                        help="the engine's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--topic", default="",
                        help="only batches whose topic starts with this (default: all)")
    parser.add_argument("--replay-endpoint", type=_endpoint, default=None, metavar="E",
                        help="the engine's replay (ROUTER) endpoint, to fetch missed batches")
    parser.add_argument("--from-seq", type=_sequence_number, default=None, metavar="N",
                        help="first print buffered batches from sequence number N "
                             "(needs --replay-endpoint)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per batch instead of readable text")
    parser.add_argument("--count", type=positive_int, default=None, metavar="N",
                        help="exit after printing N batches")
    parser.add_argument("--timeout", type=positive_float, default=None, metavar="SECONDS",
                        help="exit with status 1 if no batch arrives for this long; "
                             "also bounds the wait for a --from-seq replay (default 2 s)")
    parser.add_argument("--bind", action="store_true",
                        help="bind ENDPOINT instead of connecting (when the engine connects)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand; returns the process exit code."""
    if args.from_seq is not None and args.replay_endpoint is None:
        print("prefixcache events: --from-seq needs --replay-endpoint", file=sys.stderr)
        return 2
    for endpoint, connects in ((args.endpoint, not args.bind), (args.replay_endpoint, True)):
        reason = _why_unreachable(endpoint) if endpoint is not None and connects else None
        if reason is not None:
            print(f"prefixcache events: {reason}", file=sys.stderr)
            return 2

    import zmq

    from prefixcache.events.subscriber import EventSubscriber

    out = sys.stdout
    num_printed = 0
    try:
        subscriber = EventSubscriber(args.endpoint, topic=args.topic,
                                     replay_endpoint=args.replay_endpoint, bind=args.bind)
    except zmq.ZMQError as exc:  # a malformed address, or --bind on a taken port
        print(f"prefixcache events: cannot open the endpoint: {exc}", file=sys.stderr)
        return 2
    try:
        if args.from_seq is not None:
            try:
                # Without --timeout, the subscriber's own bound on a replay applies.
                wait = {} if args.timeout is None else {"timeout_s": args.timeout}
                replayed = subscriber.catch_up(args.from_seq, **wait)
            except TimeoutError as exc:
                print(f"prefixcache events: {exc}", file=sys.stderr)
                return 1
            for received in replayed:
                if args.count is not None and num_printed >= args.count:
                    return 0
                print_batch(received, args.json, out)
                num_printed += 1
        # Poll in short slices so Ctrl-C is handled promptly and --timeout is honoured.
        idle_s = 0.0
        while args.count is None or num_printed < args.count:
            received_batches = subscriber.receive(timeout_s=0.2)
            if not received_batches:
                idle_s += 0.2
                if args.timeout is not None and idle_s >= args.timeout:
                    print(f"prefixcache events: no batch for {args.timeout:g}s",
                          file=sys.stderr)
                    return 1
                continue
            idle_s = 0.0
            for received in received_batches:
                if args.count is not None and num_printed >= args.count:
                    break
                print_batch(received, args.json, out)
                num_printed += 1
        return 0
    except KeyboardInterrupt:
        # The operator stopping the watch is the normal way out, not an error trace.
        print(f"\nprefixcache events: stopped after {num_printed} batches "
              f"({subscriber.num_missed_batches} missed)", file=sys.stderr)
        return 130
    finally:
        subscriber.close()


def print_batch(received, as_json: bool, out: TextIO) -> None:
    """Write one received batch to ``out`` in the chosen format and flush."""
    if as_json:
        out.write(format_batch_json(received) + "\n")
    else:
        out.write(format_batch_text(received))
    out.flush()


def format_batch_json(received) -> str:
    import msgspec

    batch = received.batch
    document = {
        "seq": received.seq,
        "replayed": received.is_replay,
        "ts": batch.ts,
        "data_parallel_rank": batch.data_parallel_rank,
        "events": [_hex_bytes(msgspec.to_builtins(event, builtin_types=(bytes,)))
                   for event in batch.events],
    }
    return msgspec.json.encode(document).decode()


def _hex_bytes(value: Any) -> Any:
    # JSON has no bytes; hex is what operators compare hashes by.
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _hex_bytes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_hex_bytes(v) for v in value]
    return value


def format_batch_text(received) -> str:
    """A header line per batch, then one indented line per event."""
    from prefixcache.events.wire import AllBlocksCleared, BlockRemoved, BlockStored

    batch = received.batch
    when = datetime.fromtimestamp(batch.ts, tz=timezone.utc).isoformat(timespec="milliseconds")
    source = " (replayed)" if received.is_replay else ""
    lines = [f"seq {received.seq}{source}  {when}  dp_rank={batch.data_parallel_rank}  "
             f"{len(batch.events)} event(s)"]
    for event in batch.events:
        if isinstance(event, BlockStored):
            line = (f"  BlockStored      {len(event.block_hashes)} block(s) of "
                    f"{event.block_size}  parent={_short(event.parent_block_hash)}  "
                    f"hashes={_hash_list(event.block_hashes)}  "
                    f"tokens={_token_preview(event.token_ids)}  medium={event.medium}")
            if event.lora_name is not None or event.lora_id is not None:
                line += f"  lora={event.lora_name}({event.lora_id})"
            if event.extra_keys is not None:
                line += f"  extra_keys={event.extra_keys}"
        elif isinstance(event, BlockRemoved):
            line = (f"  BlockRemoved     {len(event.block_hashes)} block(s)  "
                    f"hashes={_hash_list(event.block_hashes)}  medium={event.medium}")
        elif isinstance(event, AllBlocksCleared):
            line = "  AllBlocksCleared"
        else:  # pragma: no cover - the decoder admits only the three types
            line = f"  {event!r}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _short(block_hash) -> str:
    if block_hash is None:
        return "-"
    if isinstance(block_hash, bytes):
        return block_hash.hex()[:16]
    return f"{block_hash:016x}"


def _hash_list(block_hashes, limit: int = 4) -> str:
    shown = ",".join(_short(h) for h in block_hashes[:limit])
    more = f",+{len(block_hashes) - limit}" if len(block_hashes) > limit else ""
    return f"[{shown}{more}]"


def _token_preview(token_ids, limit: int = 8) -> str:
    shown = " ".join(str(t) for t in token_ids[:limit])
    more = f" ...({len(token_ids)})" if len(token_ids) > limit else ""
    return f"[{shown}{more}]"
