"""Building the C++ kernels of this package with the machine's compiler.

Each kernel is one C++ file next to its Python module, compiled on first use through
`torch.utils.cpp_extension` (cached on disk by PyTorch, so later starts only load it) into
a library that registers its operators under `torch.ops.prefixcache`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)


def build_kernel_library(name: str, source: Path) -> None:
    """Compile (or load the cached build of) `source` as extension `name` and load it.

    Raises whatever the build raises (no compiler, no ninja, a compile error)."""
    from torch.utils.cpp_extension import load_inline

    # The first start on a machine waits for the compiler: say why the engine is quiet.
    logger.info("loading the C++ kernels %s (compiled on first use, about half a minute; "
                "cached afterwards)", name)
    _put_ninja_on_path()
    load_inline(
        name=name,
        cpp_sources=[source.read_text()],
        is_python_module=False,  # the library registers torch.ops.prefixcache
        # at::parallel_for is inline OpenMP: without -fopenmp it runs on one thread.
        extra_cflags=["-O3", "-fopenmp", *_vector_isa_flags()],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def _put_ninja_on_path() -> None:
    """PyTorch's builder runs `ninja` from PATH; the `ninja` package (a dependency)
    installs it next to this environment's Python, which need not be on PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the build fails with PyTorch's own message, which the caller logs
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _vector_isa_flags() -> list[str]:
    """Compiler flags and the ATen `CPU_CAPABILITY` macro for this CPU's widest vector
    instructions, as Inductor picks them; none (scalar code) if that is unavailable."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
    except Exception:  # noqa: BLE001 - a private helper: without it, build portable code
        return []
    if not isa:
        return []
    macros = isa.build_macro()
    capability = macros[0].removeprefix("CPU_CAPABILITY_") if macros else None
    flags = [f"-D{macro}" for macro in macros]
    if capability:
        flags.append(f"-DCPU_CAPABILITY={capability}")
    return flags + isa.build_arch_flags().split()
