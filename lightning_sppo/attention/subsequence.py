"""Attention of one subsequence over the K/V cache, with exact gradients.

Shape legend: B batch, H query heads, G K/V groups, s subsequence length, o its offset, Dh head size.

Subsequence i (offset o, length s) attends to the cached prefix [0, o) without a mask and to itself
with a square causal mask; the two partial results are merged in fp32 through their log-sum-exps,
which is the bottom-right-aligned causal attention of q_i over [0, o + s). No kernel is ever asked
for a causal mask with fewer queries than keys (SDPA and the CPU flash op align those top-left).

Backward feeds each part the merged ``out``/``lse``, so each part's dK/dV is its exact share of the
full-sequence gradient. The prefix share goes into the cache's gradient buffer; the subsequence's
own dK/dV is its diagonal share plus whatever later subsequences already put in the buffer. Hence
backward must run last subsequence first (``KVCache`` checks it).

Packed documents (``lightning_sppo.documents``): query t attends to the keys [starts[t], t]. The subsequence's
``Pieces`` say how: the diagonal part is block-diagonal causal over the document pieces inside [o, o + s) (one
varlen kernel call), and the prefix part exists only for the rows whose first piece's document began before o,
for that piece's queries [o, o + m) against the cached keys [start, o). Rows whose document starts at o or later
read no prefix at all; the merge, the prefix backward and its dK/dV (into the buffer's [start, o)) touch only
the rows that have one. When every row agrees (one document spanning the subsequence, say), it is one call
over all rows, exactly as without documents.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sppo.attention.kernels import AttentionKernel, accumulation_dtype
from lightning_sppo.attention.kv_cache import KVCache
from lightning_sppo.attention.multiplex import Multiplex
from lightning_sppo.documents import Documents, Pieces
from lightning_sppo.model.gpt import DenseCausalAttention

__all__ = ["SubsequenceAttention", "subsequence_attention", "merge_partials"]


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial attentions over disjoint key sets, in fp32 or wider.

    out = w_a out_a + w_b out_b with w = exp(lse_part - lse): the weights are [B, H, s, 1] (small); the
    [B, H, s, Dh] work is one fp32 buffer updated in place, then cast to the output dtype (no copy when that
    is already fp32). The inputs are left unchanged.
    """
    acc = accumulation_dtype(out_a.dtype)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)  # [B, H, s]
    w_a, w_b = (torch.exp(x - lse).unsqueeze(-1) for x in (lse_a, lse_b))  # [B, H, s, 1]
    out = torch.mul(out_a, w_a) if out_a.dtype == acc else out_a.to(acc).mul_(w_a)  # the one fp32 buffer
    out.addcmul_(out_b, w_b)
    return out.to(out_a.dtype), lse


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: KVCache,
    offset: int,
    kernel: AttentionKernel,
    scale: float,
    pieces: Pieces | None = None,
):
    """Queries at ``offset`` over the cached prefix (no mask) and their own k, v (square causal): (out, lse).

    With ``pieces`` (packed documents), the diagonal is block-diagonal causal and the prefix is per row (module
    docstring)."""
    if pieces is None:
        out, lse = kernel.forward(q, k, v, True, scale)  # diagonal block, square causal
        if offset > 0:
            out_p, lse_p = kernel.forward(q, cache.k[:, :, :offset], cache.v[:, :, :offset], False, scale)
            out, lse = merge_partials(out_p, lse_p, out, lse)
        return out, lse
    out, lse = kernel.forward(q, k, v, True, scale, pieces=pieces if pieces.split else None)
    for rows, m, start in pieces.prefix_groups():
        keys = (cache.k[rows, :, start:offset], cache.v[rows, :, start:offset])
        out_p, lse_p = kernel.forward(q[rows, :, :m], *keys, False, scale)
        if rows == slice(None) and m == q.shape[2]:  # every query of every row: as without documents
            out, lse = merge_partials(out_p, lse_p, out, lse)
        else:  # only these rows' first piece: merged in place
            out[rows, :, :m], lse[rows, :, :m] = merge_partials(out_p, lse_p, out[rows, :, :m], lse[rows, :, :m])
    return out, lse


