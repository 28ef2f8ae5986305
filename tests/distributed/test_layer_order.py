"""The layer order (FPDT's) on several processes (gloo), against the plain model on one process.

Ulysses sequence parallelism per chunk, FSDP2 over dp x sp driven per layer, model state, checkpoints and K/V on
host: loss, every gradient, the clipped gradient norm and an SGD step at (sp, dp) = (2, 1), (1, 2), (2, 2), (4, 1)
and (4, 2); the weights gathered once per layer pass and reduced once per layer (the collectives counted, in order);
negative controls (a dropped dK/dV chunk, a stale prefetched K/V chunk, a shard's gradient missing); the streamed
K/V double-buffered and bounded whatever the length on each rank; the traffic replayed under NCCL's rules; bf16.
"""

import pytest

from tests.distributed import layer_workers
from tests.distributed.harness import run_distributed
from tests.distributed.layer_workers import Case

pytestmark = pytest.mark.slow  # several processes (gloo) per test

SELECTIVE_MQA = Case(4, "selective", offload="full", kv_device_tokens=10, groups=1, documents=True)
FULL_GQA_HOST = Case(3, "full", kv_device_tokens=7, groups=2, host=True)
"""Every factor at every layout in two cases: recompute selective and full, checkpoints on host, K/V on host in
chunks of 5 (across chunk and rank boundaries), packed documents, model state on host, MQA and GQA."""
LAYOUTS = {
    (2, 1): [SELECTIVE_MQA, FULL_GQA_HOST],
    (1, 2): [SELECTIVE_MQA, FULL_GQA_HOST, Case(2, "full", groups=4, documents=True, tied=True)],
    (2, 2): [SELECTIVE_MQA, FULL_GQA_HOST],
    (4, 1): [SELECTIVE_MQA, FULL_GQA_HOST, Case(2, "selective", groups=4)],
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


def test_dropped_kv_gradients_stale_chunks_and_missing_shards_fail_parity():
    run_distributed(layer_workers.negative_controls, 2)


def test_streamed_kv_is_double_buffered_and_bounded_with_sequence_parallelism():
    run_distributed(layer_workers.streamed_kv_on_ranks, 2)


def test_two_ranks_replay_under_nccl_rules():
    """sp=2 with everything on host at once, and dp=2 with packed documents."""
    layouts = [(2, 1, Case(3, "selective", offload="full", kv_device_tokens=10, groups=1, host=True)),
               (1, 2, Case(2, "full", documents=True))]  # fmt: skip
    run_distributed(layer_workers.replays_under_nccl, 2, layouts)


def test_four_ranks_replay_under_nccl_rules():
    layouts = [(2, 2, Case(3, "full", kv_device_tokens=10, documents=True)), (4, 1, Case(2, "selective", groups=1))]
    run_distributed(layer_workers.replays_under_nccl, 4, layouts)


def test_bf16_mixed_precision_at_dp2():
    run_distributed(layer_workers.mixed_precision, 2)
