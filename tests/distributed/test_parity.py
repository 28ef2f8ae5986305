"""Every (pp, dp, sp) layout gives the plain model's loss, gradients and SGD update (gloo, real processes)."""

import pytest

from tests.distributed import workers
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.slow  # several processes (gloo) per test

SPILL = {"kv_device_tokens": 16, "kv_chunk_tokens": 8}
"""K/V beyond 16 of the 48 tokens on host, streamed back 8 at a time (chunks and subsequences cut across R)."""
CASES = [
    (1, 1, "length"),
    (3, 1, "flops"),
    (4, 2, "flops"),
    (3, 2, "flops", "adaptive", SPILL),
    (4, 2, "length", "none", SPILL | {"schedule": "gpipe"}),
]
"""(N, micro-batches, partition[, offload, settings])"""


SELECTIVE, FULL = {"recompute": "selective"}, {"recompute": "full"}
RECOMPUTE_CASES = {
    (2, 1, 1): [(4, 2, "flops", "adaptive", SELECTIVE | SPILL), (3, 1, "length", "none", FULL | {"schedule": "gpipe"})],
    (1, 1, 2): [(3, 1, "flops", "adaptive", SELECTIVE), (3, 1, "length", "none", FULL | SPILL)],
    (1, 2, 1): [(3, 1, "flops", "none", FULL | {"fsdp_sync": "regather"}), (3, 2, "flops", "adaptive", SELECTIVE)],
    (2, 1, 2): [(4, 2, "flops", "adaptive", FULL | SPILL)],
    (2, 2, 1): [(4, 2, "flops", "none", SELECTIVE | {"fsdp_sync": "regather"})],
    (4, 1, 1): [(4, 1, "flops", "adaptive", FULL | {"schedule": "gpipe"}), (4, 2, "length", "none", SELECTIVE | SPILL)],
}
HOST = {"model_state": "host"}
"""Parameters, gradients and optimizer state in host memory (FSDP2's CPU offload, a stage sharded even alone)."""
HOST_CASES = {
    (2, 1, 1): [(3, 2, "flops", "adaptive", HOST | FULL)],
    (1, 2, 1): [(3, 1, "length", "none", HOST | {"fsdp_sync": "reduce"})],
    (2, 1, 2): [(4, 1, "flops", "none", HOST | SPILL)],
}
"""Recompute (``lightning_sppo.recompute``) per layout, offload and K/V on host on top in some: (N, M, partition,
offload, settings)."""


@pytest.mark.parametrize(
    ("pp", "dp", "sp"), [(2, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)], ids=lambda v: str(v)
)
def test_layout_matches_plain_model(pp, dp, sp):
    cases = CASES + RECOMPUTE_CASES[pp, dp, sp] + HOST_CASES.get((pp, dp, sp), [])
    run_distributed(workers.parity, pp * dp * sp, pp, dp, sp, cases)


SPPO_CASES = [
    (2, 1, "length", "none"),
    (5, 1, "flops", "full"),
    (4, 2, "flops", "none"),
    (4, 2, "length", "full"),
    (4, 2, "flops", "none", SPILL),
]
"""(N, M, partition, offload): M = 2 runs micro-batches one after another; offload covers the units a stage runs alone."""


SPPO_RECOMPUTE_CASES = {
    (2, 1, 1): [
        (5, 1, "flops", "full", SELECTIVE | SPILL),
        (4, 2, "flops", "none", FULL | SPILL),
        (3, 1, "flops", "adaptive", HOST | FULL),
    ],
    (4, 1, 1): [(4, 2, "flops", "none", FULL), (4, 1, "length", "none", SELECTIVE | SPILL | HOST)],
    (2, 1, 2): [
        (4, 1, "length", "full", FULL),
        (4, 2, "flops", "none", SELECTIVE | SPILL),
        (3, 1, "flops", "none", HOST | FULL | SPILL),
    ],
    (2, 2, 1): [
        (4, 2, "flops", "full", SELECTIVE | {"fsdp_sync": "regather"}),
        (3, 1, "length", "none", HOST | SELECTIVE | SPILL),
    ],
}
"""Recompute, K/V on host and model state on host: the stage's own units and the shared units' blocks recompute
(the worker checks the shared attention ran its first run and replays, and nothing else), the owner's prefix streams
to the members in chunks of 8 tokens, FSDP2 keeps the stages' state on host (even unsharded)."""

MQA = {"model": {"n_query_groups": 1}}
SPPO_ROW_CASES = {
    (2, 1, 1): [(4, 1, "flops", "none", MQA | SELECTIVE), (4, 2, "length", "full", MQA | SPILL | FULL)],
    (2, 2, 1): [(4, 2, "flops", "none", MQA | SPILL), (3, 1, "length", "full", MQA | FULL)],
}
"""One K/V group, two members: the shared units' attention splits query rows. (pp=4 with two groups and pp=2 x sp=2
with one per SP rank split rows in every case above; the worker checks which split ran.)"""


@pytest.mark.parametrize(("pp", "dp", "sp"), [(2, 1, 1), (4, 1, 1), (2, 1, 2), (2, 2, 1)], ids=lambda v: str(v))
def test_sppo_schedule_matches_plain_model(pp, dp, sp):
    """Multiplexed sequence partitioning: shares of shared units run on other stages' ranks, on stage shells whose
    weights stream in piece by piece, attention split by K/V group across the group, or by query rows too where
    there are fewer groups than members."""
    cases = SPPO_CASES + SPPO_RECOMPUTE_CASES[pp, dp, sp] + SPPO_ROW_CASES.get((pp, dp, sp), [])
    run_distributed(workers.parity, pp * dp * sp, pp, dp, sp, cases, "sppo")


def test_sppo_schedule_with_every_memory_mode_at_pp4_sp2():
    """pp=4 x sp=2 (8 processes, so one case): shared units of up to four members over one K/V group per SP rank
    (rows split), selective recompute in every block, the prefix streamed from host in chunks, stages on host."""
    run_distributed(workers.parity, 8, 4, 1, 2, [(4, 1, "flops", "none", SELECTIVE | SPILL | HOST)], "sppo")


def test_sppo_training_follows_plain_model_over_steps():
    run_distributed(workers.sppo_training_follows_plain_model, 2)


def test_sppo_parity_fails_when_the_owner_drops_the_groups_gradients_or_a_helper_its_kv_gradients():
    run_distributed(workers.sppo_without_helper_gradients_fails, 2)


def test_sppo_parity_fails_when_streamed_chunk_gradients_or_a_replayed_output_are_wrong():
    run_distributed(workers.sppo_streaming_and_replay_fail_when_tampered, 2)


def test_bf16_kv_gradients_reach_the_stage_caches_under_sppo():
    run_distributed(workers.bf16_kv_gradients, 2)


def test_checkpoint_loads_into_another_layout_and_exports_plain_keys(tmp_path):
    run_distributed(workers.checkpoint_round_trip, 2, str(tmp_path))


def test_fsdp_gathers_and_reduces_once_per_step():
    run_distributed(workers.fsdp_communication_counts, 2)


def test_offload_in_a_pipeline_is_bit_identical():
    run_distributed(workers.offload_bit_identical, 2)
