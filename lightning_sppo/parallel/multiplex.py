"""Attention of a shared unit (multiplexed sequence partitioning, SPPO section 6.2): tokens by member, heads by member.

Shape legend: B micro-batch rows, H query heads and G K/V groups on this SP rank (the stage's Ulysses has already
taken its share), Dh head size, m members of the group, o the unit's offset in the sequence, L its length,
P = sp chunks, c = L / P tokens per chunk, b_r member r's tokens in each chunk, n_r = P b_r its tokens after
Ulysses, g_r its K/V groups, h_r = g_r H / G its query heads.

A shared unit [o, o + L) of stage s is computed by the ranks of a group (the stage's own rank, "the owner", and
helpers from other stages). Tokens: every SP chunk of the unit (the c tokens the owner's SP rank j holds) is cut
into m contiguous blocks, member r taking b_r of them on its SP rank j; so a member's tokens arrive from, and go
back to, the owner of its own column, and nothing crosses SP columns outside the stage's own Ulysses.

Heads: around attention the group does Ulysses again, by K/V group. An all-to-all turns [my n_r tokens, all H
heads] into [all L tokens, my h_r heads] (query heads follow their K/V group, so GQA stays whole); the split is as
even as can be, the remainder going to the owner first (``group_split``), and a member may get no heads (G < m):
its queries are then attended by the others. Member r then attends exactly as the unit would on one rank, over
its heads: its own L tokens square-causal, and the prefix [0, o) of its heads without a mask (``attention.attend``,
the one per-query rule).

Packed documents: every member has the micro-batch's documents (the batch is the same on every rank of a dp group),
and after the all-to-all it holds the unit's L tokens in sequence order, so it attends by the rule of a subsequence
at o: the window's ``Pieces`` (``Documents.window(o, L)``), block-diagonal causal on the diagonal, and the prefix
part only for rows whose first document began before o, from that document's start. The prefix streamed (and its
dK/dV returned) is only [p0, o), p0 = ``prefix_start``: the earliest such start; nothing when no row needs it.

K/V never stay on a helper. The owner's SP rank keeps its stage's cache [B, G, S, Dh] for the whole sequence, as
for any unit: in the forward all-to-all the owner receives every group's K/V of the unit (not only its own) and
writes them to its cache, where later subsequences read them; a helper gets the prefix of its heads streamed from
the owner's cache for the layer it computes, and drops it after. Backward streams, per layer, the K/V [0, o + L)
of its heads (not saved in forward: they are in the owner's cache) and the dK/dV that later subsequences left in
the owner's fp32 buffers for [o, o + L); the prefix dK/dV its queries produce go back into those buffers. So a
helper holds one layer's K/V of its heads at a time, and the owner's cache stays the only copy.

Keeping a unit's whole attention on the owner is the special case where the owner gets every group (it needs no
streaming at all); ``group_split`` does that by itself when the stage has one K/V group per SP rank.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sppo.attention.kernels import AttentionKernel, accumulation_dtype
from lightning_sppo.attention.kv_cache import KVCache
from lightning_sppo.attention.subsequence import attend, attend_backward, prefix_start
from lightning_sppo.documents import Documents, Pieces
from lightning_sppo.parallel.exchange import exchange

__all__ = ["UnitAttention", "block_lengths", "group_split"]


def block_lengths(length: int, members: int, granularity: int = 1) -> list[int]:
    """Split ``length`` tokens into ``members`` contiguous blocks, multiples of ``granularity``, as even as can be."""
    units, extra = divmod(length // granularity, members)
    if units == 0:
        raise ValueError(
            f"A subsequence of {length} tokens cannot be shared by {members} ranks in blocks of at least"
            f" {granularity} tokens (sequence_parallel); use fewer num_subsequences, a longer sequence, or"
            " schedule='seq1f1b'."
        )
    return [(units + (r < extra)) * granularity for r in range(members)]


def group_split(groups: int, members: int, owner: int) -> tuple[int, ...]:
    """K/V groups of each member: as even as can be, the remainder to the owner first, then in member order.

    The owner reads its groups' prefix from its own cache, so every group it takes is one less to stream.
    """
    base, extra = divmod(groups, members)
    order = [owner] + [r for r in range(members) if r != owner]
    bonus = set(order[:extra])
    return tuple(base + (r in bonus) for r in range(members))


@dataclass(frozen=True)
class UnitAttention:
    """This rank's place in one layer of a shared unit; ``attend`` is the layer's attention (differentiable)."""

    group: dist.ProcessGroup
    index: int
    """This rank's position in the group."""
    owner: int
    """The position of the unit's stage's own rank."""
    offset: int
    """o: where the unit starts in the sequence."""
    blocks: tuple[int, ...]
    """b_r: tokens of each member in each SP chunk."""
    chunks: int = 1
    """P: SP chunks of the unit (the stage's sequence_parallel)."""
    cache: KVCache | None = None
    """The owner's K/V cache of this layer (None on helpers)."""
    grad_dtype: torch.dtype | None = None
    """The dtype of the owner's dK/dV buffers (``kv_grad_dtype``; None: ``accumulation_dtype`` of K/V)."""

    @property
    def length(self) -> int:
        return self.chunks * sum(self.blocks)

    @property
    def is_owner(self) -> bool:
        return self.index == self.owner

    def accumulation(self, dtype: torch.dtype) -> torch.dtype:
        """The owner's dK/dV buffer dtype for K/V of ``dtype`` (``KVCache.grad_buffers``): every member knows it."""
        return self.grad_dtype or accumulation_dtype(dtype)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel, documents: Documents | None = None
    ) -> Tensor:
        """q [B, H, n_me, Dh], k, v [B, G, n_me, Dh] of this rank's tokens -> the attention output [B, H, n_me, Dh].

        ``documents``: the packed documents of the micro-batch's whole sequence (the same on every member), or None.
        """
        pieces = None if documents is None else self.window(documents, q.shape[0])
        return _UnitAttentionFn.apply(q, k, v, self, kernel, pieces)

    def window(self, documents: Documents, rows: int) -> Pieces:
        """The unit's ``Pieces`` [o, o + L), after checking the documents describe the micro-batch's rows."""
        if documents.shape[0] != rows or documents.shape[1] < self.offset + self.length:
            raise ValueError(
                f"documents cover {documents.shape} (rows, tokens), but the shared unit holds {rows} rows of the tokens"
                f" [{self.offset}, {self.offset + self.length}): pass the documents of the whole micro-batch."
            )
        return documents.window(self.offset, self.length)

    # -- token layout ------------------------------------------------------------------------------

    def natural(self, pieces: list[Tensor]) -> Tensor:
        """Every member's tokens [B, h, n_i, Dh] -> the unit's tokens in sequence order [B, h, L, Dh]."""
        parts = [
            piece.narrow(2, chunk * b, b)
            for chunk in range(self.chunks)
            for piece, b in zip(pieces, self.blocks, strict=True)
        ]
        return torch.cat(parts, dim=2)

    def tokens_of(self, x: Tensor, member: int) -> Tensor:
        """Member ``member``'s tokens [B, h, n_i, Dh] of the unit's [B, h, L, Dh]."""
        c, start, b = sum(self.blocks), sum(self.blocks[:member]), self.blocks[member]
        parts = [x.narrow(2, chunk * c + start, b) for chunk in range(self.chunks)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    # -- moves with the owner ------------------------------------------------------------------------

    def from_owner(self, split: tuple[int, ...], owned: tuple[Tensor, ...] | None, like: _Like) -> tuple[Tensor, ...]:
        """Each member's K/V groups of [B, G, ., Dh] tensors the owner holds (``owned``, None on the others).

        The owner keeps views of its own groups; every other member receives copies of its groups ([B, g_r, length,
        Dh] each, as ``like`` says). Nothing moves when no member but the owner has groups (then a member without
        groups gets an empty tuple).
        """
        starts, me = _starts(split), self.index
        if not any(g for t, g in enumerate(split) if t != self.owner):
            return tuple(x[:, starts[me] : starts[me] + split[me]] for x in owned) if self.is_owner else ()
        sends: list[list[Tensor]] = [[] for _ in split]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in split]
        if self.is_owner:
            for t, g in enumerate(split):
                if t != me and g:
                    sends[t] = [x[:, starts[t] : starts[t] + g] for x in owned]
        elif split[me]:
            shapes[self.owner] = [(like.rows, split[me], like.length, like.head_size)] * like.count
        got = exchange(sends, shapes, self.group, like.dtype, like.device)
        if self.is_owner:
            return tuple(x[:, starts[me] : starts[me] + split[me]] for x in owned)
        return tuple(got[self.owner])

    def to_owner(
        self, split: tuple[int, ...], mine: tuple[Tensor, ...], buffers: tuple[Tensor, ...] | None, at: int = 0
    ) -> None:
        """Add every member's [B, g_r, e, Dh] ``mine`` into the owner's ``buffers`` [B, G, ., Dh] at [at, at + e)."""
        starts, e = _starts(split), mine[0].shape[2]
        span = slice(at, at + e)
        if self.is_owner:
            for buffer, tensor in zip(buffers, mine, strict=True):
                buffer[:, starts[self.index] : starts[self.index] + split[self.index], span] += tensor
        if not any(g for t, g in enumerate(split) if t != self.owner):
            return
        sends: list[list[Tensor]] = [[] for _ in split]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in split]
        if self.is_owner:
            rows, _, _, head_size = buffers[0].shape
            for t, g in enumerate(split):
                if t != self.owner and g:
                    shapes[t] = [(rows, g, e, head_size)] * len(mine)
        elif split[self.index]:
            sends[self.owner] = list(mine)
        got = exchange(sends, shapes, self.group, mine[0].dtype, mine[0].device)
        if self.is_owner:
            for t, pieces in enumerate(got):
                for buffer, piece in zip(buffers, pieces, strict=False):  # nothing from members without groups
                    buffer[:, starts[t] : starts[t] + split[t], span] += piece


