"""Attention of one subsequence computed by a group of ranks, each holding a block of it (SPPO's MSP).

Shape legend: B batch, H query heads, G K/V groups (both per SP rank), L subsequence length, o its
offset, L_r the block of group member r, o_r = o + L_0 + ... + L_{r-1}, Dh head size.

Multiplexed sequence partitioning splits a subsequence [o, o + L) into contiguous blocks, one per rank of
a group that all hold the stage's weights. Each member runs the stage on its block; around attention the
members all-gather the block K/V, so every member writes the whole subsequence into its own K/V cache
(later subsequences, on any of them, read it as prefix). Member r's queries then attend exactly as a
subsequence at offset o_r would: to the cache before o_r without a mask, to their own block with a
square causal mask.

Backward: member r's prefix dK/dV go into its own fp32 gradient buffer, which now holds contributions to
blocks of other members too. Summing the buffers' [o, o + L) over the group gives every block its total
(from later subsequences, wherever they ran, and from later blocks of this one); member r adds its
diagonal share to its slice. A subsequence a rank computes alone is the one-member case
(``Multiplex.alone``): the autograd function in ``subsequence.py`` serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Multiplex", "block_lengths", "gather_blocks"]


@dataclass(frozen=True)
class Multiplex:
    """Where this rank's block sits in a subsequence shared by ``group``."""

    group: dist.ProcessGroup | None
    index: int  # this rank's position in the group
    lengths: tuple[int, ...]  # tokens of each member's block (head-sharded layout: every token of the block)
    sub_offset: int  # o: where the subsequence starts

    @property
    def offset(self) -> int:
        """o_r: where this rank's block starts."""
        return self.sub_offset + sum(self.lengths[: self.index])

    @property
    def length(self) -> int:
        return sum(self.lengths)

    @classmethod
    def alone(cls, offset: int, length: int) -> Multiplex:
        """A subsequence this rank computes by itself: one block, no group."""
        return cls(None, 0, (length,), offset)

    def gather(self, x: Tensor) -> Tensor:
        """The whole subsequence's K or V [B, G, L, Dh] from every member's block [B, G, L_r, Dh]."""
        return x if self.group is None else torch.cat(gather_blocks(x, self.lengths, self.group, dim=2), dim=2)

    def sum_gradients(self, buffers: tuple[Tensor, Tensor]) -> None:
        """In place: the dK/dV buffers' [o, o + L) summed over the group."""
        if self.group is None:
            return
        start, end = self.sub_offset, self.sub_offset + self.length
        both = torch.stack([b[:, :, start:end] for b in buffers])
        dist.all_reduce(both, group=self.group)
        for buffer, total in zip(buffers, both, strict=True):
            buffer[:, :, start:end].copy_(total)


def block_lengths(length: int, members: int, granularity: int) -> list[int]:
    """Split ``length`` tokens into ``members`` contiguous blocks, multiples of ``granularity``, as even as can be."""
    units, extra = divmod(length // granularity, members)
    if units == 0:
        raise ValueError(
            f"A subsequence of {length} tokens cannot be shared by {members} ranks in blocks of at least"
            f" {granularity} tokens (sequence_parallel); use fewer num_subsequences, a longer sequence, or"
            " schedule='seq1f1b'."
        )
    return [(units + (r < extra)) * granularity for r in range(members)]


def gather_blocks(x: Tensor, lengths: tuple[int, ...] | list[int], group: dist.ProcessGroup, dim: int) -> list[Tensor]:
    """Every member's block of ``x`` along ``dim`` (blocks may differ in length: padded for the collective)."""
    longest = max(lengths)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, longest - x.shape[dim]]
    padded = F.pad(x, pad).contiguous()
    out = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(out, padded, group=group)
    return [block.narrow(dim, 0, n) for block, n in zip(out, lengths, strict=True)]
