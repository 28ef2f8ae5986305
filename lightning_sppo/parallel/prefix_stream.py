"""The owner's cached prefix, streamed to the members of a shared unit chunk by chunk (``parallel.multiplex``).

Shape legend: B micro-batch rows, G' K/V groups of the owner's SP rank, g a member's groups, n tokens of a chunk, Dh
head size; o the unit's offset.

A shared unit's queries attend the prefix [p0, o) that the owner's K/V cache holds. Without a K/V spill the cache
holds it on the device and it travels in one piece (``stream_ranges``: one range). With a spill (``kv_device_tokens``
R, ``kv_chunk_tokens`` c) it travels in chunks: the device part [p0, min(o, R)) cut every c tokens from p0, the host
part [max(p0, R), o) in the cache's own chunks (every c tokens from R). Every member computes the same ranges from the
run's settings, so the chunks need no message about their sizes, and every member issues one exchange per chunk in
the same order (NCCL's rule), whether or not it attends that chunk.

forward   per chunk, the owner reads it (views of the device part; a host chunk arrives while the previous one is
          attended: ``KVCache.prefix_blocks``) and sends each member its K/V groups; each member attends the chunk
          (``attention.attend_blocks`` merges it through the log-sum-exps) and drops it before the next
backward  per chunk, the owner reads its K/V and dK/dV (``KVCache.grad_blocks``: dK/dV of a host chunk are read in,
          and written back when the next chunk is asked for) and sends each member the K/V of its groups; each member
          adds its queries' dK/dV into a zeroed chunk (the owner straight into the chunk it read) and sends them back
          (in the K/V dtype under the group split, as one kernel call leaves them; in the dK/dV dtype under the row
          split); the owner adds them before the chunk is written back

So with a spill the owner holds, beyond its device part, the chunks ``KVCache`` streams (two of K/V, three of dK/dV),
and a helper one chunk of its groups' K/V (and their dK/dV) at a time: no rank materialises the whole prefix.
The group split (every member some K/V groups of all rows) and the row split (every member one group's rows [a, e),
reading the prefix from its own ``cached`` start) use the same chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sppo.attention.kv_cache import KVBlock, KVCache, KVGradBlock
from lightning_sppo.parallel.exchange import exchange

__all__ = [
    "Spill",
    "group_prefix",
    "group_prefix_grads",
    "owner_blocks",
    "owner_grad_blocks",
    "row_prefix",
    "row_prefix_grads",
    "stream_ranges",
]

Spill = tuple[int, int] | None
"""(kv_device_tokens, kv_chunk_tokens) of the run's K/V caches, or None without a spill."""

Shape = Callable[[int, int], tuple[int, int, int, int]]
"""(groups, tokens) -> the shape [B, groups, tokens, Dh] of a chunk on this member."""


class UnitAttention(Protocol):
    """What the streams use of a member's place in a shared unit (``parallel.multiplex.UnitAttention``)."""

    group: dist.ProcessGroup
    index: int
    owner: int
    offset: int
    cache: KVCache | None

    @property
    def is_owner(self) -> bool: ...

    def from_owner(
        self, split: tuple[int, ...], owned: tuple[Tensor, ...] | None, shape: Shape, length: int, count: int,
        dtype: torch.dtype, device: torch.device,
    ) -> tuple[Tensor, ...]: ...  # fmt: skip

    def add_to_owner(
        self, split: tuple[int, ...], mine: tuple[Tensor, ...], buffers: tuple[Tensor, ...] | None,
        dtype: torch.dtype, device: torch.device,
    ) -> None: ...  # fmt: skip


class _Task(Protocol):
    """A member's rows of the row split (``parallel.multiplex._Task``): its K/V groups [g0, g1) and where its keys in
    the owner's cache begin."""

    g0: int
    g1: int

    @property
    def width(self) -> int: ...

    def cached(self, offset: int) -> int: ...


def stream_ranges(first: int, end: int, spill: Spill) -> list[tuple[int, int]]:
    """The chunks [a, b) the cached prefix [first, end) travels in (module docstring); none when it is empty."""
    if first >= end:
        return []
    if spill is None:
        return [(first, end)]
    device_tokens, chunk = spill
    split = min(max(first, device_tokens), end)  # where the device part ends
    device = [(a, min(a + chunk, split)) for a in range(first, split, chunk)]
    host = [(a, min(a + chunk, end)) for a in range(max(first, device_tokens), end, chunk)]
    return device + host


# -- the owner's reads, cut to the ranges ------------------------------------------------------------


