"""Workers for packed documents on several ranks: every layout against the documents trained one by one.

One launch per layout loops over its cases (process start-up costs more than a step of the tiny model).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from lightning.fabric import Fabric

from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.offload import OffloadCallback
from tests.conftest import (
    document_ids_from_lengths,
    full_tensor,
    make_batch,
    parity_config,
    relative_error,
    separate_documents_loss_and_grads,
)

S = 48  # N=4 "length": subsequences of 12 (6 per SP rank), boundaries at 12, 24 and 36

# Per row: a document across two subsequence boundaries, a one-token one, one that ends on a boundary; one that
# starts on a boundary, two one-token ones in a row; one document; many short ones. Different in every row.
ROWS = [[30, 1, 5, 12], [12, 1, 1, 20, 14], [48], [3, 7, 2, 9, 11, 16]]


class Case(NamedTuple):
    schedule: str
    offload: str
    num_subsequences: int
    num_microbatches: int
    partition: str
    recompute: str = "none"
    spill: bool = False  # K/V beyond 16 tokens on host, streamed in chunks of 8 (to the helpers too, under "sppo")


CASES = [
    Case("seq1f1b", "none", 4, 2, "length"),
    Case("seq1f1b", "adaptive", 3, 1, "flops"),
    Case("sppo", "none", 4, 2, "flops"),
    Case("sppo", "adaptive", 4, 1, "length"),
    Case("seq1f1b", "adaptive", 4, 2, "flops", "selective"),
    Case("sppo", "none", 4, 1, "length", "full"),
    Case("sppo", "none", 4, 1, "flops", "selective", spill=True),
]


def document_parity(rank: int, world_size: int, pp: int, dp: int, sp: int, negative_control: bool = False) -> None:
    """Loss and every gradient of packed documents equal the documents run alone through the plain model
    (relative error < 1e-5), for every case; optionally, the same step without document_ids does not."""
    config = parity_config(gqa=True, n_layer=max(2, pp))
    rows = 2 if dp == 1 else 4
    document_ids = document_ids_from_lengths(ROWS[:rows])
    per_dp = rows // dp
    for case in CASES:
        torch.manual_seed(0)
        plain = GPT(config)
        ids, targets = make_batch(config, rows, S, seed=case.num_subsequences)
        ref_loss, ref_grads = separate_documents_loss_and_grads(plain, ids, targets, document_ids)
        offload = case.offload if case.offload == "none" else OffloadCallback(case.offload, min_bytes=0)
        strategy = SPPOStrategy(
            pipeline_parallel=pp,
            sequence_parallel=sp,
            num_subsequences=case.num_subsequences,
            num_microbatches=case.num_microbatches,
            partition=case.partition,
            schedule=case.schedule,
            offload=offload,
            recompute=case.recompute,
            kv_device_tokens=16 if case.spill else None,
            kv_chunk_tokens=8,
        )
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
        fabric.launch()
        stage = fabric.setup(copy.deepcopy(plain))
        dp_rank = fabric.strategy.dims.coordinates(rank)[1]
        mine = slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)
        loss = fabric.strategy.forward_backward(stage, ids[mine], targets[mine], document_ids[mine])

        where = f"rank {rank} (pp={pp}, dp={dp}, sp={sp}) {case} lengths={fabric.strategy.core.last_plan.lengths}"
        if case.schedule == "sppo" and pp > 1:
            runtime = fabric.strategy.core.runtime
            actions = runtime.actions(case.num_subsequences, case.num_microbatches)
            assert runtime.shared is not None and any(a.multiplexed for a in actions), where
        if case.spill:
            assert fabric.strategy.core.runtime.pool.host_nbytes() > 0, where  # the K/V beyond 16 tokens on host
        if case.offload != "none":  # through the stage's offloader, or the shared units' (all of stage 0's at pp=N)
            shared = fabric.strategy.core.runtime.shared if pp > 1 else None
            offloaders = [fabric.strategy.core.hooks, getattr(shared, "hooks", None)]
            assert sum(o.last_stats.offloaded_bytes for o in offloaders if o is not None) > 0, where
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (where, loss.item(), ref_loss.item())
        for name, param in stage.module.named_parameters():
            err = relative_error(full_tensor(param.grad), ref_grads[name])
            assert err < 1e-5, f"{where}: grad of {name} off by {err}"
        if negative_control and case == CASES[0]:
            stage.module.zero_grad(set_to_none=True)
            plain_loss = fabric.strategy.forward_backward(stage, ids[mine], targets[mine])  # the mask dropped
            errors = [relative_error(full_tensor(p.grad), ref_grads[n]) for n, p in stage.module.named_parameters()]
            assert plain_loss.item() != ref_loss.item(), where  # (a random model's loss barely sees attention)
            assert max(errors) > 1e-2, (where, errors)
