"""FSDP2 driven by hand for the layer order: each layer's weights gathered once per layer pass, the next one's
gather issued while the current layer computes, its gradients reduce-scattered once after its backward.

Why by hand: the layer order calls a block once per chunk, and a block's backward is many separate autograd calls
(each chunk's replay, then each chunk's projection backward: ``runtime.layer_major``). FSDP2's module hooks would
gather and free the weights around every call and, at the end of each autograd call, reduce-scatter whatever
gradients it holds, once per chunk. So the engine calls blocks without hooks (``forward``, not ``__call__``) and
tells ``LayerShards`` when a unit's pass starts and ends:

    gather(unit)     its weights are needed now: wait for the prefetched all-gather (or gather now)
    prefetch(unit)   issue the next unit's all-gather (on CUDA on FSDP's all-gather streams, so it overlaps)
    release(unit)    forward pass done: free the gathered weights
    reduce(unit)     backward pass done: reduce-scatter the gradients summed over the pass, free the weights
    end()            the step is over: wait for the reductions, reset FSDP's per-step state

A unit is a block's index, or ``ROOT``: what the root module owns (embedding, final norm, head). Its gradients come
in two passes (the loss's, then the embedding's) and are reduce-scattered after each, on the parameters that got
gradients (a tied weight twice, the sums adding up in the sharded gradient).

These are the calls FSDP2's own hooks make (``FSDPParamGroup.unshard``/``wait_for_unshard``/``reshard``/
``post_backward``/``finalize_backward``, and the implicit prefetch of ``FSDPParamGroup._prefetch_unshard``), in an
order chosen here: private API of torch's ``fully_shard``, kept to this one module. Gradients are summed over the
mesh (``apply_fsdp`` sets the divide factor to 1), with the model state on host when ``apply_fsdp`` set
``CPUOffloadPolicy`` (each gather then copies the layer's shard to the device first).

Without FSDP (one process, model state on the device) every call is a no-op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

__all__ = ["ROOT", "LayerShards"]

ROOT = -1
"""The unit of the root module's own parameters (embedding, final norm, head)."""


class LayerShards:
    """The FSDP2 units of a model in the layer order (module docstring).

    Args:
        root: the model (an ``FSDPModule`` when sharded).
        blocks: its blocks in layer order (each an ``FSDPModule`` when sharded).
    """

    def __init__(self, root: nn.Module, blocks: list[nn.Module]) -> None:
        sharded = [isinstance(m, FSDPModule) for m in (root, *blocks)]
        if any(sharded) and not all(sharded):
            raise TypeError(
                "order='layer' shards the model's root and every block with FSDP2, or none of them (apply_fsdp);"
                f" got {sum(sharded)} of {len(sharded)} sharded."
            )
        self.sharded = all(sharded)
        self._modules = {ROOT: root, **dict(enumerate(blocks))}
        self._groups: dict[int, list[Any]] = {}
        if self.sharded:
            self._groups = {unit: _param_groups(m) for unit, m in self._modules.items()}
        self.gathers = 0
        """All-gathers issued since the last ``begin`` (what the tests count)."""
        self.reductions = 0
        """Reduce-scatter passes since the last ``begin``."""

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the blocks' weights are gathered in under mixed precision (None: their own dtype)."""
        if not self.sharded:
            return None
        return self._groups[0][0].mp_policy.param_dtype if 0 in self._groups else None

    def cast(self, x: Tensor) -> Tensor:
        """A block's floating input in the gathered weights' dtype, as FSDP2's pre-forward hook casts it."""
        dtype = self.compute_dtype
        return x if dtype is None or not x.is_floating_point() else x.to(dtype)

    def begin(self) -> None:
        """Before a step: FSDP's one-time set-up, and its gathers ordered after what the compute stream did (the
        optimizer's update of the shards)."""
        self.gathers = self.reductions = 0
        if not self.sharded:
            return
        state = self._modules[ROOT]._get_fsdp_state()
        state._lazy_init()
        current = state._device_handle.current_stream()
        state._comm_ctx.all_gather_copy_in_stream.wait_stream(current)
        state._comm_ctx.all_gather_stream.wait_stream(current)

    def prefetch(self, unit: int | None) -> None:
        """Issue ``unit``'s all-gather now, to be waited for by ``gather`` (None, or a unit already gathered or in
        flight: nothing)."""
        if not self.sharded or unit is None:
            return
        for group in self._groups[unit]:
            if group.is_unsharded or group._all_gather_result is not None:
                continue
            # FSDP's implicit prefetch: under the forward state the all-gather (and a host shard's copy) runs on
            # FSDP's own streams, and the compute stream waits for it only in ``gather``.
            with group.use_training_state(TrainingState.FORWARD):
                group.unshard(getattr(group, "unshard_async_op", False))
            self.gathers += 1

    def gather(self, unit: int) -> None:
        """``unit``'s weights on the device and registered on its module, for the compute stream from here on."""
        if not self.sharded:
            return
        self.prefetch(unit)
        for group in self._groups[unit]:
            group.wait_for_unshard()

    def release(self, unit: int) -> None:
        """Free ``unit``'s gathered weights (after its forward pass)."""
        if self.sharded:
            for group in self._groups[unit]:
                group.reshard()

    def reduce(self, unit: int) -> None:
        """Reduce-scatter the gradients ``unit``'s pass left on its gathered weights (summed over every chunk and
        rank) into the sharded gradients, and free the gathered weights."""
        if not self.sharded:
            return
        for group in self._groups[unit]:
            group.reduce_grads = True
            group.reshard_after_backward = True
            group.post_backward()
            group._training_state = TrainingState.IDLE
        self.reductions += 1

    def end(self, backward: bool) -> None:
        """After a step (``backward``: one that reduced gradients): wait for the reductions, reset FSDP's state."""
        if not self.sharded:
            return
        state = self._modules[ROOT]._get_fsdp_state()
        for groups in self._groups.values():
            for group in groups:
                if backward:
                    group.finalize_backward()
                group._training_state = TrainingState.IDLE
                group.reshard()
        current, context = state._device_handle.current_stream(), state._comm_ctx
        # The reduce-scatter inputs FSDP keeps alive until the compute stream is past them (a list since torch 2.10)
        if hasattr(context, "reduce_scatter_states"):
            reduced, context.reduce_scatter_states = list(context.reduce_scatter_states), []
        else:
            reduced, context.reduce_scatter_state = [context.reduce_scatter_state], None
        for done in reduced:
            if done is not None and done.event is not None:
                current.wait_event(done.event)

    def abort(self) -> None:
        """After a step that raised: in-flight collectives waited for, everything resharded, the step's gradient
        reductions dropped (FSDP's own recovery where this torch has it)."""
        if not self.sharded:
            return
        root = self._modules[ROOT]
        if hasattr(root, "reset_iter_state"):
            root.reset_iter_state()
            return
        for groups in self._groups.values():
            for group in groups:
                group._training_state = TrainingState.IDLE
                group.reshard()


def _param_groups(module: FSDPModule) -> list[Any]:
    """The FSDP parameter groups of ``module`` (one unless it was sharded together with others)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