def owner_blocks(cache: KVCache, ranges: Sequence[tuple[int, int]]) -> Iterator[KVBlock]:
    """The cache's K/V over ``ranges`` (consecutive), one block per range: ``KVCache.prefix_blocks`` with its device
    block cut into views. Drop a block before asking for the next one."""
    if not ranges:
        return
    wanted = iter(ranges)
    for block in cache.prefix_blocks(ranges[0][0], ranges[-1][1]):
        for a, b in _cut(block.start, block.k.shape[2], wanted):
            yield KVBlock(
                a, block.k[:, :, a - block.start : b - block.start], block.v[:, :, a - block.start : b - block.start]
            )
        del block


def owner_grad_blocks(cache: KVCache, ranges: Sequence[tuple[int, int]]) -> Iterator[KVGradBlock]:
    """``owner_blocks`` with each block's dK/dV (``KVCache.grad_blocks``): add into them before asking for the next
    block, which writes a host chunk back. Exhaust the iterator so the last chunk is written back too."""
    if not ranges:
        return
    wanted = iter(ranges)
    for block in cache.grad_blocks(ranges[0][0], ranges[-1][1]):
        for a, b in _cut(block.start, block.k.shape[2], wanted):
            part = slice(a - block.start, b - block.start)
            yield KVGradBlock(a, *(x[:, :, part] for x in (block.k, block.v, block.dk, block.dv)))
        del block


