"""``prefixcache generate``: what a user sees when the options or the output go wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_reader_that_goes_away_stops_the_stream_quietly(tiny_model_dir):
    """``generate ... | head -c 10``: exit 141 (128 + SIGPIPE), nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "prefixcache", "generate", "hello", "--model",
             str(tiny_model_dir), "--max-tokens", "8", "--ignore-eos"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300,
            cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141
