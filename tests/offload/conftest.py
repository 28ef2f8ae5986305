"""One intra-op thread for these tests: their tensors are tiny, so threads only add synchronisation, and on a
busy shared machine spinning threads can make a step 100x slower. Bit-identity is compared within a test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
