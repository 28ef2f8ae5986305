"""FSDP2 over the dp x sp ranks of a stage: weights, gradients and optimizer state sharded.

Every dp and sp rank computes a partial gradient of the same weights (the loss is already normalised by
the global number of targets), so gradients are summed, not averaged.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_sppo.model.gpt import Block

__all__ = ["apply_fsdp", "fsdp_modules", "set_last_backward"]


def apply_fsdp(stage: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard each block, then the rest of the stage (embedding, norm, head) as the root.

    ``reshard_after_forward=False``: the N subsequence forwards of a step reuse the gathered weights
    instead of gathering them N times; the runtime reshards after the step's last backward.
    """
    for block in [m for m in stage.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(stage, mesh=mesh, reshard_after_forward=False)
    for module in fsdp_modules(stage):
        module.set_gradient_divide_factor(1.0)  # sum over dp x sp (FSDP averages by default)
        module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return stage


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def set_last_backward(stage: nn.Module, last: bool) -> None:
    """Reduce-scatter gradients and reshard weights only in the step's last backward on this rank."""
    for module in fsdp_modules(stage):
        module.set_is_last_backward(last)
        module.set_requires_gradient_sync(last, recurse=False)
        module.set_reshard_after_backward(last, recurse=False)
