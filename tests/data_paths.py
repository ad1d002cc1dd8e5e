"""Where the tests find the data vendored in the repo's top-level ``data/`` directory.

Paths are resolved from this file, not the working directory, so the tests read the same
files whatever directory pytest is started from.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "data"
# vLLM's reference block hashes and KV event bytes (see data/compat/README.md).
VLLM_HASH_VECTORS_PATH = DATA_DIR / "compat" / "vllm-block-hash-vectors.json"
# The Mooncake FAST'25 synthetic trace (see data/traces/mooncake/README.md).
MOONCAKE_TRACE_PATH = DATA_DIR / "traces" / "mooncake" / "synthetic_trace.jsonl"
