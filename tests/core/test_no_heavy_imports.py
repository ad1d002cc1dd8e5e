"""prefixcache.core never imports torch or numpy (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    import prefixcache.core
    from prefixcache.core import KVCacheManager, MultiModalFeature, Request

    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        mgr = KVCacheManager(num_blocks=8, block_size=4, hash_algo=algo, hash_seed="s",
                             enable_events=True, verify_cached_tokens=True)
        for rid in ("a", "b"):
            r = Request(rid, list(range(10)), cache_salt="t", lora_name="l",
                        mm_features=[MultiModalFeature("img", 2, 3)])
            blocks, hits = mgr.get_computed_blocks(r)
            assert mgr.allocate_slots(r, 10 - hits, hits, blocks) is not None
            r.num_computed_tokens = 10
            r.append_output_token_ids([1, 2])
            mgr.allocate_slots(r, 2)
        assert hits == 8, hits
        mgr.free(r)
        mgr.take_events()
        mgr.make_prefix_cache_stats()
    # Every eviction policy, long enough for document-liveness to refit its model.
    from prefixcache.core import EVICTION_POLICIES
    for policy in EVICTION_POLICIES:
        mgr = KVCacheManager(num_blocks=16, block_size=4, eviction_policy=policy)
        for i in range(60):
            r = Request(f"{policy}{i}", [i % 5] * 8 + [i])
            blocks, hits = mgr.get_computed_blocks(r)
            assert mgr.allocate_slots(r, 9 - hits, hits, blocks) is not None
            r.append_output_token_ids([1] * (i % 7))
            mgr.free(r)
        queue = mgr.block_pool.free_block_queue
        if policy == "document-liveness":
            assert queue.model.num_fits > 0, "the fit never ran"
        assert mgr.reset_prefix_cache()
    heavy = sorted(m for m in ("torch", "numpy") if m in sys.modules)
    print("HEAVY:" + ",".join(heavy))
    """
)


def test_core_imports_neither_torch_nor_numpy():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "HEAVY:"
