"""The layer order (FPDT's) on several processes (gloo): Ulysses sequence parallelism per chunk, against the plain
model on one process."""

import pytest

from tests.distributed import layer_workers
from tests.distributed.harness import run_distributed
from tests.distributed.layer_workers import Case

pytestmark = pytest.mark.slow  # several processes (gloo) per test

ENGINE_CASES = {
    2: [
        Case(3, "selective", groups=1, kv_device_tokens=10),
        Case(2, "full", offload="full", documents=True),
        Case(4, "full", groups=4, kv_device_tokens=0, documents=True),
    ],
    4: [Case(3, "selective", groups=2, documents=True), Case(4, "full", offload="full", groups=1, kv_device_tokens=7)],
}
"""sp ranks -> cases for the engine alone: K/V groups replicated to the ranks (G=1 at sp=2; G=1, 2 at sp=4)."""


@pytest.mark.parametrize("sp", [2, 4])
def test_sequence_parallel_engine_matches_plain_model(sp):
    run_distributed(layer_workers.engine_parity, sp, ENGINE_CASES[sp])