def attend_backward(
    dout: Tensor,
    q: Tensor,
    out: Tensor,
    lse: Tensor,
    cache: KVCache,
    offset: int,
    kernel: AttentionKernel,
    scale: float,
    pieces: Pieces | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``attend``: dq, and the diagonal dK/dV; the prefix's dK/dV go into the cache's fp32 buffer."""
    o, s = offset, q.shape[2]
    k, v = cache.k[:, :, o : o + s], cache.v[:, :, o : o + s]
    if pieces is None:
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale)
        if o > 0:
            dq_p, dk_p, dv_p = kernel.backward(dout, q, cache.k[:, :, :o], cache.v[:, :, :o], out, lse, False, scale)
            dq = dq.to(accumulation_dtype(dq.dtype)).add_(dq_p).to(q.dtype)  # one rounding to bf16, not two
            dk_cache, dv_cache = cache.grad_buffers()
            dk_cache[:, :, :o] += dk_p  # contributions to earlier subsequences, in fp32
            dv_cache[:, :, :o] += dv_p
        return dq, dk, dv
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale, pieces=pieces if pieces.split else None)
    groups = pieces.prefix_groups()
    if groups:
        dq = dq.to(accumulation_dtype(dq.dtype))  # one rounding to bf16, not two
        dk_cache, dv_cache = cache.grad_buffers()
    for rows, m, start in groups:
        keys = (cache.k[rows, :, start:o], cache.v[rows, :, start:o])
        dout_m, q_m, out_m, lse_m = (x[rows, :, :m] for x in (dout, q, out, lse))  # the first piece's queries
        dq_p, dk_p, dv_p = kernel.backward(dout_m, q_m, *keys, out_m, lse_m, False, scale)
        dq[rows, :, :m] += dq_p
        dk_cache[rows, :, start:o] += dk_p  # contributions to earlier subsequences of this document, in fp32
        dv_cache[rows, :, start:o] += dv_p
    return dq.to(q.dtype), dk, dv


class _SubsequenceAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache,
        plex: Multiplex,
        kernel: AttentionKernel,
        documents: Documents | None,
    ) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        cache.write(plex.sub_offset, plex.gather(k.detach()), plex.gather(v.detach()))
        pieces = None if documents is None else _window(documents, cache, plex.offset, q)
        out, lse = attend(q, k, v, cache, plex.offset, kernel, scale, pieces)
        # K/V are not saved: they live in the cache (level 1). q, out, lse are level-2 activations.
        ctx.save_for_backward(q, out, lse)
        ctx.cache, ctx.plex, ctx.kernel, ctx.scale, ctx.pieces = cache, plex, kernel, scale, pieces
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, out, lse = ctx.saved_tensors
        cache, plex = ctx.cache, ctx.plex
        cache.begin_backward(plex.sub_offset)
        buffers = cache.grad_buffers()
        dq, dk, dv = attend_backward(dout, q, out, lse, cache, plex.offset, ctx.kernel, ctx.scale, ctx.pieces)
        plex.sum_gradients(buffers)  # a shared subsequence: every member's contributions to every block
        mine = slice(plex.offset, plex.offset + q.shape[2])
        dk = (buffers[0][:, :, mine] + dk).to(cache.k.dtype)  # plus what later subsequences contributed
        dv = (buffers[1][:, :, mine] + dv).to(cache.v.dtype)
        return dq, dk, dv, None, None, None, None


def _window(documents: Documents, cache: KVCache, offset: int, q: Tensor) -> Pieces:
    """The pieces of the queries [offset, offset + s), after checking the documents describe the cached rows."""
    if documents.shape != (q.shape[0], cache.seq_len):
        raise ValueError(
            f"documents cover {documents.shape} (rows, tokens), but the K/V cache holds {q.shape[0]} rows of"
            f" {cache.seq_len} tokens: pass the documents of the whole (micro-)batch the cache belongs to."
        )
    return documents.window(offset, q.shape[2])


def subsequence_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: KVCache,
    offset: int,
    kernel: AttentionKernel,
    documents: Documents | None = None,
) -> Tensor:
    """Causal attention of q [B, H, s, Dh] over cache[0 : offset] plus its own k, v [B, G, s, Dh]; with
    ``documents`` (of the whole sequence), only within each token's document."""
    return _SubsequenceAttentionFn.apply(q, k, v, cache, Multiplex.alone(offset, q.shape[2]), kernel, documents)


class SubsequenceAttention(nn.Module):
    """Drop-in ``CausalSelfAttention.core``: cached subsequence attention when a cache is bound.

    With no cache bound (evaluation, generation of a full sequence) it behaves like the plain core. With
    ``multiplex`` set, the subsequence is shared by a group of ranks and this one computes its block.
    """

    def __init__(self, kernel: AttentionKernel) -> None:
        super().__init__()
        self.kernel = kernel
        self.cache: KVCache | None = None
        self.multiplex: Multiplex | None = None
        self._dense = DenseCausalAttention()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, offset: int = 0, documents: Documents | None = None) -> Tensor:
        if self.cache is None:
            return self._dense(q, k, v, offset, documents)
        if self.multiplex is not None:
            if offset != self.multiplex.offset:
                raise RuntimeError(
                    f"Block at offset={offset}, but the shared subsequence puts it at {self.multiplex.offset}."
                )
            return _SubsequenceAttentionFn.apply(q, k, v, self.cache, self.multiplex, self.kernel, documents)
        return subsequence_attention(q, k, v, self.cache, offset, self.kernel, documents)
