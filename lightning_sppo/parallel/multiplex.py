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
with no log-sum-exp merge. In backward it streams K/V [p0, o) and [o, o + e) of its group again; its dK/dV
contributions are summed in the dK/dV dtype: the cache part into the owner's buffers, the unit part on the tokens'
members, together with the owner's, which starts from what later subsequences left in its buffers for [o, o + L). A
helper so holds one group's K/V [0, o + e) and their dK/dV for one layer, as under the group split (with a spill: the
unit's [o, o + e) and one chunk of the prefix).

Packed documents: every member has the micro-batch's documents (the batch is the same on every rank of a dp group),
and after the all-to-all it holds the unit's L tokens in sequence order, so it attends by the rule of a subsequence
at o: the window's ``Pieces`` (``Documents.window(o, L)``), block-diagonal causal on the diagonal, and the prefix
part only for rows whose first document began before o, from that document's start. The prefix streamed (and its
dK/dV returned) is only [p0, o), p0 = ``prefix_start``: the earliest such start; nothing when no row needs it.

K/V never stay on a helper. The owner's SP rank keeps its stage's cache [B, G, S, Dh] for the whole sequence, as
for any unit: in the forward all-to-all the owner receives every group's K/V of the unit (not only its own) and
writes them to its cache, where later subsequences read them; a helper gets the prefix of its heads streamed from
the owner's cache for the layer it computes, and drops it after. Backward streams, per layer, the unit's K/V
[o, o + L) of its heads (not saved in forward: they are in the owner's cache), the dK/dV that later subsequences left
in the owner's buffers for [o, o + L), and the prefix again; the prefix dK/dV its queries produce go back into those
buffers. With K/V spilled to host (``kv_device_tokens``) the prefix travels in chunks (``parallel.prefix_stream``):
the owner reads each from its cache (a host chunk arriving while the previous one is used) and sends each member its
part, and in backward each member's dK/dV of the chunk come back before the owner writes the chunk back; so neither
the owner nor a helper holds a whole layer's prefix. Without a spill the prefix is one piece: a helper holds one
layer's K/V of its heads at a time, and the owner's cache stays the only copy.

Recompute (``lightning_sppo.recompute``, blocks of shared units included): a recomputing block runs this attention
twice, in forward without a graph and again in its backward. Under "selective" the first run keeps this member's
output with its heads' (or rows') log-sum-exp, and the replay returns that output; its backward brings q and the
output back to the heads' (rows') members with the output's gradient, in the one exchange the gradient takes anyway.
Under "full" the group attends again in the replay, exactly as in forward (every member replays the same block in the
same backward, so the exchanges pair up), without writing the owner's cache.

