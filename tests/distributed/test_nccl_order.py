"""The runtime's real communication, recorded on gloo and replayed under NCCL's rules (no GPU needed).

Every schedule (gpipe, seq1f1b, sppo) with pp in {2, 4}, sp in {1, 2}, M in {1, 2}, offload off and "full"
completes; so do pp=2 x dp=2 steps with FSDP2. Negative control: the same runtime with every message on the
default group (the order before per-direction groups) is reported as a hang. Packed documents with the "flops"
partition (seq1f1b and sppo, pp=2, M=2): the per-batch broadcast of rank 0's lengths is in the replayed order. The
forward-only evaluation pass followed by a training step replays for every schedule at pp=2, and at pp=4 and
pp=2 x sp=2. Recompute (selective and full, shared units' blocks included) at pp=2 x sp=2 replays with the
all-to-alls it runs again in backward. With K/V on host (kv_device_tokens; every schedule at pp=2 M=2, sppo at
pp=2 x sp=2) each rank makes exactly the calls of the same run without it, and they replay, except that under sppo
the owner's prefix reaches the members in chunks (more all-to-alls on the sharing groups). sppo with every memory
mode at once (recompute, K/V on host, model state on host) replays at pp=2, and recompute with K/V on host at
pp=4 x sp=2. One process group per world size: start-up costs more than all of its layouts together.
"""

import pytest

from tests.distributed import order_workers
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.slow  # several processes (gloo) per test


def test_two_ranks_replay_and_one_group_order_hangs():
    run_distributed(order_workers.two_ranks, 2)


def test_four_ranks_replay_with_sp_and_fsdp():
    run_distributed(order_workers.four_ranks, 4)


def test_eight_ranks_replay_pp4_sp2():
    run_distributed(order_workers.eight_ranks, 8)
