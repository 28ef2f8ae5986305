"""Tied embeddings across a pipeline: the first stage's ``wte.weight`` and the last stage's ``lm_head.weight``
are one parameter in the plain model, so with pp > 1 they are two copies that must stay equal.

They start equal (the last stage takes the first stage's values once, when the stage is built: the plain
model's, or its fresh initialisation; Hugging Face weights load the same tensor into both), and after every
``forward_backward`` each copy's gradient gains both copies' contributions of that call, so it holds the plain
parameter's gradient (also when gradients accumulate over several calls). The optimizer then
updates both identically. Copies of one (dp, sp) coordinate have the same FSDP shard layout, so the local
shards are sent and summed as they are.

Each pipeline column (the pp ranks of one (dp, sp) coordinate) gets a 2-rank group of its first and last
stage, created once on every rank in the same order (``new_group`` is collective over the world).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_sppo.model.gpt import GPT
from lightning_sppo.parallel.dims import ParallelDims

__all__ = ["is_tied_copy", "tie_pipeline_embeddings", "tied_gradients_summed"]


_GROUPS: WeakKeyDictionary[nn.Module, tuple[dist.ProcessGroup, int, Tensor]] = WeakKeyDictionary()
"""stage -> (its first/last-stage group, the first stage's global rank, its copy of the tied weight)."""
_COPY_FLAG = "_sppo_tied_copy"
"""Set on the last stages' copies of a tied weight: the gradient norm counts the first stage's only."""


def tie_pipeline_embeddings(stage: nn.Module, model: GPT, dims: ParallelDims, global_rank: int) -> None:
    """With ``tie_embeddings`` and pp > 1: build the first/last-stage groups and give the last stage the first
    stage's weight. Every rank calls this (middle stages too: group creation is collective); no-op otherwise."""
    if not model.config.tie_embeddings or dims.pp == 1:
        return
    pp_rank, dp_rank, sp_rank = dims.coordinates(global_rank)
    mine = None
    for dp in range(dims.dp):
        for sp in range(dims.sp):
            first, last = (stage_rank * dims.dp * dims.sp + dp * dims.sp + sp for stage_rank in (0, dims.pp - 1))
            group = dist.new_group([first, last])
            if (dp, sp) == (dp_rank, sp_rank) and pp_rank in (0, dims.pp - 1):
                mine = (group, first)
    if mine is None:
        return
    weight = model.wte.weight if pp_rank == 0 else model.lm_head.weight
    _GROUPS[stage] = (*mine, weight)
    if pp_rank == dims.pp - 1:
        setattr(weight, _COPY_FLAG, True)
    with torch.no_grad():
        _collective(dist.broadcast, _local(weight), src=mine[1], group=mine[0])


@contextmanager
def tied_gradients_summed(stage: nn.Module) -> Iterator[None]:
    """Around one call's backward: afterwards both copies of a tied weight hold the gradient this call gave the
    plain parameter (their two contributions summed) on top of what they held before.

    Only this call's share is summed: gradients accumulated over earlier calls are already whole (summing all of
    ``.grad`` again would count them twice). That costs a copy of the local gradient when one is accumulated
    (none after ``zero_grad``). A no-op on untied stages.
    """
    if stage not in _GROUPS:
        yield
        return
    group, _, weight = _GROUPS[stage]
    before = None if weight.grad is None else _local(weight.grad).detach().clone()
    yield
    with torch.no_grad():
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        local = _local(grad)
        if before is not None:
            local.sub_(before)
        _collective(dist.all_reduce, local, group=group)
        if before is not None:
            local.add_(before)
    weight.grad = grad


def is_tied_copy(param: Tensor) -> bool:
    """Whether ``param`` is a last stage's copy of a tied weight (counted once, on the first stage)."""
    return getattr(param, _COPY_FLAG, False)


def _collective(op: Callable[..., Any], tensor: Tensor, group: ProcessGroup, **kwargs: Any) -> None:
    """``op`` on ``tensor`` in place, through the GPU when NCCL runs the group and the tensor is on host
    (``model_state="host"`` keeps weights and gradients in host memory; NCCL takes device tensors only)."""
    if tensor.device.type != "cpu" or dist.get_backend(group) != "nccl":
        op(tensor, group=group, **kwargs)
        return
    staged = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    op(staged, group=group, **kwargs)
    tensor.copy_(staged)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