Packed documents under the row split: each member's rows are the window [o + a, o + e) of the documents, with its own
``prefix_start``; every member computes every member's, so the exchanges agree without a message.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sppo.attention.kernels import AttentionKernel, accumulation_dtype
from lightning_sppo.attention.kv_cache import KVBlock, KVCache, KVGradBlock
from lightning_sppo.attention.layouts import tokens_joined
from lightning_sppo.attention.subsequence import AttentionReplay, attend_backward_blocks, attend_blocks, prefix_start
from lightning_sppo.documents import Documents, Pieces
from lightning_sppo.parallel.exchange import exchange
from lightning_sppo.parallel.prefix_stream import (
    Shape,
    Spill,
    group_prefix,
    group_prefix_grads,
    row_prefix,
    row_prefix_grads,
    stream_ranges,
)

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
    spill: Spill = None
    """(kv_device_tokens, kv_chunk_tokens) of the run's caches: the owner's prefix travels in chunks
    (``parallel.prefix_stream``); None: in one piece."""

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
        self, q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel, documents: Documents | None = None,
        replay: AttentionReplay | None = None,
    ) -> Tensor:  # fmt: skip
        """q [B, H, n_me, Dh], k, v [B, G, n_me, Dh] of this rank's tokens -> the attention output [B, H, n_me, Dh].

        ``documents``: the packed documents of the micro-batch's whole sequence (the same on every member), or None.
        ``replay``: set by a recomputing block (``lightning_sppo.recompute``), which runs this twice. Its first run
        (no graph) writes the owner's cache and, under "selective", keeps this rank's output with its heads'
        log-sum-exp. The replay in backward then returns the kept output, and its backward brings q and the output
        back to the heads' members with the output's gradient (one exchange); without a kept output ("full") the
        group attends again, as in forward, without writing the cache.
        """
        rows = k.shape[1] < len(self.blocks)  # fewer K/V groups than members: by query rows too
        context = documents if rows or documents is None else self.window(documents, q.shape[0])
        function, kept = (_RowAttentionFn, _KeptRowAttentionFn) if rows else (_UnitAttentionFn, _KeptUnitAttentionFn)
        if replay is None:
            return function.apply(q, k, v, self, kernel, context, True)
        if replay.writes_cache:  # the recomputing block's first run: no graph; keep what it asks for
            run = _row_forward if rows else _group_forward
            out, _ = replay.attend(lambda: run(q, k, v, self, kernel, context, True).kept)
            return out
        if replay.kept is not None:
            return kept.apply(q, k, v, self, kernel, context, replay)
        return function.apply(q, k, v, self, kernel, context, False)

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
        """Every member's tokens [B, h, n_i, Dh] -> the unit's tokens in sequence order [B, h, L, Dh], sequence-major
        (the attention kernels' layout, ``attention.layouts``)."""
        parts = [
            piece.narrow(2, chunk * b, b)
            for chunk in range(self.chunks)
            for piece, b in zip(pieces, self.blocks, strict=True)
        ]
        return tokens_joined(parts)

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
        order: [B, h1 - h0, hi - lo, Dh] per tensor, sequence-major (the attention kernels' layout).
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
        return [tokens_joined([x for _, x in sorted(parts, key=lambda p: p[0])]) for parts in runs]

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

    # -- moves with the owner ------------------------------------------------------------------------

    def from_owner(
        self, split: tuple[int, ...], owned: tuple[Tensor, ...] | None, shape: Shape, length: int, count: int,
        dtype: torch.dtype, device: torch.device,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        """Each member's K/V groups of ``count`` [B, G, length, Dh] tensors the owner holds (``owned``, None on the
        others).

        The owner keeps views of its own groups; every other member receives copies of its groups (``shape(groups,
        length)`` each). Nothing moves when no member but the owner has groups (then a member without groups gets an
        empty tuple).
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
            shapes[self.owner] = [shape(split[me], length)] * count
        got = exchange(sends, shapes, self.group, dtype, device)
        if self.is_owner:
            return tuple(x[:, starts[me] : starts[me] + split[me]] for x in owned)
        return tuple(got[self.owner])

    def add_to_owner(
        self, split: tuple[int, ...], mine: tuple[Tensor, ...], buffers: tuple[Tensor, ...] | None,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        """Every other member's [B, g_r, n, Dh] ``mine`` added into the owner's ``buffers`` [B, G, n, Dh] at its groups
        (the owner's own contributions are there already: it adds into its buffers in place)."""
        if not any(g for t, g in enumerate(split) if t != self.owner):
            return
        starts = _starts(split)
        sends: list[list[Tensor]] = [[] for _ in split]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in split]
        if self.is_owner:
            rows, _, n, head_size = buffers[0].shape
            for t, g in enumerate(split):
                if t != self.owner and g:
                    shapes[t] = [(rows, g, n, head_size)] * len(buffers)
        elif split[self.index]:
            sends[self.owner] = list(mine)
        got = exchange(sends, shapes, self.group, dtype, device)
        if self.is_owner:
            for t, pieces in enumerate(got):
                for buffer, piece in zip(buffers, pieces, strict=False):  # nothing from members without groups
                    buffer[:, starts[t] : starts[t] + split[t]] += piece

    def to_heads(self, split: tuple[int, ...], per: int, xs: list[Tensor]) -> list[Tensor]:
        """Tensors [B, H, n_me, Dh] of this member's tokens -> [B, h_me, L, Dh]: the unit's tokens of its heads."""
        B, _, _, Dh = xs[0].shape
        starts, me = _starts(split), self.index
        sends = [[x[:, starts[t] * per : (starts[t] + split[t]) * per] for x in xs] for t in range(len(split))]
        shapes = [[(B, split[me] * per, self.chunks * b, Dh)] * len(xs) for b in self.blocks]
        got = exchange(sends, shapes, self.group, xs[0].dtype, xs[0].device)
        return [self.natural([pieces[i] for pieces in got]) for i in range(len(xs))]

    # -- row split: the unit's own K/V and dK/dV ------------------------------------------------------

    def task_unit_kv(self, tasks: list[_Task], like: Tensor) -> tuple[Tensor, Tensor]:
        """Backward: K/V [o, o + e) of my group from the owner's cache (a view on the owner, copies elsewhere)."""
        o, me, L = self.offset, self.index, self.length
        sends: list[list[Tensor]] = [[] for _ in tasks]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in tasks]
        mine = tasks[me]
        if self.is_owner:
            k, v = self.cache.read(o, o + L)
            for t, x in enumerate(tasks):
                sends[t] = [] if t == me else [k[:, x.g0 : x.g1, : x.e], v[:, x.g0 : x.g1, : x.e]]
        else:
            shapes[self.owner] = [(like.shape[0], mine.width, mine.e, like.shape[3])] * 2
        got = exchange(sends, shapes, self.group, like.dtype, like.device)
        if self.is_owner:
            return k[:, mine.g0 : mine.g1, : mine.e], v[:, mine.g0 : mine.g1, : mine.e]
        return got[self.owner][0], got[self.owner][1]

    def unit_grads(self, task: _Task, dtype: torch.dtype, like: Tensor) -> list[Tensor]:
        """Backward, row split: my dK/dV of the unit's tokens [0, e), zeros in ``dtype``; the owner's cover every
        group's [0, L) and start from what later subsequences left in its buffers."""
        if self.is_owner:
            return [x.to(dtype, copy=True) for x in self.cache.read_grads(self.offset, self.offset + self.length)]
        return [like.new_zeros((like.shape[0], task.width, task.e, like.shape[3]), dtype=dtype) for _ in range(2)]


def _shape(rows: int, head_size: int) -> Shape:
    return lambda groups, tokens: (rows, groups, tokens, head_size)


def _starts(split: tuple[int, ...]) -> list[int]:
    return [sum(split[:r]) for r in range(len(split))]


def _check(q: Tensor, k: Tensor) -> None:
    if q.dtype != k.dtype or q.shape[1] % k.shape[1]:
        raise ValueError(f"A shared unit needs q and k in one dtype and whole query groups; got q {q.dtype}"
                         f" {q.shape[1]} heads, k {k.dtype} {k.shape[1]} groups.")  # fmt: skip


@dataclass(frozen=True)
class _Forward:
    """One member's forward of a shared unit's attention: its tokens' output, and what its backward needs (q, the
    attention output and its log-sum-exp, in the layout it computed them in)."""

    out: Tensor
    q: Tensor
    attention: Tensor
    lse: Tensor

    @property
    def kept(self) -> tuple[Tensor, Tensor]:
        """What a selective recompute keeps: this member's output, and the log-sum-exp of what it computed."""
        return self.out, self.lse


# -- group split: every member all the unit's tokens of some K/V groups --------------------------------


def _group_forward(
    q: Tensor, k: Tensor, v: Tensor, unit: UnitAttention, kernel: AttentionKernel, pieces: Pieces | None, write: bool
) -> _Forward:
    _check(q, k)
    B, H, n, Dh = q.shape
    G, m = k.shape[1], len(unit.blocks)
    per, split = H // G, group_split(G, m, unit.owner)
    starts = _starts(split)
    # 1. [my tokens, all heads] -> [the unit's tokens, my heads]; the owner gets every group's K/V, for its cache.
    sends, shapes = [], []
    for t in range(m):
        heads = slice(starts[t] * per, (starts[t] + split[t]) * per)
        groups = slice(None) if t == unit.owner else slice(starts[t], starts[t] + split[t])
        sends.append([q[:, heads], k[:, groups], v[:, groups]])
    g_in = G if unit.is_owner else split[unit.index]
    for b in unit.blocks:
        tokens = unit.chunks * b
        shapes.append([(B, split[unit.index] * per, tokens, Dh), (B, g_in, tokens, Dh), (B, g_in, tokens, Dh)])
    got = exchange(sends, shapes, unit.group, q.dtype, q.device)
    q_u, k_in, v_in = (unit.natural([pieces[i] for pieces in got]) for i in range(3))
    o = unit.offset
    if unit.is_owner:
        if write:  # not in a recompute's replay: the K/V are there already
            unit.cache.write(o, k_in, v_in)
        mine = slice(starts[unit.index], starts[unit.index] + split[unit.index])
        k_u, v_u = k_in[:, mine], v_in[:, mine]
    else:
        k_u, v_u = k_in, v_in
    # 2. over the prefix [p0, o) of my heads (what some row attends) from the owner's cache, chunk by chunk
    ranges = stream_ranges(prefix_start(o, pieces), o, unit.spill)
    prefix = group_prefix(unit, split, ranges, _shape(B, Dh), q.dtype, q.device)
    out, lse = attend_blocks(q_u, k_u, v_u, prefix, kernel, 1.0 / math.sqrt(Dh), pieces)
    del prefix, k_in, v_in, k_u, v_u
    # 3. [the unit's tokens, my heads] -> [my tokens, all heads]
    sends = [[unit.tokens_of(out, i)] for i in range(m)]
    shapes = [[(B, g * per, n, Dh)] for g in split]
    got = exchange(sends, shapes, unit.group, out.dtype, out.device)
    return _Forward(torch.cat([pieces[0] for pieces in got], dim=1), q_u, out, lse)


def _group_backward(
    dout_u: Tensor, q_u: Tensor, out: Tensor, lse: Tensor, unit: UnitAttention, kernel: AttentionKernel,
    pieces: Pieces | None, split: tuple[int, ...], heads: int, tokens: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv [B, ., n_me, Dh] of my tokens from my heads' dout_u, q_u, out [B, h_me, L, Dh] and lse."""
    B, _, L, Dh = q_u.shape
    m, G, o = len(split), sum(split), unit.offset
    per, acc, shape = heads // G, unit.accumulation(q_u.dtype), _shape(B, Dh)
    if unit.is_owner:
        unit.cache.begin_backward(o)
    # K/V of the unit's [o, o + L) of my groups (not saved: the owner's cache has them), and what later subsequences
    # left in the owner's dK/dV buffers for them (views of the cache, or copies of what it keeps on host).
    owned = unit.cache.read(o, o + L) if unit.is_owner else None
    k_u, v_u = unit.from_owner(split, owned, shape, L, 2, q_u.dtype, q_u.device)
    owned = unit.cache.read_grads(o, o + L) if unit.is_owner else None
    later = unit.from_owner(split, owned, shape, L, 2, acc, q_u.device)
    del owned
    # The prefix [p0, o) chunk by chunk: my queries' dK/dV go into the owner's buffers.
    ranges = stream_ranges(prefix_start(o, pieces), o, unit.spill)
    prefix = group_prefix_grads(unit, split, ranges, shape, q_u.dtype, q_u.device)
    scale = 1.0 / math.sqrt(Dh)
    dq, dk, dv = attend_backward_blocks(dout_u, q_u, k_u, v_u, out, lse, prefix, kernel, scale, pieces)
    dk = (later[0] + dk).to(q_u.dtype)
    dv = (later[1] + dv).to(q_u.dtype)
    del prefix, k_u, v_u, later
    sends = [[unit.tokens_of(x, i) for x in (dq, dk, dv)] for i in range(m)]
    shapes = [[(B, g * per, tokens, Dh), (B, g, tokens, Dh), (B, g, tokens, Dh)] for g in split]
    got = exchange(sends, shapes, unit.group, dq.dtype, dq.device)
    dq, dk, dv = (torch.cat([pieces[i] for pieces in got], dim=1) for i in range(3))
    return dq, dk, dv


class _UnitAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, unit: UnitAttention, kernel: AttentionKernel, pieces: Pieces | None,
        write: bool,
    ) -> Tensor:  # fmt: skip
        result = _group_forward(q, k, v, unit, kernel, pieces, write)
        ctx.save_for_backward(result.q, result.attention, result.lse)
        ctx.unit, ctx.kernel, ctx.pieces, ctx.groups = unit, kernel, pieces, k.shape[1]
        return result.out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q_u, out, lse = ctx.saved_tensors
        return *_group_grads(ctx, dout, [dout], q_u, out, lse), None, None, None, None


class _KeptUnitAttentionFn(torch.autograd.Function):
    """The replay of a selective recompute: the output kept from forward, and in backward q and that output back to
    the heads' members (with its gradient, one exchange) instead of keeping them in the heads' layout."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, unit: UnitAttention, kernel: AttentionKernel, pieces: Pieces | None,
        replay: AttentionReplay,
    ) -> Tensor:  # fmt: skip
        out, lse = replay.attend(_nothing_kept)
        ctx.save_for_backward(q, out, lse)
        ctx.unit, ctx.kernel, ctx.pieces, ctx.groups = unit, kernel, pieces, k.shape[1]
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, out, lse = ctx.saved_tensors
        return *_group_grads(ctx, dout, [dout, q, out], None, None, lse), None, None, None, None


def _group_grads(
    ctx: Any, dout: Tensor, moved: list[Tensor], q_u: Tensor | None, out: Tensor | None, lse: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of either group-split Function: ``moved`` (dout, and q and the output when they were not kept in the
    heads' layout) go to the heads' members in one exchange, then ``_group_backward``."""
    unit, (_, heads, tokens, _) = ctx.unit, dout.shape
    split = group_split(ctx.groups, len(unit.blocks), unit.owner)
    dout_u, *rest = unit.to_heads(split, heads // ctx.groups, moved)
    q_u, out = rest if rest else (q_u, out)
    return _group_backward(dout_u, q_u, out, lse, unit, ctx.kernel, ctx.pieces, split, heads, tokens)


def _nothing_kept() -> tuple[Tensor, Tensor]:
    raise RuntimeError("A shared unit's attention replays without the output its recompute kept.")


# -- row split: every member query rows of one K/V group ----------------------------------------------


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


def _row_heads(tasks: list[_Task], per: int, count: int = 1) -> list[list[tuple[int, int, int, int]]]:
    """``to_tasks``' wants: member t takes heads of its group and its rows, of ``count`` tensors."""
    return [[(x.g0 * per, x.g1 * per, x.a, x.e)] * count for x in tasks]


def _row_forward(
    q: Tensor, k: Tensor, v: Tensor, unit: UnitAttention, kernel: AttentionKernel, documents: Documents | None,
    write: bool,
) -> _Forward:  # fmt: skip
    _check(q, k)
    B, H, n, Dh = q.shape
    G, o, L = k.shape[1], unit.offset, unit.length
    per, tasks = H // G, _tasks(unit, G, documents)
    task = tasks[unit.index]
    # 1. q of my rows and heads (kept for backward); k, v [0, e) of my group (the owner: every group's [0, L), for
    # its cache; dropped after the layer)
    heads = _row_heads(tasks, per)
    (q_r,) = unit.to_tasks([q], heads)
    kv = [[(0, G, 0, L)] * 2 if t == unit.owner else [(x.g0, x.g1, 0, x.e)] * 2 for t, x in enumerate(tasks)]
    k_u, v_u = unit.to_tasks([k, v], kv)
    if unit.is_owner:
        if write:  # not in a recompute's replay: the K/V are there already
            unit.cache.write(o, k_u, v_u)
        k_u, v_u = k_u[:, task.g0 : task.g1], v_u[:, task.g0 : task.g1]
    # 2. my rows over the prefix: the owner's cache [cached, o) of my group, chunk by chunk, then the unit's
    # [first - o, a); and over their own keys
    ranges = stream_ranges(min(x.cached(o) for x in tasks), o, unit.spill)
    blocks: Iterable[KVBlock] = row_prefix(unit, tasks, ranges, _shape(B, Dh), q.dtype, q.device)
    start = max(task.first, o) - o
    if start < task.a:
        blocks = itertools.chain(blocks, [KVBlock(o + start, k_u[:, :, start : task.a], v_u[:, :, start : task.a])])
    diagonal = (k_u[:, :, task.a : task.e], v_u[:, :, task.a : task.e])
    out, lse = attend_blocks(q_r, *diagonal, blocks, kernel, 1.0 / math.sqrt(Dh), task.pieces)
    del blocks, k_u, v_u, diagonal
    # 3. my rows back to the tokens' members
    return _Forward(unit.from_tasks([out], heads, [H])[0], q_r, out, lse)


def _row_backward(
    dout_r: Tensor, q_r: Tensor, out: Tensor, lse: Tensor, unit: UnitAttention, kernel: AttentionKernel,
    tasks: list[_Task], heads: int, kv_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv of my tokens from my rows' dout_r, q_r, out [B, h, e - a, Dh] and lse."""
    B, _, _, Dh = q_r.shape
    me, o, L = unit.index, unit.offset, unit.length
    G = max(x.g1 for x in tasks)
    per, task, acc = heads // G, tasks[me], unit.accumulation(q_r.dtype)
    if unit.is_owner:
        unit.cache.begin_backward(o)
    # K/V [o, o + e) of my group, from the owner's cache (not kept since forward)
    k, v = unit.task_unit_kv(tasks, q_r)
    # my dK/dV of the unit's [0, e); the owner's cover every group's [0, L) and start from what later
    # subsequences left in its buffers
    contribution = unit.unit_grads(task, acc, q_r)
    dk_u, dv_u = (x[:, task.g0 : task.g1] for x in contribution) if unit.is_owner else contribution
    # the cache part [cached, o) chunk by chunk (its dK/dV to the owner's buffers), then the unit's [first - o, a)
    ranges = stream_ranges(min(x.cached(o) for x in tasks), o, unit.spill)
    blocks: Iterable[KVGradBlock] = row_prefix_grads(unit, tasks, ranges, _shape(B, Dh), q_r.dtype, acc, q_r.device)
    start = max(task.first, o) - o
    if start < task.a:
        part = slice(start, task.a)
        unit_block = KVGradBlock(o + start, k[:, :, part], v[:, :, part], dk_u[:, :, part], dv_u[:, :, part])
        blocks = itertools.chain(blocks, [unit_block])
    rows = slice(task.a, task.e)
    scale = 1.0 / math.sqrt(Dh)
    dq, dk, dv = attend_backward_blocks(dout_r, q_r, k[:, :, rows], v[:, :, rows], out, lse, blocks, kernel, scale,
                                        task.pieces)  # fmt: skip
    dk_u[:, :, rows] += dk
    dv_u[:, :, rows] += dv
    del k, v, blocks, dk, dv, dk_u, dv_u
    spans = [[(0, G, 0, L)] * 2 if t == unit.owner else [(x.g0, x.g1, 0, x.e)] * 2 for t, x in enumerate(tasks)]
    dk, dv = unit.from_tasks(contribution, spans, [G, G])
    del contribution
    (dq,) = unit.from_tasks([dq], _row_heads(tasks, per), [heads])
    return dq, dk.to(kv_dtype), dv.to(kv_dtype)


class _RowAttentionFn(torch.autograd.Function):
    """A shared unit's attention with fewer K/V groups than members: each member attends query rows [a, e) of one
    group (``team_tasks``), as a subsequence at o + a would: over the owner's cache and the unit's K/V [0, a) without a
    mask, and its own rows square-causal (``attend_blocks``). Its output rows are complete, so they go straight back;
    in backward its dK/dV contributions (the cache part to the owner's buffers, the unit part to the tokens' members)
    are summed across the members."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, unit: UnitAttention, kernel: AttentionKernel,
        documents: Documents | None, write: bool,
    ) -> Tensor:  # fmt: skip
        result = _row_forward(q, k, v, unit, kernel, documents, write)
        ctx.save_for_backward(result.q, result.attention, result.lse)
        ctx.unit, ctx.kernel, ctx.tasks, ctx.kv_dtype = unit, kernel, _tasks(unit, k.shape[1], documents), k.dtype
        return result.out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q_r, out, lse = ctx.saved_tensors
        heads = dout.shape[1]
        per = heads // max(x.g1 for x in ctx.tasks)
        (dout_r,) = ctx.unit.to_tasks([dout], _row_heads(ctx.tasks, per))
        grads = _row_backward(dout_r, q_r, out, lse, ctx.unit, ctx.kernel, ctx.tasks, heads, ctx.kv_dtype)
        return *grads, None, None, None, None


class _KeptRowAttentionFn(torch.autograd.Function):
    """``_KeptUnitAttentionFn`` for the row split: in backward q and the kept output go back to the rows' members."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, unit: UnitAttention, kernel: AttentionKernel,
        documents: Documents | None, replay: AttentionReplay,
    ) -> Tensor:  # fmt: skip
        out, lse = replay.attend(_nothing_kept)
        ctx.save_for_backward(q, out, lse)
        ctx.unit, ctx.kernel, ctx.tasks, ctx.kv_dtype = unit, kernel, _tasks(unit, k.shape[1], documents), k.dtype
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, out, lse = ctx.saved_tensors
        heads = dout.shape[1]
        per = heads // max(x.g1 for x in ctx.tasks)
        dout_r, q_r, out_r = ctx.unit.to_tasks([dout, q, out], _row_heads(ctx.tasks, per, 3))
        grads = _row_backward(dout_r, q_r, out_r, lse, ctx.unit, ctx.kernel, ctx.tasks, heads, ctx.kv_dtype)
        return *grads, None, None, None, None