def _cut(start: int, length: int, wanted: Iterator[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The ranges that tile the cache's block [start, start + length); the cache must cut where ``stream_ranges``
    does (its host chunks), or the members would expect other chunks than the owner sends."""
    at = start
    while at < start + length:
        a, b = next(wanted, (None, None))
        if a != at or b is None or b > start + length:
            raise RuntimeError(
                f"The K/V cache streams [{start}, {start + length}) as one block, but the shared unit's chunks expect"
                f" [{a}, {b}) at {at}: stream_ranges no longer matches KVCache's chunks."
            )
        yield a, b
        at = b


def _finish(owned: Iterator | None) -> None:
    """Run the owner's reads to their end (the last host chunk of dK/dV is written back then)."""
    for _ in owned or ():
        raise RuntimeError("The K/V cache streamed more of the prefix than the shared unit's chunks cover.")


# -- group split: every member some K/V groups of all rows -------------------------------------------


def group_prefix(
    unit: UnitAttention, split: tuple[int, ...], ranges: Sequence[tuple[int, int]], shape: Shape, dtype: torch.dtype,
    device: torch.device,
) -> Iterator[KVBlock]:  # fmt: skip
    """Forward: this member's groups of each chunk of the owner's prefix, in order (nothing on a member without
    groups, which still takes part in every exchange)."""
    owned = owner_blocks(unit.cache, ranges) if unit.is_owner else None
    for a, b in ranges:
        block = next(owned) if owned is not None else None
        got = unit.from_owner(split, None if block is None else (block.k, block.v), shape, b - a, 2, dtype, device)
        del block
        if got:
            yield KVBlock(a, *got)
        del got
    _finish(owned)


def group_prefix_grads(
    unit: UnitAttention, split: tuple[int, ...], ranges: Sequence[tuple[int, int]], shape: Shape, dtype: torch.dtype,
    device: torch.device,
) -> Iterator[KVGradBlock]:  # fmt: skip
    """Backward: each chunk's K/V of this member's groups with the dK/dV its queries add to: the owner's buffers
    themselves on the owner; elsewhere a zeroed chunk in the K/V dtype, sent back to the owner (which adds it into its
    buffers) once the chunk is done. One kernel call per row adds to it (rows of different documents are disjoint), so
    the K/V dtype holds the kernel's result exactly and the chunk travels at half the fp32 bytes."""
    owned = owner_grad_blocks(unit.cache, ranges) if unit.is_owner else None
    me, first = unit.index, sum(split[: unit.index])
    mine = slice(first, first + split[me])
    for a, b in ranges:
        block = next(owned) if owned is not None else None
        kv = unit.from_owner(split, None if block is None else (block.k, block.v), shape, b - a, 2, dtype, device)
        if block is not None:
            grads = (block.dk[:, mine], block.dv[:, mine])
        else:
            grads = tuple(torch.zeros(shape(split[me], b - a), dtype=dtype, device=device) for _ in range(2))
        if split[me]:
            yield KVGradBlock(a, *kv, *grads)
        del kv
        unit.add_to_owner(split, grads, None if block is None else (block.dk, block.dv), dtype, device)
        del block, grads
    _finish(owned)


# -- row split: every member one group's rows [a, e), from its own start -----------------------------


def row_prefix(
    unit: UnitAttention, tasks: Sequence[_Task], ranges: Sequence[tuple[int, int]], shape: Shape, dtype: torch.dtype,
    device: torch.device,
) -> Iterator[KVBlock]:  # fmt: skip
    """Forward: each chunk's part this member's rows attend (its group, from its ``cached`` start), in order."""
    owned = owner_blocks(unit.cache, ranges) if unit.is_owner else None
    mine = tasks[unit.index]
    for a, b in ranges:
        block = next(owned) if owned is not None else None
        got = _row_kv(unit, tasks, a, b, block, shape, dtype, device)
        lo = max(a, mine.cached(unit.offset))
        if lo < b:
            yield KVBlock(lo, *got)
        del block, got
    _finish(owned)


def row_prefix_grads(
    unit: UnitAttention, tasks: Sequence[_Task], ranges: Sequence[tuple[int, int]], shape: Shape, dtype: torch.dtype,
    accumulation: torch.dtype, device: torch.device,
) -> Iterator[KVGradBlock]:  # fmt: skip
    """Backward: ``row_prefix`` with the dK/dV this member's rows add to (the owner's buffers themselves on the owner,
    a zeroed chunk elsewhere, sent back and added there once the chunk is done)."""
    owned = owner_grad_blocks(unit.cache, ranges) if unit.is_owner else None
    o, me, owner = unit.offset, unit.index, unit.owner
    mine = tasks[me]
    for a, b in ranges:
        block = next(owned) if owned is not None else None
        kv = _row_kv(unit, tasks, a, b, block, shape, dtype, device)
        lo = max(a, mine.cached(o))
        grads: tuple[Tensor, ...] = ()
        if lo < b:
            if block is not None:
                grads = tuple(x[:, mine.g0 : mine.g1, lo - a :] for x in (block.dk, block.dv))
            else:
                grads = tuple(torch.zeros(shape(mine.width, b - lo), dtype=accumulation, device=device) for _ in "kv")
            yield KVGradBlock(lo, *kv, *grads)
        del kv
        # every other member's dK/dV of the chunk back to the owner, added where its group's keys are
        takers = _takers(tasks, o, owner, a, b)
        if takers:
            sends: list[list[Tensor]] = [[] for _ in tasks]
            shapes: list[list[tuple[int, ...]]] = [[] for _ in tasks]
            if me in takers:
                sends[owner] = list(grads)
            if unit.is_owner:
                shapes = [[shape(tasks[t].width, b - takers[t])] * 2 if t in takers else [] for t in range(len(tasks))]
            got = exchange(sends, shapes, unit.group, accumulation, device)
            if block is not None:
                for t, start in takers.items():
                    x = tasks[t]
                    for buffer, piece in zip((block.dk, block.dv), got[t], strict=True):
                        buffer[:, x.g0 : x.g1, start - a :] += piece
            del got
        del block, grads
    _finish(owned)


def _takers(tasks: Sequence[_Task], offset: int, owner: int, a: int, b: int) -> dict[int, int]:
    """The members other than the owner whose rows attend some of the chunk [a, b), with where they begin in it."""
    starts = {t: max(a, x.cached(offset)) for t, x in enumerate(tasks) if t != owner}
    return {t: start for t, start in starts.items() if start < b}


def _row_kv(
    unit: UnitAttention, tasks: Sequence[_Task], a: int, b: int, block: KVBlock | KVGradBlock | None, shape: Shape,
    dtype: torch.dtype, device: torch.device,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The chunk [a, b)'s K/V of this member's group from its start on: views on the owner, one exchange for the
    others (skipped when no other member attends the chunk)."""
    o, me, owner = unit.offset, unit.index, unit.owner
    mine = tasks[me]
    takers = _takers(tasks, o, owner, a, b)
    got: tuple[Tensor, ...] = ()
    if takers:
        sends: list[list[Tensor]] = [[] for _ in tasks]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in tasks]
        if block is not None:
            for t, start in takers.items():
                x = tasks[t]
                sends[t] = [block.k[:, x.g0 : x.g1, start - a :], block.v[:, x.g0 : x.g1, start - a :]]
        elif me in takers:
            shapes[owner] = [shape(mine.width, b - takers[me])] * 2
        received = exchange(sends, shapes, unit.group, dtype, device)
        got = tuple(received[owner])
    if block is not None:
        lo = max(a, mine.cached(o))
        return tuple(x[:, mine.g0 : mine.g1, lo - a :] for x in (block.k, block.v)) if lo < b else ()
    return got
