"""Every offload test runs with one intra-op thread (``one_thread`` in tests/conftest.py); bit-identity is
compared within a test, so the thread count does not change what is checked."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
