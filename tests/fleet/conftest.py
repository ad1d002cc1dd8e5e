"""The tiny model fixture of the server tests, shared by the fleet tests."""

from tests.entrypoints.conftest import tiny_model_dir  # noqa: F401
