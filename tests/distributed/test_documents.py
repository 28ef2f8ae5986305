"""Packed documents through pipelines, Ulysses, data parallel and the "sppo" schedule's shared units (gloo).

Each launch loops over schedules seq1f1b and sppo, offload none and adaptive, recompute none, selective and full, and
K/V on host (``document_workers.CASES``); loss and every gradient must equal each document trained alone through the
plain model.
"""

import pytest

from tests.distributed import document_workers
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.slow  # several processes (gloo) per test


@pytest.mark.parametrize(
    ("pp", "dp", "sp"), [(2, 1, 1), (1, 1, 2), (2, 1, 2), (2, 2, 1), (4, 1, 1)], ids=lambda v: str(v)
)
def test_packed_documents_equal_separate_documents(pp, dp, sp):
    run_distributed(document_workers.document_parity, pp * dp * sp, pp, dp, sp, (pp, dp, sp) == (2, 1, 2))
