"""FSDP2 over the dp x sp ranks of a stage: weights, gradients and optimizer state sharded.

Every dp and sp rank computes a partial gradient of the same weights (the loss is already normalised by
the global number of targets), so gradients are summed, not averaged.

How often a stage synchronises is a memory/communication trade-off (``FSDPOptions.sync``):

* ``"step"``: gather the weights at the first forward and keep them until the step's last backward,
  accumulate unsharded gradients over the N subsequences, reduce-scatter once. Least communication; holds
  the stage's whole unsharded weights and gradients for the step.
* ``"reduce"``: weights as in ``"step"``, but reduce-scatter the gradients after every subsequence's
  backward, so only sharded gradients are held between backwards (N reduce-scatters per step).
* ``"regather"``: as ``"reduce"``, and also reshard the weights after every forward and backward of a
  block and gather them again for the next one (2N all-gathers per step); only the blocks being computed
  hold unsharded weights.

Under bf16 mixed precision (``FSDPOptions.param_dtype = torch.bfloat16``) FSDP gathers bf16 copies of
the fp32 shards and reduces gradients in fp32 (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``): the fp32 shards are the optimizer's master weights, and gradients that accumulate
unsharded between backwards are kept in fp32. The residual stream, and so the stage's inputs and outputs
(the pipeline's messages), are bf16: ``activation_dtype`` says which dtype a stage exchanges.

With ``FSDPOptions.offload_to_host`` (the strategy's ``model_state="host"``) every ``fully_shard`` gets FSDP2's
``CPUOffloadPolicy``: the fp32 shards, their gradients and so the optimizer's state live in host memory (pinned on
CUDA), the optimizer steps on the CPU, and each all-gather first copies the shard to the device; gradients are
reduce-scattered on the device and copied back to host. The device then holds only gathered weights and
unsharded gradients of what is being computed, per the sync mode. A stage is sharded this way even alone
(dp * sp = 1): FSDP over a mesh of one rank is what moves its state to host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_sppo.model.gpt import Block

__all__ = [
    "FSDP_SYNC_MODES",
    "FSDPOptions",
    "FSDPSync",
    "activation_dtype",
    "apply_fsdp",
    "fsdp_modules",
    "set_last_backward",
]

FSDPSync = Literal["step", "reduce", "regather"]
FSDP_SYNC_MODES: tuple[str, ...] = get_args(FSDPSync)


@dataclass(frozen=True)
class FSDPOptions:
    """How a stage is sharded: the dtype its weights compute in, and how often it synchronises."""

    param_dtype: torch.dtype | None = None
    """Dtype FSDP gathers the weights in (bf16 under bf16 mixed precision); None keeps the parameters' dtype."""
    sync: FSDPSync = "step"
    """When weights are gathered and gradients reduce-scattered (module docstring)."""
    offload_to_host: bool = False
    """``model_state="host"``: sharded parameters, gradients and optimizer state live in host memory (module
    docstring)."""

    def __post_init__(self) -> None:
        if self.sync not in FSDP_SYNC_MODES:
            raise ValueError(f"Unknown fsdp_sync={self.sync!r}; choose one of {list(FSDP_SYNC_MODES)}.")


_OPTIONS: WeakKeyDictionary[nn.Module, FSDPOptions] = WeakKeyDictionary()
"""The options each sharded stage was built with, for ``set_last_backward`` and ``activation_dtype``."""


def apply_fsdp(stage: nn.Module, mesh: DeviceMesh, options: FSDPOptions | None = None) -> nn.Module:
    """Shard each block, then the rest of the stage (embedding, norm, head) as the root."""
    options = options or FSDPOptions()
    # "step"/"reduce": the N subsequence forwards of a step reuse the gathered weights instead of
    # gathering them N times; the runtime reshards after the step's last backward.
    reshard = options.sync == "regather"
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if options.offload_to_host else OffloadPolicy()
    for block in [m for m in stage.modules() if isinstance(m, Block)]:
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard, mp_policy=_block_policy(options), offload_policy=offload
        )
    fully_shard(
        stage, mesh=mesh, reshard_after_forward=reshard, mp_policy=_root_policy(options), offload_policy=offload
    )
    for module in fsdp_modules(stage):
        module.set_gradient_divide_factor(1.0)  # sum over dp x sp (FSDP averages by default)
        module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    _OPTIONS[stage] = options
    return stage


def _block_policy(options: FSDPOptions) -> MixedPrecisionPolicy:
    """Blocks cast their floating inputs (hidden states, RoPE tables) to the gathered weights' dtype."""
    if options.param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=torch.float32)


def _root_policy(options: FSDPOptions) -> MixedPrecisionPolicy:
    """The stage itself casts nothing: its inputs include the fp32 count of valid targets that normalises
    the loss, which a bf16 cast would round. The blocks cast the hidden states they receive."""
    if options.param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def activation_dtype(stage: nn.Module) -> torch.dtype:
    """The dtype of the hidden states a stage takes and returns (its pipeline messages).

    FSDP's ``param_dtype`` under mixed precision, else the parameters' dtype. Read it here rather than from
    ``stage.parameters()``: FSDP swaps fp32 shards and gathered bf16 weights in and out during a step.
    """
    options = _OPTIONS.get(stage)
    if options is not None and options.param_dtype is not None:
        return options.param_dtype
    return next(stage.parameters()).dtype


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def set_last_backward(stage: nn.Module, last: bool) -> None:
    """Before each backward: reduce-scatter and reshard as the stage's sync mode says.

    "step" reduce-scatters gradients and reshards weights only in the step's last backward on this rank;
    "reduce" reduce-scatters in every backward; "regather" also reshards weights after every backward.
    """
    sync = _OPTIONS[stage].sync if stage in _OPTIONS else "step"
    for module in fsdp_modules(stage):
        module.set_is_last_backward(last)
        module.set_requires_gradient_sync(last or sync != "step", recurse=False)
        module.set_reshard_after_backward(last or sync == "regather", recurse=False)
