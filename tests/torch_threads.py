"""A fixture shared by the torch-using test folders (imported by their conftest.py)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Run on one intra-op thread, restored afterwards.

    These models are tiny (or 135M parameters on a handful of tokens): a second thread buys
    little, and on a busy machine its spin-waiting made steps ~10x slower in wall time.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
