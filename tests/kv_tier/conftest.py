from __future__ import annotations

import pytest

from prefixcache.kv_tier.local_redis import NO_REDIS_REASON, RedisServer, find_redis_server


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server for one test (skipped, saying why, when there is none)."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip(NO_REDIS_REASON)
    server = RedisServer(binary, tmp_path)
    yield server
    server.stop()


from tests.torch_threads import single_torch_thread  # noqa: E402, F401 - an autouse fixture
