"""Chunk-major attention backward of one layer (FPDT's loop): for each K/V chunk, every query chunk that reads it.

Shape legend: B batch, H query heads, G K/V groups, s a chunk's length, Dh head size.

In the layer-major order (``runtime.layer_major``) a layer's backward starts with the gradient of every chunk's
attention output at hand. Taking the K/V chunks in order and, for each, the query chunks at or after it, finishes
that chunk's dK/dV before the next chunk starts and, at the same moment, the chunk's own dq (its queries read no
later key). So one chunk's dK/dV accumulators exist at a time, not the sequence's: the caller turns each finished
chunk into the gradients of whatever produced its q, k, v (``finish``) and drops it. dq sums in fp32 over the key
chunks and rounds once, dK/dV likewise over the query chunks; every share is exact on its own because the kernels
take each query row's merged ``out`` and ``lse`` (``attention.subsequence``).

Packed documents: a later chunk's queries read an earlier chunk only where their document began before it
(``prefix_groups``), exactly as a subsequence reads its prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sppo.attention.kernels import AttentionKernel, accumulation_dtype
from lightning_sppo.attention.subsequence import prefix_block_backward, prefix_groups
from lightning_sppo.documents import Pieces

__all__ = ["QueryChunk", "chunk_major_backward"]

Finish = Callable[[int, Tensor, Tensor, Tensor], None]
"""``finish(index, dq, dk, dv)``: chunk ``index``'s gradients are final (in the dtypes of its q, k, v)."""
KeySource = Callable[[int], tuple[Tensor, Tensor]]
"""``keys(index)``: the K/V [B, G, s, Dh] of chunk ``index`` on the device."""


@dataclass(eq=False)
class QueryChunk:
    """One chunk of a layer's queries, with what their attention backward needs: q [B, H, s, Dh], the merged out
    and its log-sum-exp [B, H, s], and the gradient of out. ``pieces``: its packed documents, or None."""

    offset: int
    q: Tensor
    out: Tensor
    lse: Tensor
    dout: Tensor
    pieces: Pieces | None = None
    _dq: Tensor | None = None

    def add_dq(self, rows: slice, m: int, dq: Tensor) -> None:
        """Add a share of dq for the queries [0, m) of ``rows`` (in fp32 from the second share on)."""
        whole = rows == slice(None) and m == self.q.shape[2]
        if self._dq is None and whole:
            self._dq = dq  # the only share unless another comes: no copy, no rounding
            return
        if self._dq is None:
            self._dq = torch.zeros(self.q.shape, dtype=accumulation_dtype(self.q.dtype), device=self.q.device)
        elif self._dq.dtype != accumulation_dtype(self.q.dtype):
            self._dq = self._dq.to(accumulation_dtype(self.q.dtype))
        self._dq[rows, :, :m].add_(dq)  # in place on the view (``+=`` on a slice would copy it back)

    def final_dq(self) -> Tensor:
        return self._dq.to(self.q.dtype)

    def release(self) -> None:
        self.q = self.out = self.lse = self.dout = self._dq = None


def chunk_major_backward(
    chunks: list[QueryChunk],
    keys: KeySource,
    kernel: AttentionKernel,
    scale: float,
    finish: Finish,
    accumulator: Callable[[Tensor], Tensor] | None = None,
) -> None:
    """The attention backward of a layer cut into ``chunks`` (in order, back to back), chunk by chunk of K/V.

    After K/V chunk j's loop, ``finish(j, dq_j, dk_j, dv_j)`` gets chunk j's final gradients, and chunk j's query
    tensors are released. ``accumulator(like)``: the zeroed fp32 buffer a chunk's dK or dV sums into when more than one
    query chunk reads it (default ``torch.zeros``; the engine passes one that counts the bytes).
    """
    new_buffer = accumulator or _zeros
    for j, own in enumerate(chunks):
        k, v = keys(j)
        split = own.pieces if own.pieces is not None and own.pieces.split else None
        dq, dk, dv = kernel.backward(own.dout, own.q, k, v, own.out, own.lse, True, scale, pieces=split)
        own.add_dq(slice(None), own.q.shape[2], dq)
        readers = chunks[j + 1 :]
        if readers:  # later queries add to this chunk's dK/dV: sum in fp32
            dk_sum, dv_sum = new_buffer(dk), new_buffer(dv)
            dk_sum += dk
            dv_sum += dv
            del dq, dk, dv
            for later in readers:
                groups = prefix_groups(later.q, later.pieces)
                for rows, m, at, dq_p, dk_p, dv_p in prefix_block_backward(
                    later.dout, later.q, later.out, later.lse, groups, own.offset, k, v, kernel, scale
                ):
                    later.add_dq(rows, m, dq_p)
                    dk_sum[rows, :, at:].add_(dk_p)
                    dv_sum[rows, :, at:].add_(dv_p)
                    del dq_p, dk_p, dv_p
            dk, dv = dk_sum.to(k.dtype), dv_sum.to(v.dtype)
            del dk_sum, dv_sum
        del k, v
        finish(j, own.final_dq(), dk, dv)
        own.release()
        del dk, dv


def _zeros(like: Tensor) -> Tensor:
    return torch.zeros(like.shape, dtype=accumulation_dtype(like.dtype), device=like.device)
