"""The package's optional C extensions (adaptive's shadow caches and bookkeeping,
document-liveness's fit): built wherever they can be, and from the sources next to them.
What each computes is tested against its Python twin in the policy's own tests."""

from __future__ import annotations

import importlib
import re
import shutil
import sysconfig
from pathlib import Path

import pytest

EXTENSIONS = ["prefixcache.core.eviction._shadow_native",
              "prefixcache.core.eviction._adaptive_bookkeeping_native",
              "prefixcache.core.eviction._key_order_shadow_native",
              "prefixcache.core.eviction._liveness_fit_native"]


def _can_build() -> str | None:
    """Why an extension could not be built here, or None if it can."""
    compiler = (sysconfig.get_config_var("CC") or "").split()
    if not compiler or shutil.which(compiler[0]) is None:
        return "no C compiler here: the Python code is the one expected"
    headers = Path(sysconfig.get_path("include"), "Python.h")
    if not headers.exists():
        return f"no Python headers ({headers}): the Python code is the one expected"
    return None


@pytest.mark.parametrize("name", EXTENSIONS)
def test_each_extension_is_built_wherever_a_compiler_is(name):
    """The extensions are optional so that the package installs without a compiler; where
    there is one, a failed build is a bug (the C code would silently not be used)."""
    reason = _can_build()
    if reason is not None:
        pytest.skip(reason)
    try:
        importlib.import_module(name)
    except ImportError as error:
        pytest.fail(f"{name} did not build ({error}): reinstall with `pip install -e .` "
                    "and read the compiler's errors")


@pytest.mark.parametrize("name", EXTENSIONS)
def test_each_extension_loaded_is_built_from_the_source_next_to_it(name):
    """An editable install compiles a C file once: after an edit, the tests would keep
    running the old build unless it is rebuilt."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        pytest.skip("not built (test_each_extension_is_built_wherever_a_compiler_is says "
                    "whether that is expected)")
    library = Path(module.__file__)
    source = library.parent / (name.rsplit(".", 1)[1] + ".c")
    if not source.exists():
        pytest.skip("installed without its source: nothing to compare the build with")
    # The headers of the package it includes are its source too.
    headers = re.findall(r'^#include "([^"]+)"', source.read_text(), re.MULTILINE)
    for path in [source, *(source.parent / header for header in headers)]:
        assert library.stat().st_mtime >= path.stat().st_mtime, (
            f"{library.name} is older than {path.name}: rebuild it with `pip install -e .`")
