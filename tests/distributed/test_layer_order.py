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


SELECTIVE_MQA = Case(4, "selective", offload="full", kv_device_tokens=10, groups=1, documents=True)
FULL_GQA_HOST = Case(3, "full", kv_device_tokens=7, groups=2, host=True)
"""Every factor at every layout in two cases: recompute selective and full, checkpoints on host, K/V on host in
chunks of 5 (across chunk and rank boundaries), packed documents, model state on host, MQA and GQA."""
LAYOUTS = {
    (2, 1): [SELECTIVE_MQA, FULL_GQA_HOST],
    (1, 2): [SELECTIVE_MQA, FULL_GQA_HOST, Case(2, "full", groups=4, documents=True)],
    (2, 2): [SELECTIVE_MQA, FULL_GQA_HOST],
    (4, 1): [SELECTIVE_MQA, FULL_GQA_HOST._replace(groups=4)],
}
"""(sp, dp) -> cases, through the Fabric strategy."""


@pytest.mark.parametrize(("sp", "dp"), list(LAYOUTS), ids=lambda v: str(v))
def test_layout_matches_plain_model(sp, dp):
    run_distributed(layer_workers.parity, sp * dp, dp, sp, LAYOUTS[sp, dp])


def test_eight_processes_match_plain_model():
    """sp=4 x dp=2: K/V groups repeated to the ranks, everything on host at once."""
    case = Case(4, "selective", offload="full", kv_device_tokens=10, groups=2, documents=True, host=True)
    run_distributed(layer_workers.parity, 8, 2, 4, [case])


@pytest.mark.parametrize(("sp", "dp", "host"), [(1, 2, False), (2, 1, True)], ids=["dp2", "sp2-host"])
def test_weights_gathered_once_per_layer_pass_and_reduced_once_per_layer(sp, dp, host):
    run_distributed(layer_workers.gathers_once_per_layer, sp * dp, dp, sp, host)
