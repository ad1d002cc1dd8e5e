"""The repo explains and tests itself: nothing it tracks reaches outside the checkout.

A clone with nothing beside it must pass the test suite, so no tracked file may name a
sibling directory of the checkout, and the data the tests read must be in ``data/``.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.data_paths import MOONCAKE_TRACE_PATH, REPO_ROOT, VLLM_HASH_VECTORS_PATH

# Spelled in two parts so that this file does not contain the string it looks for.
SIBLING_REFERENCE = "../" + "shared"


def tracked_files() -> list[str]:
    """Paths (relative to the repo root) that git tracks; skips when this is not a git
    checkout (an unpacked sdist, say), where there is no list of tracked files to check."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True)
    if listing.returncode != 0:
        pytest.skip("not a git checkout")
    return [path for path in listing.stdout.decode().split("\0") if path]


def test_no_tracked_file_names_a_sibling_of_the_checkout():
    needle = SIBLING_REFERENCE.encode()
    offenders = []
    for path in tracked_files():
        file_path = REPO_ROOT / path
        if file_path.is_file() and needle in file_path.read_bytes():
            offenders.append(path)
    assert offenders == [], f"files naming {SIBLING_REFERENCE}: {offenders}"


def test_vendored_data_are_tracked_with_their_readme_and_license():
    tracked = set(tracked_files())
    for path in (MOONCAKE_TRACE_PATH, MOONCAKE_TRACE_PATH.with_name("LICENSE-APACHE"),
                 MOONCAKE_TRACE_PATH.with_name("README.md"), VLLM_HASH_VECTORS_PATH,
                 VLLM_HASH_VECTORS_PATH.with_name("README.md")):
        assert path.is_file(), path
        assert path.relative_to(REPO_ROOT).as_posix() in tracked, f"{path} is not tracked"
