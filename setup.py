"""The package's one C extension: adaptive's shadow caches
(prefixcache/core/eviction/shadow.py says why). Everything else is in pyproject.toml; this
file exists because setuptools declares extensions in pyproject.toml only experimentally.

It is optional: without a C compiler (or Python's headers) the package installs anyway and
uses the Python shadows, which make the same decisions at a higher cost.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("prefixcache.core.eviction._shadow_native",
                             ["prefixcache/core/eviction/_shadow_native.c"], optional=True)])
