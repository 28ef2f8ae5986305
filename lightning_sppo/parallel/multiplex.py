"""Attention of a shared unit (multiplexed sequence partitioning, SPPO section 6.2): tokens by member, heads by member.

Shape legend: B micro-batch rows, H query heads and G K/V groups on this SP rank (the stage's Ulysses has already
taken its share), Dh head size, m members of the group, o the unit's offset in the sequence, L its length,
P = sp chunks, c = L / P tokens per chunk, b_r member r's tokens in each chunk, n_r = P b_r its tokens after
Ulysses, g_r its K/V groups, h_r = g_r H / G its query heads.

A shared unit [o, o + L) of stage s is computed by the ranks of a group (the stage's own rank, "the owner", and
helpers from other stages). Tokens: every SP chunk of the unit (the c tokens the owner's SP rank j holds) is cut
into m contiguous blocks, member r taking b_r of them on its SP rank j; so a member's tokens arrive from, and go
back to, the owner of its own column, and nothing crosses SP columns outside the stage's own Ulysses.

Heads (G >= m): around attention the group does Ulysses again, by K/V group. An all-to-all turns [my n_r tokens,
all H heads] into [all L tokens, my h_r heads] (query heads follow their K/V group, so GQA stays whole); the split is
as even as can be, the remainder going to the owner first (``group_split``). Member r then attends exactly as the
unit would on one rank, over its heads: its own L tokens square-causal, and the prefix [0, o) of its heads without a
mask (``attention.attend``, the one per-query rule).

Query rows (G < m, ``_RowAttentionFn``): split by group alone, m - G members would compute no attention. Instead each
group gets a team of members (``team_tasks``: sizes as even as can be, the owner leading the first), and the team cuts
the unit's query rows [0, L) into contiguous ranges of equal causal cost (``row_ranges``). Member r takes rows [a, e)
of its group's query heads: q of those rows and K/V [0, e) of its group arrive from the tokens' members
(``to_tasks``; the owner takes every group's [0, L), for its cache), and it attends them as a subsequence at o + a
would: the owner's cache [p0, o) streamed for this layer and the unit's K/V [p0 - o, a) without a mask, its own rows
square-causal. Each output row is then computed by one member alone, so the rows go straight back (``from_tasks``),
with no log-sum-exp merge. In backward it streams K/V [p0, o + e) of its group again; its dK/dV contributions are
summed in the dK/dV dtype: the cache part into the owner's buffers, the unit part on the tokens' members, together with
the owner's, which starts from what later subsequences left in its buffers for [o, o + L). A helper so holds one
group's K/V [0, o + e) and their dK/dV for one layer, as under the group split.

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

Packed documents under the row split: each member's rows are the window [o + a, o + e) of the documents, with its own
``prefix_start``; every member computes every member's, so the exchanges agree without a message.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sppo.attention.kernels import AttentionKernel, accumulation_dtype
from lightning_sppo.attention.kv_cache import KVBlock, KVCache, KVGradBlock
from lightning_sppo.attention.subsequence import (
    attend,
    attend_backward,
    attend_backward_blocks,
    attend_blocks,
    prefix_start,
)
from lightning_sppo.documents import Documents, Pieces
from lightning_sppo.parallel.exchange import exchange

__all__ = ["UnitAttention", "block_lengths", "group_split", "row_ranges", "team_tasks"]


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


def row_ranges(offset: int, length: int, members: int) -> list[tuple[int, int]]:
    """Cut the unit's query rows [0, length) into ``members`` contiguous, non-empty ranges of equal causal cost.

    Row t of a unit at ``offset`` attends offset + t + 1 keys, so rows [0, e) cost C(e) = e o + e (e + 1) / 2; cut k
    is the row where C reaches k / members of the whole (rounded, then nudged so that every range keeps a row). Early
    units (small o) get long first ranges and short last ones; late units nearly equal ones.
    """
    if members > length:
        raise ValueError(
            f"{length} query rows cannot be split over {members} ranks; use fewer num_subsequences or"
            " schedule='seq1f1b'."
        )
    b = 2 * offset + 1
    total = length * offset + length * (length + 1) / 2
    cuts = [0]
    for k in range(1, members):
        target = total * k / members
        e = round((-b + math.sqrt(b * b + 8 * target)) / 2)
        cuts.append(min(max(e, cuts[-1] + 1), length - (members - k)))
    cuts.append(length)
    return [(cuts[k], cuts[k + 1]) for k in range(members)]


def team_tasks(
    groups: int, members: int, owner: int, offset: int, length: int
) -> tuple[tuple[int, int, int, int], ...]:
    """(first K/V group, end group, first row, end row) of each member, for fewer groups than members.

    Every group gets a team (sizes as even as can be, members taken owner first, then in order) that cuts the group's
    query rows by ``row_ranges``; each member attends its rows, for its group's query heads, over the whole causal
    prefix, so each output row is computed by one member alone (no log-sum-exp merge across ranks). One group per
    member keeps what a helper holds at one group's K/V (and dK/dV), as under the group split; the price is balance
    when the members are not a multiple of the groups (9 members, 8 groups: one team of two, seven of one, so the
    slowest member still attends a whole group).
    """
    base, extra = divmod(members, groups)
    order = [owner] + [r for r in range(members) if r != owner]
    tasks: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * members
    taken = 0
    for group in range(groups):
        size = base + (group < extra)
        for member, (a, e) in zip(order[taken : taken + size], row_ranges(offset, length, size), strict=True):
            tasks[member] = (group, group + 1, a, e)
        taken += size
    return tuple(tasks)


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
        if k.shape[1] < len(self.blocks):  # fewer K/V groups than members: by query rows too
            return _RowAttentionFn.apply(q, k, v, self, kernel, documents)
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

    def overlap(self, member: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(its index, unit position, count) of each run of ``member``'s tokens inside the unit's [lo, hi), in order."""
        c, start, b = sum(self.blocks), sum(self.blocks[:member]), self.blocks[member]
        runs = []
        for chunk in range(self.chunks):
            first, end = max(lo, chunk * c + start), min(hi, chunk * c + start + b)
            if first < end:
                runs.append((chunk * b + first - chunk * c - start, first, end - first))
        return runs

    def to_tasks(self, xs: list[Tensor], wants: list[list[tuple[int, int, int, int]]]) -> list[Tensor]:
        """Tokens to the members that compute with them.

        ``xs``: this member's tokens [B, h_i, n_me, Dh] of some tensors; ``wants[t][i]`` = (h0, h1, lo, hi): member t
        takes heads [h0, h1) of the unit's tokens [lo, hi) of tensor i. Returns what this member takes, in sequence
        order: [B, h1 - h0, hi - lo, Dh] per tensor.
        """
        me, m = self.index, len(self.blocks)
        B, Dh = xs[0].shape[0], xs[0].shape[3]
        sends = [
            [xs[i][:, h0:h1].narrow(2, at, n) for i, (h0, h1, lo, hi) in enumerate(wants[t])
             for at, _, n in self.overlap(me, lo, hi)]
            for t in range(m)
        ]  # fmt: skip
        shapes = [
            [(B, h1 - h0, n, Dh) for h0, h1, lo, hi in wants[me] for _, _, n in self.overlap(r, lo, hi)]
            for r in range(m)
        ]
        got = exchange(sends, shapes, self.group, xs[0].dtype, xs[0].device)
        runs: list[list[tuple[int, Tensor]]] = [[] for _ in wants[me]]
        for r in range(m):
            pieces = iter(got[r])
            for i, (_, _, lo, hi) in enumerate(wants[me]):
                runs[i] += [(position, next(pieces)) for _, position, _ in self.overlap(r, lo, hi)]
        return [torch.cat([x for _, x in sorted(parts, key=lambda p: p[0])], dim=2) for parts in runs]

    def from_tasks(
        self, xs: list[Tensor], spans: list[list[tuple[int, int, int, int]]], widths: list[int]
    ) -> list[Tensor]:
        """What the members computed, back to the tokens' members, summed: the inverse of ``to_tasks``.

        ``xs[i]``: this member's [B, h1 - h0, hi - lo, Dh] of tensor i, where ``spans[me][i]`` = (h0, h1, lo, hi);
        every member t holds ``spans[t][i]``. Returns tensor i [B, widths[i], n_me, Dh] of this member's tokens: the
        sum of what every member holds of them (zeros where none does), in ``xs``' dtype.
        """
        me, m = self.index, len(self.blocks)
        B, Dh, dtype, device = xs[0].shape[0], xs[0].shape[3], xs[0].dtype, xs[0].device
        unit_tokens = self.chunks * self.blocks[me]
        sends = [
            [x.narrow(2, position - lo, count) for x, (_, _, lo, hi) in zip(xs, spans[me], strict=True)
             for _, position, count in self.overlap(r, lo, hi)]
            for r in range(m)
        ]  # fmt: skip
        shapes = [
            [(B, h1 - h0, count, Dh) for h0, h1, lo, hi in spans[t] for _, _, count in self.overlap(me, lo, hi)]
            for t in range(m)
        ]
        got = exchange(sends, shapes, self.group, dtype, device)
        out = [torch.zeros((B, width, unit_tokens, Dh), dtype=dtype, device=device) for width in widths]
        for t in range(m):
            pieces = iter(got[t])
            for i, (h0, h1, lo, hi) in enumerate(spans[t]):
                for at, _, count in self.overlap(me, lo, hi):
                    out[i][:, h0:h1, at : at + count] += next(pieces)
        return out

    def cache_blocks(self, tasks: list[_Task], like: Tensor) -> Iterable[KVBlock]:
        """Forward: the owner's cache [cached, o) of each member's group, as blocks: the owner reads its own in place
        (streamed from host where spilled), every other member receives a copy (one exchange, skipped when no other
        member reads the cache)."""
        o, me = self.offset, self.index
        mine = tasks[me]
        others = [t for t, x in enumerate(tasks) if t != self.owner and x.cached(o) < o]
        got: list[Tensor] = []
        if others:
            sends: list[list[Tensor]] = [[] for _ in tasks]
            shapes: list[list[tuple[int, ...]]] = [[] for _ in tasks]
            if self.is_owner:
                first = min(tasks[t].cached(o) for t in others)
                k, v = self.cache.read(first, o)
                for t in others:
                    x, at = tasks[t], tasks[t].cached(o) - first
                    sends[t] = [k[:, x.g0 : x.g1, at:], v[:, x.g0 : x.g1, at:]]
            elif me in others:
                shapes[self.owner] = [(like.shape[0], mine.width, o - mine.cached(o), like.shape[3])] * 2
            got = exchange(sends, shapes, self.group, like.dtype, like.device)[self.owner]
        if self.is_owner:
            g = slice(mine.g0, mine.g1)
            blocks = self.cache.prefix_blocks(mine.cached(o), o)
            return (KVBlock(at, keys[:, g], values[:, g]) for at, keys, values in blocks)
        return [KVBlock(mine.cached(o), *got)] if got else []

    def task_kv(self, tasks: list[_Task], like: Tensor) -> tuple[Tensor, Tensor]:
        """Backward: K/V [cached, o + e) of my group from the owner's cache (a view on the owner, copies elsewhere)."""
        o, me = self.offset, self.index
        sends: list[list[Tensor]] = [[] for _ in tasks]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in tasks]
        if self.is_owner:
            first = min(x.cached(o) for x in tasks)
            k, v = self.cache.read(first, o + self.length)
            for t, x in enumerate(tasks):
                part = slice(x.cached(o) - first, o + x.e - first)
                sends[t] = [] if t == me else [k[:, x.g0 : x.g1, part], v[:, x.g0 : x.g1, part]]
            mine = tasks[me]
            part = slice(mine.cached(o) - first, o + mine.e - first)
        else:
            mine = tasks[me]
            shapes[self.owner] = [(like.shape[0], mine.width, o + mine.e - mine.cached(o), like.shape[3])] * 2
        got = exchange(sends, shapes, self.group, like.dtype, like.device)
        if self.is_owner:
            return k[:, mine.g0 : mine.g1, part], v[:, mine.g0 : mine.g1, part]
        return got[self.owner][0], got[self.owner][1]

    def grad_buffers(self, task: _Task, dtype: torch.dtype, like: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Backward, row split: (my dK/dV of the unit's tokens, of the cache part [cached, o) of my group), zeros in
        ``dtype``. The owner's first cover every group's [0, L) and start from what later subsequences left in its
        buffers; it has no second (its cache part adds straight into its buffers)."""
        o, B, Dh = self.offset, like.shape[0], like.shape[3]
        if self.is_owner:
            return [x.to(dtype, copy=True) for x in self.cache.read_grads(o, o + self.length)], []
        unit = [like.new_zeros((B, task.width, task.e, Dh), dtype=dtype) for _ in range(2)]
        return unit, [like.new_zeros((B, task.width, o - task.cached(o), Dh), dtype=dtype) for _ in range(2)]

    def prefix_grads_to_owner(self, tasks: list[_Task], prefix: list[Tensor], like: Tensor, dtype: torch.dtype) -> None:
        """Backward: the other members' dK/dV of the cache part [cached, o) of their group (``prefix`` here), added into
        the owner's buffers (the owner's own went in during its backward)."""
        o, me = self.offset, self.index
        others = [t for t, x in enumerate(tasks) if x.cached(o) < o and t != self.owner]
        if not others:
            return
        sends: list[list[Tensor]] = [[] for _ in tasks]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in tasks]
        if self.is_owner:
            B, _, _, Dh = like.shape
            shapes = [
                [(B, tasks[t].width, o - tasks[t].cached(o), Dh)] * 2 if t in others else [] for t in range(len(tasks))
            ]
        elif me in others:
            sends[self.owner] = list(prefix)
        got = exchange(sends, shapes, self.group, dtype, like.device)
        if not self.is_owner:
            return
        first = min(tasks[t].cached(o) for t in others)
        with self.cache.grad_window(first, o) as window:
            for t in others:
                x = tasks[t]
                for buffer, piece in zip(window, got[t], strict=True):
                    buffer[:, x.g0 : x.g1, x.cached(o) - first :] += piece

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


@dataclass(frozen=True)
class _Task:
    """A member's part of a row-split unit: query rows [a, e) of the K/V groups [g0, g1); ``first``: the first key before
    o + a some of its rows attend (``prefix_start``; o + a: none), with the window's ``pieces`` (documents)."""

    g0: int
    g1: int
    a: int
    e: int
    first: int
    pieces: Pieces | None

    @property
    def width(self) -> int:
        """Its K/V groups."""
        return self.g1 - self.g0

    def cached(self, offset: int) -> int:
        """Where its keys in the owner's cache begin: it reads [cached, offset) from there (nothing when = offset)."""
        return min(self.first, offset)


def _tasks(unit: UnitAttention, groups: int, documents: Documents | None) -> list[_Task]:
    """Every member's task (the same on every member: all have the documents)."""
    o, out = unit.offset, []
    for g0, g1, a, e in team_tasks(groups, len(unit.blocks), unit.owner, o, unit.length):
        pieces = None if documents is None else documents.window(o + a, e - a)
        out.append(_Task(g0, g1, a, e, prefix_start(o + a, pieces), pieces))
    return out


class _RowAttentionFn(torch.autograd.Function):
    """A shared unit's attention with fewer K/V groups than members: each member attends query rows [a, e) of one
    group (``team_tasks``), as a subsequence at o + a would: over the owner's cache and the unit's K/V [0, a) without a
    mask, and its own rows square-causal (``attend_blocks``). Its output rows are complete, so they go straight back;
    in backward its dK/dV contributions (the cache part to the owner's buffers, the unit part to the tokens' members)
    are summed across the members."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, unit: UnitAttention, kernel: AttentionKernel,
        documents: Documents | None,
    ) -> Tensor:  # fmt: skip
        B, H, n, Dh = q.shape
        G, me, o, L = k.shape[1], unit.index, unit.offset, unit.length
        if q.dtype != k.dtype or H % G:
            raise ValueError(f"A shared unit needs q and k in one dtype and whole query groups; got q {q.dtype}"
                             f" {H} heads, k {k.dtype} {G} groups.")  # fmt: skip
        per, tasks = H // G, _tasks(unit, G, documents)
        task = tasks[me]
        # 1. q of my rows and heads (kept for backward); k, v [0, e) of my group (the owner: every group's [0, L), for
        # its cache; dropped after the layer)
        heads = [[(x.g0 * per, x.g1 * per, x.a, x.e)] for x in tasks]
        (q_r,) = unit.to_tasks([q], heads)
        kv = [[(0, G, 0, L)] * 2 if t == unit.owner else [(x.g0, x.g1, 0, x.e)] * 2 for t, x in enumerate(tasks)]
        k_u, v_u = unit.to_tasks([k, v], kv)
        if unit.is_owner:
            unit.cache.write(o, k_u, v_u)
            k_u, v_u = k_u[:, task.g0 : task.g1], v_u[:, task.g0 : task.g1]
        # 2. my rows over the prefix: the cache's [cached, o) of my group (streamed from the owner for this layer
        # only), then the unit's [first - o, a); and over their own keys
        blocks = unit.cache_blocks(tasks, q)
        start = max(task.first, o) - o
        if start < task.a:
            blocks = itertools.chain(blocks, [KVBlock(o + start, k_u[:, :, start : task.a], v_u[:, :, start : task.a])])
        scale = 1.0 / math.sqrt(Dh)
        diagonal = (k_u[:, :, task.a : task.e], v_u[:, :, task.a : task.e])
        out, lse = attend_blocks(q_r, *diagonal, blocks, kernel, scale, task.pieces)
        del blocks, k_u, v_u, diagonal
        ctx.save_for_backward(q_r, out, lse)
        ctx.unit, ctx.kernel, ctx.scale, ctx.tasks, ctx.kv_dtype = unit, kernel, scale, tasks, k.dtype
        # 3. my rows back to the tokens' members
        return unit.from_tasks([out], heads, [H])[0]

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q_r, out, lse = ctx.saved_tensors
        unit, tasks = ctx.unit, ctx.tasks
        B, H, n, Dh = dout.shape
        me, o, L = unit.index, unit.offset, unit.length
        G = max(x.g1 for x in tasks)
        per, task, acc = H // G, tasks[me], unit.accumulation(q_r.dtype)
        heads = [[(x.g0 * per, x.g1 * per, x.a, x.e)] for x in tasks]
        (dout_r,) = unit.to_tasks([dout], heads)
        if unit.is_owner:
            unit.cache.begin_backward(o)
        # K/V [cached, o + e) of my group, from the owner's cache (not kept since forward)
        k, v = unit.task_kv(tasks, q_r)
        # my dK/dV of the unit's [0, e); the owner's cover every group's [0, L) and start from what later
        # subsequences left in its buffers
        contribution, prefix = unit.grad_buffers(task, acc, q_r)
        dk_u, dv_u = (x[:, task.g0 : task.g1] for x in contribution) if unit.is_owner else contribution
        cut = o - task.cached(o)  # k, v: the cache part [cached, o), then the unit's [0, e)
        g = slice(task.g0, task.g1)
        if unit.is_owner:  # its cache part adds straight into its buffers (streamed through where spilled)
            blocks = itertools.chain(
                (KVGradBlock(at, *(x[:, g] for x in xs)) for at, *xs in unit.cache.grad_blocks(o - cut, o)),
                [],
            )
        else:
            blocks = [KVGradBlock(o - cut, k[:, :, :cut], v[:, :, :cut], *prefix)] if cut else []
        start = max(task.first, o) - o
        if start < task.a:
            part = slice(cut + start, cut + task.a)
            blocks = itertools.chain(blocks, [KVGradBlock(o + start, k[:, :, part], v[:, :, part], dk_u[:, :, start : task.a],
                                                  dv_u[:, :, start : task.a])])  # fmt: skip
        rows = slice(cut + task.a, cut + task.e)
        dq, dk, dv = attend_backward_blocks(
            dout_r, q_r, k[:, :, rows], v[:, :, rows], out, lse, blocks, ctx.kernel, ctx.scale, task.pieces
        )
        dk_u[:, :, task.a : task.e] += dk
        dv_u[:, :, task.a : task.e] += dv
        del k, v, blocks, dk, dv, dk_u, dv_u
        unit.prefix_grads_to_owner(tasks, prefix, q_r, acc)
        del prefix
        spans = [[(0, G, 0, L)] * 2 if t == unit.owner else [(x.g0, x.g1, 0, x.e)] * 2
                 for t, x in enumerate(tasks)]  # fmt: skip
        dk, dv = unit.from_tasks(contribution, spans, [G, G])
        del contribution
        (dq,) = unit.from_tasks([dq], heads, [H])
        return dq, dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), None, None, None
