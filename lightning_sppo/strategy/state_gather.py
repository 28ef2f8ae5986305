"""Moving a pipelined, sharded model's state to one process, with bounded memory.

Each pipeline stage's state is sharded over its dp x sp ranks (FSDP2 DTensors). For a single-file
checkpoint, every shard rank of a stage unshards one tensor at a time (``DTensor.full_tensor``, a
collective over the stage's shard group) and only the stage's *leader* (shard coordinate 0) keeps it, in
host memory. Leaders then send their stage to rank 0 point to point, tensor by tensor, over a gloo group:
rank 0 holds the whole model once (it writes it), a leader its own stage, every other rank at most one
unsharded tensor at a time. Nothing is pickled as CUDA bytes (``gather_object`` over NCCL would land every
rank's pickled state on rank 0's GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

__all__ = ["full_state_on_leader", "is_stage_leader", "object_group", "recv_state", "send_state"]

_INLINE_NUMEL = 1024
"""Tensors this small (norm weights, optimizer step counts) travel inside the pickled skeleton."""

_OBJECT_GROUP: tuple[ProcessGroup, ProcessGroup | None] | None = None


def object_group(timeout: timedelta | None = None) -> ProcessGroup | None:
    """A gloo group over every rank for checkpoint metadata and host tensors; None if the default group is
    gloo already. Created once per default group, by every rank at the same point: when the strategy joins
    the processes (with the strategy's ``timeout``, so a slow gather of a large state is not cut short at
    gloo's default), or else at the first checkpoint save or load."""
    global _OBJECT_GROUP
    world = dist.group.WORLD
    if _OBJECT_GROUP is None or _OBJECT_GROUP[0] is not world:
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        _OBJECT_GROUP = (world, group)
    return _OBJECT_GROUP[1]


def is_stage_leader(model: nn.Module) -> bool:
    """Whether this rank keeps its stage's full state: shard coordinate 0, or the only rank of the stage."""
    sharded = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    return sharded is None or all(c == 0 for c in sharded.device_mesh.get_coordinate())


def full_state_on_leader(state: Any, leader: bool) -> Any:
    """``state`` (nested dicts and lists) with every tensor full and on the host on the leader; None on the
    other ranks. Every shard rank of the stage calls it with the same structure: each DTensor is one
    all-gather, and the unsharded copy is freed at once where it is not kept."""
    if isinstance(state, dict):
        full = {key: full_state_on_leader(value, leader) for key, value in state.items()}
        return full if leader else None
    if isinstance(state, list | tuple):
        full = [full_state_on_leader(value, leader) for value in state]
        return type(state)(full) if leader else None
    if isinstance(state, DTensor):
        whole = state.full_tensor()
        return whole.detach().cpu() if leader else None
    if isinstance(state, Tensor):
        return state.detach().cpu() if leader else None
    return state


@dataclass(frozen=True)
class _Slot:
    """A tensor sent after the skeleton, in depth-first order."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def send_state(state: Any, dst: int, group: ProcessGroup | None) -> None:
    """Send host ``state`` to rank ``dst``: its skeleton pickled, then each large tensor as raw bytes."""
    tensors: list[Tensor] = []
    skeleton = _hollow(state, tensors)
    dist.send_object_list([skeleton], dst=dst, group=group)
    for tensor in tensors:
        dist.send(tensor, dst=dst, group=group)


def recv_state(src: int, group: ProcessGroup | None) -> Any:
    """The ``state`` rank ``src`` sent with ``send_state``; each tensor is received into its final buffer."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    return _fill(box[0], src, group)


def _hollow(state: Any, tensors: list[Tensor]) -> Any:
    if isinstance(state, dict):
        return {key: _hollow(value, tensors) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_hollow(value, tensors) for value in state)
    if isinstance(state, Tensor) and state.numel() > _INLINE_NUMEL:
        tensors.append(state.contiguous())
        return _Slot(tuple(state.shape), state.dtype)
    return state


def _fill(skeleton: Any, src: int, group: ProcessGroup | None) -> Any:
    # Depth-first in the order ``_hollow`` appended the tensors, so the receives match the sends.
    if isinstance(skeleton, dict):
        return {key: _fill(value, src, group) for key, value in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(_fill(value, src, group) for value in skeleton)
    if isinstance(skeleton, _Slot):
        tensor = torch.empty(skeleton.shape, dtype=skeleton.dtype)
        dist.recv(tensor, src=src, group=group)
        return tensor
    return skeleton
