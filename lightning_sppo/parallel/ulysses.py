"""Ulysses sequence parallelism inside a stage: all-to-all to a head-sharded layout around attention.

Shape legend: B batch, H heads (or K/V groups) in total, P = sp size, c tokens of the subsequence on this
rank (the subsequence has P * c), Dh head size.

Each SP rank holds a contiguous chunk of c tokens of every subsequence. Around attention, an all-to-all
turns [B, H, c, Dh] (all heads, my tokens) into [B, H/P, P*c, Dh] (my heads, all tokens of the
subsequence), so attention, and the K/V cache, are head-sharded; a second all-to-all turns the output back.

``to_heads`` and ``to_sequence`` are the same exchanges without autograd, for several tensors in one all-to-all
(the layer order, ``runtime.layer_pass``, moves q, k and v together, and dq, dk and dv). Their K/V rule for fewer
K/V groups than ranks (G < P, P % G == 0, MQA included): each group is repeated P / G times before the exchange, so
every rank receives the one group its query heads read (``kv_heads``), and the gradients of the copies are summed
on the way back (``sum_kv_copies``). The exchanged tensors are laid out as a sequence-major buffer seen through a
transpose ([B, S, heads, Dh] memory), as the fused projection leaves them on one device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sppo.attention.layouts import BSHD, empty_in
from lightning_sppo.attention.subsequence import SubsequenceAttention
from lightning_sppo.documents import Documents
from lightning_sppo.model.gpt import CausalSelfAttention

__all__ = [
    "UlyssesAttention",
    "apply_ulysses",
    "heads_to_sequence",
    "kv_heads",
    "repeat_kv_groups",
    "sequence_to_heads",
    "sum_kv_copies",
    "to_heads",
    "to_sequence",
]


def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """all_to_all_single over dim 0 (one slice per rank)."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous, like x now: the collective reads and writes flat memory
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    B, H, c, Dh = x.shape
    P = dist.get_world_size(group)
    send = x.view(B, P, H // P, c, Dh).transpose(0, 1)  # [P, B, H/P, c, Dh]: slice j goes to rank j
    recv = _all_to_all(send, group)  # [P, B, H/P, c, Dh]: slice j is rank j's tokens of my heads
    # One copy into [B, H/P, P*c, Dh] over [B, P*c, H/P, Dh] memory: the attention kernels' layout for q, k, v and
    # dout (``attention.layouts``), which a reshape (contiguous [B, H/P, P*c, Dh]) would make them copy again.
    out = empty_in((B, H // P, P * c, Dh), BSHD, dtype=recv.dtype, device=recv.device)
    out.view(B, H // P, P, c, Dh).copy_(recv.permute(1, 2, 0, 3, 4))
    return out


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    B, Hp, s, Dh = x.shape
    P = dist.get_world_size(group)
    send = x.view(B, Hp, P, s // P, Dh).permute(2, 0, 1, 3, 4)  # [P, B, H/P, c, Dh]: slice j: rank j's tokens
    recv = _all_to_all(send, group)  # [P, B, H/P, c, Dh]: slice j is my tokens of rank j's heads
    return recv.transpose(0, 1).reshape(B, Hp * P, s // P, Dh)


def kv_heads(groups: int, ranks: int) -> int:
    """K/V heads exchanged per rank's tokens: the model's ``groups``, or ``ranks`` when there are fewer groups than
    ranks (each repeated ``ranks // groups`` times: module docstring)."""
    if groups % ranks and ranks % groups:
        raise ValueError(
            f"Ulysses sequence parallelism shards K/V groups over ranks: n_query_groups={groups} and"
            f" sequence_parallel={ranks} must divide one another; try sequence_parallel={math.gcd(groups, ranks)}."
        )
    return max(groups, ranks)


def repeat_kv_groups(x: Tensor, ranks: int) -> Tensor:
    """[B, G, c, Dh] -> [B, kv_heads(G, P), c, Dh]: each group repeated P / G times when G < P (else ``x``)."""
    groups = x.shape[1]
    return x if groups >= ranks else x.repeat_interleave(kv_heads(groups, ranks) // groups, dim=1)


def sum_kv_copies(grad: Tensor, groups: int) -> Tensor:
    """The inverse of ``repeat_kv_groups`` for gradients: [B, P, c, Dh] -> [B, G, c, Dh], the copies of each group
    summed (``grad`` itself when nothing was repeated)."""
    B, copies, c, Dh = grad.shape
    return grad if copies == groups else grad.view(B, groups, copies // groups, c, Dh).sum(2)


def to_heads(xs: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Each [B, n, c, Dh] (n heads, this rank's c tokens) -> [B, n/P, P*c, Dh] (this rank's heads, the P ranks'
    tokens in rank order), all in one all-to-all; no autograd."""
    P = dist.get_world_size(group)
    B, _, c, Dh = xs[0].shape
    widths = [x.shape[1] // P for x in xs]
    send = xs[0].new_empty((P, B, c, sum(widths), Dh))  # slice j goes to rank j: its heads of my tokens
    at = 0
    for x, width in zip(xs, widths, strict=True):
        send[:, :, :, at : at + width].copy_(x.view(B, P, width, c, Dh).permute(1, 0, 3, 2, 4))
        at += width
    recv = _all_to_all(send, group)  # slice j: rank j's tokens of my heads
    tokens = recv.permute(1, 0, 2, 3, 4).reshape(B, P * c, sum(widths), Dh)  # a view for B = 1
    return [part.transpose(1, 2) for part in tokens.split(widths, dim=2)]


def to_sequence(xs: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """The inverse of ``to_heads``: each [B, m, P*c, Dh] (this rank's m heads, every token) -> [B, m*P, c, Dh]
    (every head, this rank's tokens), all in one all-to-all; no autograd."""
    P = dist.get_world_size(group)
    B, _, S, Dh = xs[0].shape
    c, widths = S // P, [x.shape[1] for x in xs]
    send = xs[0].new_empty((P, B, c, sum(widths), Dh))  # slice j goes to rank j: my heads of its tokens
    at = 0
    for x, width in zip(xs, widths, strict=True):
        send[:, :, :, at : at + width].copy_(x.view(B, width, P, c, Dh).permute(2, 0, 3, 1, 4))
        at += width
    recv = _all_to_all(send, group)  # slice j: rank j's heads of my tokens
    out, at = [], 0
    for width in widths:  # heads j * width .. (j + 1) * width - 1 came from rank j
        part = recv[:, :, :, at : at + width].permute(1, 2, 0, 3, 4).reshape(B, c, P * width, Dh)
        out.append(part.transpose(1, 2))
        at += width
    return out


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _seq_to_heads(grad, ctx.group), None


def sequence_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[B, H, c, Dh] (all heads, local tokens) -> [B, H/P, P*c, Dh] (local heads, all tokens); differentiable."""
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Inverse of ``sequence_to_heads``; differentiable."""
    return _HeadsToSequence.apply(x, group)


class UlyssesAttention(nn.Module):
    """Attention core for a sequence-parallel stage: all-to-all around a head-sharded subsequence core.

    The model passes the offset of this rank's chunk (so RoPE sees true positions); the subsequence
    starts ``sp_rank * c`` tokens earlier. ``documents`` (packed documents) describe the whole sequence, so the
    head-sharded core sees the document pieces of the whole subsequence, not only of this rank's chunk.
    """

    def __init__(self, inner: SubsequenceAttention, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        self.rank = dist.get_rank(group)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, offset: int = 0, documents: Documents | None = None) -> Tensor:
        chunk = q.shape[2]
        q, k, v = (sequence_to_heads(x, self.group) for x in (q, k, v))
        # ``documents`` cover the whole sequence: the inner core cuts the pieces of the whole subsequence.
        out = self.inner(q, k, v, offset - self.rank * chunk, documents)  # [B, H/P, P*c, Dh]
        return heads_to_sequence(out, self.group)


def apply_ulysses(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Wrap every subsequence attention core of ``model`` for sequence parallelism over ``group``."""
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            if not isinstance(module.core, SubsequenceAttention):
                raise TypeError("apply_subsequence_attention must run before apply_ulysses.")
            module.core = UlyssesAttention(module.core, group)
