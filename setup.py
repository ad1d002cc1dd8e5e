"""The package's C extensions: adaptive's shadow caches (prefixcache/core/eviction/shadow.py
says why) and per-block bookkeeping (adaptive_bookkeeping.py), and document-liveness's fit
(document_liveness_model.py). Everything else is in
pyproject.toml; this file exists because setuptools declares extensions in pyproject.toml
only experimentally.

Both are optional: without a C compiler (or Python's headers) the package installs anyway
and uses the Python code, which makes the same decisions at a higher cost.
"""

import sys

from setuptools import Extension, setup

# The fit must give Python's results to the last bit: no fused multiply-adds (GCC and
# Clang contract a * b + c into one where the target has them).
NO_FMA = [] if sys.platform == "win32" else ["-ffp-contract=off"]

setup(ext_modules=[
    Extension("prefixcache.core.eviction._shadow_native",
              ["prefixcache/core/eviction/_shadow_native.c"],
              depends=["prefixcache/core/eviction/_keyed_table.h"], optional=True),
    Extension("prefixcache.core.eviction._adaptive_bookkeeping_native",
              ["prefixcache/core/eviction/_adaptive_bookkeeping_native.c"],
              depends=["prefixcache/core/eviction/_keyed_table.h"], optional=True),
    Extension("prefixcache.core.eviction._key_order_shadow_native",
              ["prefixcache/core/eviction/_key_order_shadow_native.c"],
              depends=["prefixcache/core/eviction/_keyed_table.h"], optional=True),
    Extension("prefixcache.core.eviction._liveness_fit_native",
              ["prefixcache/core/eviction/_liveness_fit_native.c"], optional=True,
              extra_compile_args=NO_FMA),
])
