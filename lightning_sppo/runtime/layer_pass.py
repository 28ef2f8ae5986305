"""What a layer's attention core does for each chunk while the layer-major engine runs the layer over the sequence.

Shape legend: B batch, H query heads, G K/V groups, P sequence-parallel ranks, c a chunk's tokens (c/P on each
rank), Dh head size.

The engine binds a ``LayerPass`` to the layer's ``SubsequenceAttention`` core (its ``layer_pass``) for one pass over
the chunks, forward or replay (``runtime.layer_major``). Under Ulysses sequence parallelism (``group``, P ranks)
each rank holds c/P consecutive tokens of every chunk, rank r the r-th piece, as the subsequence order splits a
subsequence (``parallel.ulysses``); the block computes its projections on those, and the pass exchanges:

    forward, per chunk   q, k, v  [B, H|G, c/P, Dh] -> [B, H/P|G', c, Dh]   one all-to-all (``to_heads``)
                         out      [B, H/P, c, Dh]   -> [B, H, c/P, Dh]      one all-to-all (``to_sequence``)
    replay, per chunk    the same two (the replay's K/V refill the cache; out goes back for the projection)
    backward, per chunk  dout     [B, H, c/P, Dh]   -> [B, H/P, c, Dh]      one all-to-all (``query_chunks``)
                         dq, dk, dv back to the tokens: one all-to-all (``gradients_to_sequence``)

G' is G/P K/V groups, or one (repeated) group when G < P. So attention, the K/V cache of the whole sequence, and
everything kept for the backward (the attention output and its log-sum-exp under "selective") are head-sharded;
the all-to-alls sit on the compute stream's critical path (nothing overlaps them). Without ``group`` the pass is
the one-device pass: no exchange, local tokens are the chunk's.

Forward: write the chunk's K/V to the cache, attend to the cached prefix and itself, keep (out, lse) when ``keep``.
Replay (backward): write the recomputed K/V, keep q, and return the kept out (``kept``; else attend again) as a leaf
whose gradient is the attention's dout. Packed documents are cut per chunk of the whole sequence (``window``), so
a document that crosses ranks' pieces, or chunks, is masked exactly as on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sppo.attention.chunk_major import QueryChunk
from lightning_sppo.attention.kernels import AttentionKernel
from lightning_sppo.attention.kv_cache import KVCache
from lightning_sppo.attention.subsequence import attend_blocks, prefix_start
from lightning_sppo.documents import Documents, Pieces
from lightning_sppo.parallel.ulysses import repeat_kv_groups, sum_kv_copies, to_heads, to_sequence

__all__ = ["ChunkSpans", "LayerPass"]


@dataclass(frozen=True)
class ChunkSpans:
    """A step's chunks: (offset, length) of each in the whole sequence, and of this rank's piece of each."""

    spans: tuple[tuple[int, int], ...]
    ranks: int = 1
    rank: int = 0

    @property
    def local(self) -> tuple[tuple[int, int], ...]:
        """This rank's tokens of each chunk: the ``rank``-th of ``ranks`` equal consecutive pieces."""
        return tuple((o + self.rank * (s // self.ranks), s // self.ranks) for o, s in self.spans)

    def index(self, offset: int, length: int) -> int:
        """The chunk whose local piece is (offset, length)."""
        for index, span in enumerate(self.local):
            if span == (offset, length):
                return index
        raise RuntimeError(f"The layer-major engine has no chunk piece ({offset}, {length}); they are {self.local}.")


@dataclass(eq=False)
class LayerPass:
    """One pass of a layer's attention over the chunks (module docstring): the ``LayerPassAttention`` of its core."""

    cache: KVCache
    chunks: ChunkSpans
    group: dist.ProcessGroup | None = None
    keep: bool = False
    kept: list[tuple[Tensor, Tensor]] | None = None
    replay: bool = False
    outputs: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    queries: dict[int, Tensor] = field(default_factory=dict)
    leaves: dict[int, Tensor] = field(default_factory=dict)
    pieces: dict[int, Pieces | None] = field(default_factory=dict)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel, offset: int, documents: Documents | None
    ) -> Tensor:
        """q [B, H, c/P, Dh], k, v [B, G, c/P, Dh] of this rank's piece at ``offset`` -> out [B, H, c/P, Dh]."""
        index = self.chunks.index(offset, q.shape[2])
        start, length = self.chunks.spans[index]
        q, k, v = q.detach(), k.detach(), v.detach()
        if self.group is not None:  # [B, H/P, c, Dh], [B, G', c, Dh]: my heads of the whole chunk
            ranks = dist.get_world_size(self.group)
            q, k, v = to_heads([q, repeat_kv_groups(k, ranks), repeat_kv_groups(v, ranks)], self.group)
        self.cache.write(start, k, v)
        pieces = None if documents is None else documents.window(start, length)
        if self.kept is not None:
            out, lse = self.kept[index]
        else:
            prefix = self.cache.prefix_blocks(prefix_start(start, pieces), start)
            out, lse = attend_blocks(q, k, v, prefix, kernel, 1.0 / math.sqrt(q.shape[-1]), pieces)
        if self.keep or self.replay:
            self.outputs[index] = (out, lse)
        local = out if self.group is None else to_sequence([out], self.group)[0]
        if not self.replay:
            return local
        self.queries[index], self.pieces[index] = q, pieces
        leaf = self.leaves[index] = local.detach().requires_grad_()
        return leaf

    def query_chunks(self) -> list[QueryChunk]:
        """After the replay of every chunk: their attention backward's inputs, in order (dout exchanged to heads
        chunk by chunk, in chunk order on every rank)."""
        chunks = []
        for index, (offset, _) in enumerate(self.chunks.spans):
            out, lse = self.outputs.pop(index)
            leaf = self.leaves.pop(index)
            dout = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            del leaf
            if self.group is not None:
                dout = to_heads([dout], self.group)[0]
            chunks.append(QueryChunk(offset, self.queries.pop(index), out, lse, dout, self.pieces.pop(index)))
        return chunks

    def gradients_to_sequence(self, dq: Tensor, dk: Tensor, dv: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
        """A chunk's final dq, dk, dv (head-sharded) -> this rank's tokens, all heads (K/V copies summed back into
        the model's ``groups``); as they are without sequence parallelism."""
        if self.group is None:
            return dq, dk, dv
        dq, dk, dv = to_sequence([dq, dk, dv], self.group)
        return dq, sum_kv_copies(dk, groups), sum_kv_copies(dv, groups)
