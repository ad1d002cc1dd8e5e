"""``endpoint_for_rank``: each data-parallel replica's KV event endpoint, from shared flags."""

from __future__ import annotations

import pytest

from prefixcache.events.endpoint import endpoint_for_rank


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:5557", "tcp://*:5557", "tcp://127.0.0.1:65535", "tcp://127.0.0.1:*",
    "ipc:///tmp/kv-events", "inproc://kv", "ws://127.0.0.1:5557", "bogus",
])
def test_rank_0_keeps_any_endpoint_exactly(endpoint):
    # Even ones rank > 0 refuses: an engine without data parallelism binds what it is given
    # and ZMQ alone judges the address, as before the rank existed.
    assert endpoint_for_rank(endpoint, 0) == endpoint


@pytest.mark.parametrize(("endpoint", "rank", "expected"), [
    ("tcp://127.0.0.1:5557", 1, "tcp://127.0.0.1:5558"),
    ("tcp://127.0.0.1:5557", 2, "tcp://127.0.0.1:5559"),
    ("tcp://*:5557", 3, "tcp://*:5560"),
    ("tcp://localhost:5557", 7, "tcp://localhost:5564"),
    ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
    ("tcp://eth0;192.168.1.1:5557", 1, "tcp://eth0;192.168.1.1:5558"),
    ("tcp://127.0.0.1:65534", 1, "tcp://127.0.0.1:65535"),  # the last port is allowed
])
def test_tcp_port_is_offset_by_the_rank(endpoint, rank, expected):
    assert endpoint_for_rank(endpoint, rank) == expected


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:*", "tcp://*:*", "tcp://127.0.0.1:0"])
def test_os_chosen_tcp_port_stays(endpoint):
    assert endpoint_for_rank(endpoint, 4) == endpoint


@pytest.mark.parametrize(("endpoint", "rank", "expected"), [
    ("ipc:///tmp/kv-events", 1, "ipc:///tmp/kv-events_dp1"),
    ("ipc://relative/kv", 12, "ipc://relative/kv_dp12"),
    ("inproc://kv-events", 2, "inproc://kv-events_dp2"),
])
def test_ipc_and_inproc_get_a_dp_suffix(endpoint, rank, expected):
    assert endpoint_for_rank(endpoint, rank) == expected


def test_ipc_path_chosen_by_zmq_stays():
    assert endpoint_for_rank("ipc://*", 2) == "ipc://*"


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:65535", "tcp://127.0.0.1:65534"])
def test_port_past_65535_is_refused(endpoint):
    with pytest.raises(ValueError) as excinfo:
        endpoint_for_rank(endpoint, 2)
    message = str(excinfo.value)
    assert endpoint in message and "rank 2" in message and "above 65535" in message


@pytest.mark.parametrize("endpoint", [
    "ws://127.0.0.1:5557",      # another ZMQ transport
    "pgm://eth0;239.1.1.1:5555",
    "bogus",                    # no transport at all
    "127.0.0.1:5557",
    "tcp://127.0.0.1",          # no port
    "tcp://:5557",              # no host
    "tcp://127.0.0.1:",
    "tcp://127.0.0.1:port",     # a service name, not a number
    "tcp://127.0.0.1:-5",
    "ipc://",                   # nothing to put the suffix on
    "inproc://",
])
def test_endpoints_the_rule_does_not_cover_are_refused_by_name(endpoint):
    with pytest.raises(ValueError) as excinfo:
        endpoint_for_rank(endpoint, 1)
    assert repr(endpoint) in str(excinfo.value)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "ipc:///tmp/kv", "bogus"])
def test_negative_rank_is_refused(endpoint):
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        endpoint_for_rank(endpoint, -1)
