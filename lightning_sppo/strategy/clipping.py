"""Gradient clipping by the norm of the whole model, whose gradients are spread over stages and shards."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_sppo.parallel.tied import is_tied_copy

__all__ = ["clip_grad_norm_"]


def _local(grad: Tensor) -> Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = True,
    distributed: bool = False,
) -> Tensor:
    """Scale gradients so that their global ``norm_type`` norm is at most ``max_norm``; returns the norm.

    Each rank holds a disjoint part of the model's gradients (its stage, its FSDP shard), so the global
    norm combines the local norms over all ranks: a sum of p-th powers, or a max for the inf-norm.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [_local(p.grad) for p in params]
    counted = [g for p, g in zip(params, grads, strict=True) if not is_tied_copy(p)]  # a tied weight once
    device = grads[0].device if grads else torch.device("cpu")
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        local = max((g.detach().abs().max().float() for g in counted), default=torch.zeros((), device=device))
        total = local.clone()
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
    else:
        powers = [g.detach().float().norm(norm_type) ** norm_type for g in counted]
        total = torch.stack(powers).sum() if powers else torch.zeros((), device=device)
        if distributed:
            dist.all_reduce(total)
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total gradient norm is {total.item()}; set error_if_nonfinite=False to clip anyway.")
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.device, g.dtype))
    return total
