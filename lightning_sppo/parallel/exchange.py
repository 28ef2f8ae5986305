"""Uneven all-to-all of tensor lists inside a process group: how the members of a shared unit trade data.

``exchange(sends, shapes, group)``: this member sends the tensors of ``sends[t]`` to member t and receives from
each member i tensors of the shapes ``shapes[i]``, as one ``all_to_all_single`` with split sizes (both NCCL and
gloo take uneven and empty splits). Scattering from one member and gathering to one are the cases where only
that member sends or receives; the others still call it, with empty lists: every member of a group must issue
each collective, in the same order (NCCL's rule, ``parallel.comm_order``).

All tensors of one exchange share a dtype; they are packed into one flat buffer in member order, and what arrives
is returned as views of one flat buffer, in the order of ``shapes``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["exchange"]

Shape = tuple[int, ...]


def exchange(
    sends: Sequence[Sequence[Tensor]],
    shapes: Sequence[Sequence[Shape]],
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> list[list[Tensor]]:
    """Send ``sends[t]`` to member t, receive tensors of ``shapes[i]`` from member i (positions in ``group``)."""
    members = dist.get_world_size(group)
    if len(sends) != members or len(shapes) != members:
        raise ValueError(f"exchange needs one entry per member of the group ({members}), got {len(sends)} sends"
                         f" and {len(shapes)} shape lists.")  # fmt: skip
    for tensor in (t for pieces in sends for t in pieces):
        if tensor.dtype != dtype:
            raise ValueError(f"exchange moves one dtype per call ({dtype}); got a {tensor.dtype} tensor.")
    send_sizes = [sum(t.numel() for t in pieces) for pieces in sends]
    recv_sizes = [sum(math.prod(shape) for shape in pieces) for pieces in shapes]
    flat = [t.reshape(-1) for pieces in sends for t in pieces if t.numel()]
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    dist.all_to_all_single(out, inp, recv_sizes, send_sizes, group=group)
    received, start = [], 0
    for pieces in shapes:
        mine = []
        for shape in pieces:
            size = math.prod(shape)
            mine.append(out[start : start + size].view(shape))
            start += size
        received.append(mine)
    return received
