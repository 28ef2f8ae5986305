"""Per-rank values reduced over every rank: maximum and sum, with the reduction in the name.

Ranks differ: a pipeline stage holds its own layers, activations and offloaded bytes, so rank 0's numbers are
not the run's. ``reduce_over_ranks`` gathers one small vector from every rank (one collective, on the ranks'
own device: CUDA tensors under NCCL) and returns ``<name>_max`` and ``<name>_sum`` for each value. It is a
collective: every rank must call it, with the same names in the same order, or the run hangs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["REDUCTIONS", "reduce_over_ranks"]

REDUCTIONS = ("max", "sum")
"""Suffixes of the reduced names: ``memory/peak_allocated_gib`` gives ``memory/peak_allocated_gib_max``, ..."""


def reduce_over_ranks(values: Mapping[str, float], device: torch.device) -> dict[str, float]:
    """``{f"{name}_{reduction}": value}`` for every name of ``values`` and reduction in ``REDUCTIONS``.

    Without a process group (one process) the maximum and the sum are the value itself. Reading the result
    waits for the device (one host sync).
    """
    if not values:
        return {}
    # non_blocking: no wait here for the queued step; the only wait is reading the result below.
    local = torch.tensor(list(values.values()), dtype=torch.float64).to(device, non_blocking=True)  # [K]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        per_rank = torch.stack(gathered)  # [R, K]
    else:
        per_rank = local.unsqueeze(0)  # [1, K]
    reduced = torch.stack([per_rank.max(dim=0).values, per_rank.sum(dim=0)]).tolist()  # [2][K], the one sync
    return {
        f"{name}_{reduction}": row[k]
        for reduction, row in zip(REDUCTIONS, reduced, strict=True)
        for k, name in enumerate(values)
    }
