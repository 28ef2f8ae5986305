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
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_sppo.attention.kernels import AttentionKernel, accumulation_dtype
from lightning_sppo.attention.kv_cache import KVCache
from lightning_sppo.model.gpt import DenseCausalAttention

__all__ = [
    "SharedUnitAttention",
    "SubsequenceAttention",
    "attend",
    "attend_backward",
    "merge_partials",
    "subsequence_attention",
]


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
    k_prefix: Tensor | None,
    v_prefix: Tensor | None,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Queries over a prefix (no mask) and their own k, v (square causal): (out, lse).

    q [B, H, s, Dh]; k, v [B, G, s, Dh] (the queries' own tokens); k_prefix, v_prefix [B, G, o, Dh] (the tokens
    before them) or None. This is the per-query rule every path shares: a subsequence over its stage's cache, and a
    group member over the heads it holds of a shared unit (``parallel.multiplex``).
    """
    out, lse = kernel.forward(q, k, v, True, scale)  # diagonal block, square causal
    if k_prefix is not None and k_prefix.shape[2] > 0:
        out_p, lse_p = kernel.forward(q, k_prefix, v_prefix, False, scale)
        out, lse = merge_partials(out_p, lse_p, out, lse)
    return out, lse


def attend_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    k_prefix: Tensor | None,
    v_prefix: Tensor | None,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Gradients of ``attend``: dq, the diagonal dK/dV, and the prefix's dK/dV (None without a prefix)."""
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale)
    if k_prefix is None or k_prefix.shape[2] == 0:
        return dq, dk, dv, None, None
    dq_p, dk_p, dv_p = kernel.backward(dout, q, k_prefix, v_prefix, out, lse, False, scale)
    dq = dq.to(accumulation_dtype(dq.dtype)).add_(dq_p).to(q.dtype)  # one rounding to bf16, not two
    return dq, dk, dv, dk_p, dv_p


class SharedUnitAttention(Protocol):
    """Attention of a subsequence computed by a group of ranks (``parallel.multiplex.UnitAttention``)."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel) -> Tensor: ...


class _SubsequenceAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, offset: int, kernel: AttentionKernel
    ) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        cache.write(offset, k.detach(), v.detach())
        prefix = (cache.k[:, :, :offset], cache.v[:, :, :offset]) if offset > 0 else (None, None)
        out, lse = attend(q, k, v, *prefix, kernel, scale)
        # K/V are not saved: they live in the cache (level 1). q, out, lse are level-2 activations.
        ctx.save_for_backward(q, out, lse)
        ctx.cache, ctx.offset, ctx.kernel, ctx.scale = cache, offset, kernel, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, out, lse = ctx.saved_tensors
        cache, o, s = ctx.cache, ctx.offset, q.shape[2]
        cache.begin_backward(o)
        k, v = cache.k[:, :, o : o + s], cache.v[:, :, o : o + s]
        prefix = (cache.k[:, :, :o], cache.v[:, :, :o]) if o > 0 else (None, None)
        dq, dk, dv, dk_p, dv_p = attend_backward(dout, q, k, v, out, lse, *prefix, ctx.kernel, ctx.scale)
        dk_cache, dv_cache = cache.grad_buffers()
        if dk_p is not None:
            dk_cache[:, :, :o] += dk_p  # contributions to earlier subsequences, in fp32
            dv_cache[:, :, :o] += dv_p
        dk = (dk_cache[:, :, o : o + s] + dk).to(cache.k.dtype)  # plus what later subsequences contributed
        dv = (dv_cache[:, :, o : o + s] + dv).to(cache.v.dtype)
        return dq, dk, dv, None, None, None


def subsequence_attention(
    q: Tensor, k: Tensor, v: Tensor, cache: KVCache, offset: int, kernel: AttentionKernel
) -> Tensor:
    """Causal attention of q [B, H, s, Dh] over cache[0 : offset] plus its own k, v [B, G, s, Dh]."""
    return _SubsequenceAttentionFn.apply(q, k, v, cache, offset, kernel)


class SubsequenceAttention(nn.Module):
    """Drop-in ``CausalSelfAttention.core``: cached subsequence attention when a cache is bound.

    With no cache bound (evaluation, generation of a full sequence) it behaves like the plain core. With
    ``shared`` set, the subsequence is shared by a group of ranks (multiplexed sequence partitioning): q, k, v hold
    this rank's tokens of it, and ``shared`` computes their attention with the group (it knows the positions, so
    ``offset`` is not used).
    """

    def __init__(self, kernel: AttentionKernel) -> None:
        super().__init__()
        self.kernel = kernel
        self.cache: KVCache | None = None
        self.shared: SharedUnitAttention | None = None
        self._dense = DenseCausalAttention()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, offset: int = 0) -> Tensor:
        if self.shared is not None:
            return self.shared.attend(q, k, v, self.kernel)
        if self.cache is None:
            return self._dense(q, k, v, offset)
        return subsequence_attention(q, k, v, self.cache, offset, self.kernel)