@dataclass(frozen=True)
class _Like:
    """What a member receives from the owner: ``count`` tensors [rows, its groups, length, head_size]."""

    rows: int
    length: int
    head_size: int
    count: int
    dtype: torch.dtype
    device: torch.device


def _starts(split: tuple[int, ...]) -> list[int]:
    return [sum(split[:r]) for r in range(len(split))]


class _UnitAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, unit: UnitAttention, kernel: AttentionKernel, pieces: Pieces | None
    ) -> Tensor:
        B, H, n, Dh = q.shape
        G, m, me = k.shape[1], len(unit.blocks), unit.index
        if q.dtype != k.dtype or H % G:
            raise ValueError(f"A shared unit needs q and k in one dtype and whole query groups; got q {q.dtype}"
                             f" {H} heads, k {k.dtype} {G} groups.")  # fmt: skip
        per, split = H // G, group_split(G, m, unit.owner)
        starts = _starts(split)
        # 1. [my tokens, all heads] -> [the unit's tokens, my heads]; the owner gets every group's K/V, for its cache.
        sends, shapes = [], []
        for t in range(m):
            heads = slice(starts[t] * per, (starts[t] + split[t]) * per)
            groups = slice(None) if t == unit.owner else slice(starts[t], starts[t] + split[t])
            sends.append([q[:, heads], k[:, groups], v[:, groups]])
        g_in = G if unit.is_owner else split[me]
        for b in unit.blocks:
            tokens = unit.chunks * b
            shapes.append([(B, split[me] * per, tokens, Dh), (B, g_in, tokens, Dh), (B, g_in, tokens, Dh)])
        got = exchange(sends, shapes, unit.group, q.dtype, q.device)
        q_u, k_in, v_in = (unit.natural([pieces[i] for pieces in got]) for i in range(3))
        o = unit.offset
        if unit.is_owner:
            unit.cache.write(o, k_in, v_in)
            mine = slice(starts[me], starts[me] + split[me])
            k_u, v_u = k_in[:, mine], v_in[:, mine]
        else:
            k_u, v_u = k_in, v_in
        # 2. the prefix [p0, o) of my heads (what some row attends), from the owner's cache, for this layer only
        prefix, p0 = (None, None), prefix_start(o, pieces)
        if p0 < o:
            cached = unit.cache.read(p0, o) if unit.is_owner else None
            prefix = unit.from_owner(split, cached, _Like(B, o - p0, Dh, 2, q.dtype, q.device)) or prefix
        scale = 1.0 / math.sqrt(Dh)
        if split[me]:
            out, lse = attend(q_u, k_u, v_u, *prefix, kernel, scale, pieces)
        else:  # no heads here: the others attend this rank's queries
            out, lse = q_u.new_empty(q_u.shape), q_u.new_empty(q_u.shape[:3], dtype=torch.float32)
        del prefix, k_in, v_in, k_u, v_u
        ctx.save_for_backward(q_u, out, lse)
        ctx.unit, ctx.kernel, ctx.scale, ctx.split, ctx.pieces = unit, kernel, scale, split, pieces
        # 3. [the unit's tokens, my heads] -> [my tokens, all heads]
        sends = [[unit.tokens_of(out, i)] for i in range(m)]
        shapes = [[(B, g * per, n, Dh)] for g in split]
        got = exchange(sends, shapes, unit.group, out.dtype, out.device)
        return torch.cat([pieces[0] for pieces in got], dim=1)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q_u, out, lse = ctx.saved_tensors
        unit, split = ctx.unit, ctx.split
        B, H, n, Dh = dout.shape
        m, me, G = len(unit.blocks), unit.index, sum(split)
        per, starts, o, L = H // G, _starts(split), unit.offset, unit.length
        p0 = prefix_start(o, ctx.pieces)
        sends = [[dout[:, starts[t] * per : (starts[t] + split[t]) * per]] for t in range(m)]
        shapes = [[(B, split[me] * per, unit.chunks * b, Dh)] for b in unit.blocks]
        got = exchange(sends, shapes, unit.group, dout.dtype, dout.device)
        dout_u = unit.natural([pieces[0] for pieces in got])
        cache = unit.cache
        if unit.is_owner:
            cache.begin_backward(o)
        # K/V [p0, o + L) of my groups (not saved: the owner's cache has them), and what later subsequences left in
        # the owner's dK/dV buffers for [o, o + L) (views of the cache, or copies of what it keeps on host).
        owned = cache.read(p0, o + L) if unit.is_owner else None
        kv = unit.from_owner(split, owned, _Like(B, o + L - p0, Dh, 2, q_u.dtype, q_u.device))
        owned = cache.read_grads(o, o + L) if unit.is_owner else None
        later = unit.from_owner(split, owned, _Like(B, L, Dh, 2, unit.accumulation(q_u.dtype), q_u.device))
        if split[me]:
            k_u, v_u = kv[0][:, :, o - p0 :], kv[1][:, :, o - p0 :]
            prefix = (kv[0][:, :, : o - p0], kv[1][:, :, : o - p0]) if p0 < o else (None, None)
            dq, dk, dv, dk_p, dv_p = attend_backward(
                dout_u, q_u, k_u, v_u, out, lse, *prefix, ctx.kernel, ctx.scale, ctx.pieces
            )
            dk = (later[0] + dk).to(q_u.dtype)
            dv = (later[1] + dv).to(q_u.dtype)
        else:
            dq = q_u.new_zeros(q_u.shape)
            dk = dv = q_u.new_zeros((B, 0, L, Dh))
            dk_p = dv_p = q_u.new_zeros((B, 0, o - p0, Dh))
        del kv, later
        if p0 < o:  # the prefix's dK/dV from my queries go to the owner's buffers [p0, o) (written back if on host)
            with cache.grad_window(p0, o) if unit.is_owner else nullcontext() as window:
                unit.to_owner(split, (dk_p, dv_p), window, at=0)
        sends = [[unit.tokens_of(x, i) for x in (dq, dk, dv)] for i in range(m)]
        shapes = [[(B, g * per, n, Dh), (B, g, n, Dh), (B, g, n, Dh)] for g in split]
        got = exchange(sends, shapes, unit.group, dq.dtype, dq.device)
        dq, dk, dv = (torch.cat([pieces[i] for pieces in got], dim=1) for i in range(3))
        return dq, dk, dv, None, None, None
