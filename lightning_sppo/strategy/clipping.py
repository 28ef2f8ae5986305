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


def _norm_dtype(parameters: list[Tensor]) -> torch.dtype:
    """The dtype the norm is summed in: fp32, or a wider floating dtype of the parameters (fp64)."""
    dtype = torch.float32
    for p in parameters:
        if p.is_floating_point():
            dtype = torch.promote_types(dtype, p.dtype)
    return dtype


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = True,
    distributed: bool = False,
    device: torch.device | None = None,
) -> Tensor:
    """Scale gradients so that their global ``norm_type`` norm is at most ``max_norm``; returns the norm.

    Each rank holds a disjoint part of the model's gradients (its stage, its FSDP shard), so the global
    norm combines the local norms over all ranks: a sum of p-th powers, or a max for the inf-norm.
    ``device``: where the all-reduce runs (the compute device: under NCCL a host tensor would crash it, and with
    ``model_state="host"`` the gradients are host tensors); default the parameters' device.
    """
    parameters = list(parameters)
    with_grads = [p for p in parameters if p.grad is not None]
    grads = [_local(p.grad) for p in with_grads]
    counted = [g for p, g in zip(with_grads, grads, strict=True) if not is_tied_copy(p)]  # a tied weight once
    # The device of the stage's parameters even where no gradient exists: under NCCL a rank that joined the
    # all-reduce with a CPU tensor would crash it.
    device = device or (_local(parameters[0]).device if parameters else torch.device("cpu"))
    norm_type = float(norm_type)
    # fp32 at least (half-precision gradients sum without overflow), fp64 where the model trains in fp64 ("64-true");
    # every rank sums in the dtype of the parameters, so the all-reduce gets one dtype everywhere.
    dtype = _norm_dtype(parameters)
    if norm_type == float("inf"):
        # One stacked max: Python's max() over device scalars would sync the host once per parameter.
        # Empty local shards (FSDP's uneven split) have no max and are left out.
        maxima = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=dtype) for g in counted if g.numel()]
        total = torch.stack(maxima).max().to(device) if maxima else torch.zeros((), dtype=dtype, device=device)
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
    else:
        powers = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=dtype) ** norm_type for g in counted]
        total = torch.stack(powers).sum().to(device) if powers else torch.zeros((), dtype=dtype, device=device)
        if distributed:
            dist.all_reduce(total)
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total gradient norm is {total.item()}; set error_if_nonfinite=False to clip anyway.")
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.device, g.dtype))
    return total
