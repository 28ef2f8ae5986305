"""Attention of one subsequence over the K/V cache, with exact gradients.

Shape legend: B batch, H query heads, G K/V groups, s subsequence length, o its offset, Dh head size.

Subsequence i (offset o, length s) attends to the cached prefix [0, o) without a mask and to itself
with a square causal mask; the two partial results are merged in fp32 through their log-sum-exps,
which is the bottom-right-aligned causal attention of q_i over [0, o + s). No kernel is ever asked
for a causal mask with fewer queries than keys (SDPA and the CPU flash op align those top-left; every backend
refuses one, ``attention.layouts``).

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_sppo.attention.kernels import AttentionKernel, accumulation_dtype
from lightning_sppo.attention.kv_cache import GradSpan, KVBlock, KVCache, KVGradBlock
from lightning_sppo.documents import Documents, Pieces
from lightning_sppo.model.gpt import DenseCausalAttention

__all__ = [
    "AttentionReplay",
    "LayerPassAttention",
    "SharedUnitAttention",
    "SubsequenceAttention",
    "attend",
    "attend_backward",
    "attend_backward_blocks",
    "attend_blocks",
    "merge_partials",
    "prefix_block_backward",
    "prefix_groups",
    "prefix_start",
    "subsequence_attention",
]


def merge_partials(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial attentions over disjoint key sets, in fp32 or wider.

    out = w_a out_a + w_b out_b with w = exp(lse_part - lse): the weights are [B, H, s, 1] (small); the
    [B, H, s, Dh] work is one fp32 buffer updated in place, then cast to ``dtype`` (default: out_a's; no copy when
    that is already fp32). The inputs are left unchanged.
    """
    acc = accumulation_dtype(out_a.dtype)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)  # [B, H, s]
    w_a, w_b = (torch.exp(x - lse).unsqueeze(-1) for x in (lse_a, lse_b))  # [B, H, s, 1]
    out = torch.mul(out_a, w_a) if out_a.dtype == acc else out_a.to(acc).mul_(w_a)  # the one fp32 buffer
    out.addcmul_(out_b, w_b)
    return out.to(dtype or out_a.dtype), lse


def prefix_start(offset: int, pieces: Pieces | None) -> int:
    """The first key before ``offset`` that some query of the window attends (``offset``: none does).

    Without documents every query sees the whole prefix [0, offset); with them, only rows whose first document began
    before ``offset`` read the prefix, from that document's start. Callers slice (or stream) the prefix from here.
    """
    if pieces is None:
        return 0
    return min((start for _, _, start in pieces.prefix_groups()), default=offset)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_prefix: Tensor | None,
    v_prefix: Tensor | None,
    kernel: AttentionKernel,
    scale: float,
    pieces: Pieces | None = None,
) -> tuple[Tensor, Tensor]:
    """Queries over a prefix (no mask) and their own k, v (square causal): (out, lse).

    q [B, H, s, Dh]; k, v [B, G, s, Dh] (the queries' own tokens); k_prefix, v_prefix [B, G, p, Dh]: the p tokens
    just before them, [o - p, o), or None. This is the per-query rule every path shares: a subsequence over its
    stage's cache, and a group member over the heads it holds of a shared unit (``parallel.multiplex``).

    With ``pieces`` (packed documents, the window [o, o + s)), the diagonal is block-diagonal causal and row r's
    first piece attends to k_prefix's [start, o) only (module docstring); the prefix must reach back to
    ``prefix_start(o, pieces)``.
    """
    return attend_blocks(q, k, v, _one_block(k_prefix, v_prefix, pieces), kernel, scale, pieces)


def attend_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: Iterable[KVBlock],
    kernel: AttentionKernel,
    scale: float,
    pieces: Pieces | None = None,
) -> tuple[Tensor, Tensor]:
    """``attend`` with the prefix given as consecutive blocks (absolute ``start``s, in order), e.g. streamed from
    host memory chunk by chunk (``KVCache.prefix_blocks``): each block's partial attention is merged into an fp32
    running result through the log-sum-exps, and that into the diagonal's at the end, so one block is exactly
    ``attend`` over one prefix tensor. A block's tensors are dropped before the next one is asked for.
    """
    out, lse = kernel.forward(q, k, v, True, scale, pieces=pieces if pieces is not None and pieces.split else None)
    groups = prefix_groups(q, pieces)
    acc = accumulation_dtype(q.dtype)
    partial: dict[int, tuple[Tensor, Tensor]] = {}  # group -> its running (out, lse) over the blocks so far
    for start, k_b, v_b in blocks:
        end = start + k_b.shape[2]
        for index, (rows, m, first) in enumerate(groups):
            if first >= end or start == end:
                continue
            at = max(first, start) - start
            part = kernel.forward(q[rows, :, :m], k_b[rows, :, at:], v_b[rows, :, at:], False, scale)
            partial[index] = merge_partials(*partial[index], *part, dtype=acc) if index in partial else part
            del part
        del k_b, v_b
    for index, (out_p, lse_p) in partial.items():
        rows, m, _ = groups[index]
        if rows == slice(None) and m == q.shape[2]:  # every query of every row: as without documents
            out, lse = merge_partials(out_p, lse_p, out, lse, dtype=out.dtype)
        else:  # only these rows' first piece: merged in place
            out[rows, :, :m], lse[rows, :, :m] = merge_partials(out_p, lse_p, out[rows, :, :m], lse[rows, :, :m])
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
    pieces: Pieces | None = None,
    into: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Gradients of ``attend``: dq, the diagonal dK/dV, and the prefix's dK/dV [B, G, p, Dh] aligned with k_prefix
    (None when no query attends the prefix); the caller adds those where the prefix came from.

    ``into``: buffers [B, G, p, Dh] aligned with k_prefix (the cache's fp32 dK/dV) that the prefix's dK/dV are added
    to instead (then None is returned for them): rows with their own document parts go straight in, no prefix-sized
    temporary."""
    if into is not None:
        blocks = [KVGradBlock(*block, *into) for block in _one_block(k_prefix, v_prefix, pieces)]
        return *attend_backward_blocks(dout, q, k, v, out, lse, blocks, kernel, scale, pieces), None, None
    if pieces is None:
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale)
        if k_prefix is None or k_prefix.shape[2] == 0:
            return dq, dk, dv, None, None
        dq_p, dk_p, dv_p = kernel.backward(dout, q, k_prefix, v_prefix, out, lse, False, scale)
        dq = dq.to(accumulation_dtype(dq.dtype)).add_(dq_p).to(q.dtype)  # one rounding to bf16, not two
        return dq, dk, dv, dk_p, dv_p
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale, pieces=pieces if pieces.split else None)
    groups = pieces.prefix_groups()
    if not groups:
        return dq, dk, dv, None, None
    base = _prefix_base(pieces, k_prefix)
    dq = dq.to(accumulation_dtype(dq.dtype))  # one rounding to bf16, not two
    whole = len(groups) == 1 and groups[0][0] == slice(None) and groups[0][2] == base
    dk_prefix = dv_prefix = None
    if not whole:  # rows have their own parts (disjoint): one buffer the shape of the prefix
        dk_prefix, dv_prefix = torch.zeros_like(k_prefix), torch.zeros_like(v_prefix)
    for rows, m, start in groups:
        keys = (k_prefix[rows, :, start - base :], v_prefix[rows, :, start - base :])
        dout_m, q_m, out_m, lse_m = (x[rows, :, :m] for x in (dout, q, out, lse))  # the first piece's queries
        dq_p, dk_p, dv_p = kernel.backward(dout_m, q_m, *keys, out_m, lse_m, False, scale)
        dq[rows, :, :m].add_(dq_p)  # in place on the view (``+=`` on a slice would copy it back)
        if whole:
            dk_prefix, dv_prefix = dk_p, dv_p
        else:
            dk_prefix[rows, :, start - base :].add_(dk_p)
            dv_prefix[rows, :, start - base :].add_(dv_p)
    return dq.to(q.dtype), dk, dv, dk_prefix, dv_prefix


def attend_backward_blocks(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    blocks: Iterable[KVGradBlock],
    kernel: AttentionKernel,
    scale: float,
    pieces: Pieces | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``attend_blocks``: (dq, the diagonal dK/dV); each block's dK/dV are added to its ``dk``, ``dv``.

    Every block's share is exact on its own (the kernels take the merged ``out``/``lse``), so blocks may stream in
    one at a time (``KVCache.grad_blocks``); dq sums in fp32 and rounds once.
    """
    dq, dk, dv = kernel.backward(
        dout, q, k, v, out, lse, True, scale, pieces=pieces if pieces is not None and pieces.split else None
    )
    groups = prefix_groups(q, pieces)
    dq_acc = None
    for start, k_b, v_b, dk_b, dv_b in blocks:
        for rows, m, at, dq_p, dk_p, dv_p in prefix_block_backward(dout, q, out, lse, groups, start, k_b, v_b,
                                                                   kernel, scale):  # fmt: skip
            if dq_acc is None:
                dq_acc = dq.to(accumulation_dtype(dq.dtype))  # one rounding to bf16, not two
            dq_acc[rows, :, :m].add_(dq_p)  # in place on the view (``+=`` on a slice would copy it back)
            dk_b[rows, :, at:].add_(dk_p)
            dv_b[rows, :, at:].add_(dv_p)
            del dq_p, dk_p, dv_p
        del k_b, v_b, dk_b, dv_b
    return (dq if dq_acc is None else dq_acc.to(q.dtype)), dk, dv


def prefix_groups(q: Tensor, pieces: Pieces | None) -> list[tuple[slice, int, int]]:
    """(rows, m, first): the queries [0, m) of ``rows`` attend the earlier keys from ``first`` on
    (``Pieces.prefix_groups``; without documents every query of every row attends all of them)."""
    return [(slice(None), q.shape[2], 0)] if pieces is None else pieces.prefix_groups()


def prefix_block_backward(
    dout: Tensor,
    q: Tensor,
    out: Tensor,
    lse: Tensor,
    groups: list[tuple[slice, int, int]],
    start: int,
    k_b: Tensor,
    v_b: Tensor,
    kernel: AttentionKernel,
    scale: float,
) -> Iterator[tuple[slice, int, int, Tensor, Tensor, Tensor]]:
    """The share of a block of earlier keys [start, start + n) in the gradients of the queries that attend it.

    Yields, per group of ``prefix_groups``, (rows, m, at, dq, dk, dv): dq [rows, H, m, Dh] belongs to the queries
    [0, m) of ``rows``, dk and dv [rows, G, n - at, Dh] to the block's keys from ``at`` on. Each share is exact on
    its own (the kernel takes the merged ``out``/``lse``); the caller adds them where they belong.
    """
    end = start + k_b.shape[2]
    for rows, m, first in groups:
        if first >= end or start == end:
            continue
        at = max(first, start) - start
        dout_m, q_m, out_m, lse_m = (x[rows, :, :m] for x in (dout, q, out, lse))
        grads = kernel.backward(dout_m, q_m, k_b[rows, :, at:], v_b[rows, :, at:], out_m, lse_m, False, scale)
        yield rows, m, at, *grads


def _one_block(k_prefix: Tensor | None, v_prefix: Tensor | None, pieces: Pieces | None) -> list[KVBlock]:
    """A prefix tensor as the one block [o - p, o) (no block when it is empty)."""
    if k_prefix is None or k_prefix.shape[2] == 0:
        return []
    return [KVBlock(0 if pieces is None else _prefix_base(pieces, k_prefix), k_prefix, v_prefix)]


def _prefix_base(pieces: Pieces, k_prefix: Tensor | None) -> int:
    """o - p: where the given prefix starts; errors when it misses keys some row attends."""
    base = pieces.offset - (0 if k_prefix is None else k_prefix.shape[2])
    needed = prefix_start(pieces.offset, pieces)
    if needed < base:
        raise ValueError(
            f"The queries at {pieces.offset} attend to keys from {needed} (their documents began there), but the"
            f" prefix given covers only [{base}, {pieces.offset}); pass it from prefix_start()."
        )
    return base


class SharedUnitAttention(Protocol):
    """Attention of a subsequence computed by a group of ranks (``parallel.multiplex.UnitAttention``)."""

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel, documents: Documents | None = None
    ) -> Tensor: ...


class LayerPassAttention(Protocol):
    """Attention of one chunk while the layer-major engine runs a layer over the whole sequence
    (``runtime.layer_major``): it owns the layer's K/V and decides what to keep for the backward."""

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel, offset: int, documents: Documents | None
    ) -> Tensor: ...


@dataclass(eq=False)
class AttentionReplay:
    """What a recomputing block (``lightning_sppo.recompute``) asks of its core's next forward.

    Such a block runs its forward twice: once without a graph (``replaying`` False), and again in its backward,
    with one (``replaying`` True). The first writes the subsequence's K/V to the cache and, with ``keep``, leaves
    its attention's out and log-sum-exp in ``kept`` for the block to keep. The replay must not write the cache again
    (the K/V are there, and ``KVCache.write`` takes subsequences once, in order) and changes no other state; given
    ``kept`` it returns them instead of attending again, while the q, k, v it recomputed feed the attention backward.
    """

    replaying: bool = False
    keep: bool = False
    kept: tuple[Tensor, Tensor] | None = None

    @property
    def writes_cache(self) -> bool:
        return not self.replaying

    def attend(self, compute: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """(out, lse): the kept ones in a replay that has them, else ``compute()`` (kept when asked to)."""
        if self.replaying and self.kept is not None:
            return tuple(x.detach() for x in self.kept)  # new tensors: autograd makes them this Function's outputs
        out, lse = compute()
        if self.keep and not self.replaying:
            self.kept = (out, lse)
        return out, lse


class _SubsequenceAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache,
        offset: int,
        kernel: AttentionKernel,
        documents: Documents | None,
        replay: AttentionReplay | None = None,
    ) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        if replay is None or replay.writes_cache:
            cache.write(offset, k.detach(), v.detach())
        pieces = None if documents is None else _window(documents, cache, offset, q)

        def compute() -> tuple[Tensor, Tensor]:
            prefix = cache.prefix_blocks(prefix_start(offset, pieces), offset)  # in place, or streamed from host
            return attend_blocks(q, k, v, prefix, kernel, scale, pieces)

        out, lse = compute() if replay is None else replay.attend(compute)
        # K/V are not saved: they live in the cache (level 1). q, out, lse are level-2 activations.
        ctx.save_for_backward(q, out, lse)
        ctx.cache, ctx.offset, ctx.kernel, ctx.scale, ctx.pieces = cache, offset, kernel, scale, pieces
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, out, lse = ctx.saved_tensors
        cache, o, s, pieces = ctx.cache, ctx.offset, q.shape[2], ctx.pieces
        cache.begin_backward(o)
        k, v = cache.read(o, o + s)
        # Contributions to earlier subsequences go into the cache's dK/dV (fp32), block by block.
        blocks = cache.grad_blocks(prefix_start(o, pieces), o)
        dq, dk, dv = attend_backward_blocks(dout, q, k, v, out, lse, blocks, ctx.kernel, ctx.scale, pieces)
        later = cache.later_grads(o, o + s)  # what later subsequences can have contributed (None: nothing)
        if later is not None:
            _add_later(dk, dv, later, o)
        cache.end_backward(o)
        return dq, dk, dv, None, None, None, None, None


def _add_later(dk: Tensor, dv: Tensor, later: GradSpan, offset: int) -> None:
    """dk, dv (the kernel's, [B, G, s, Dh] from ``offset``) += what later subsequences summed for [start, start + n),
    in place: one kernel each that reads the sums (fp32) and dk (bf16), adds in fp32 and rounds once into dk."""
    a = later.start - offset
    for grad, summed in ((dk, later.dk), (dv, later.dv)):
        part = grad[:, :, a : a + summed.shape[2]]
        torch.add(summed, part, out=part)


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
    replay: AttentionReplay | None = None,
) -> Tensor:
    """Causal attention of q [B, H, s, Dh] over cache[0 : offset] plus its own k, v [B, G, s, Dh]; with
    ``documents`` (of the whole sequence), only within each token's document. ``replay``: see ``AttentionReplay``."""
    return _SubsequenceAttentionFn.apply(q, k, v, cache, offset, kernel, documents, replay)


class SubsequenceAttention(nn.Module):
    """Drop-in ``CausalSelfAttention.core``: cached subsequence attention when a cache is bound.

    With no cache bound (evaluation, generation of a full sequence) it behaves like the plain core. With
    ``shared`` set, the subsequence is shared by a group of ranks (multiplexed sequence partitioning): q, k, v hold
    this rank's tokens of it, and ``shared`` computes their attention with the group (it knows the positions, so
    ``offset`` is not used). ``replay`` is set by a recomputing block around its forwards (``AttentionReplay``);
    without a cache bound there is nothing to replay and the plain core simply runs again. ``layer_pass`` is set by
    the layer-major engine while it runs this layer chunk by chunk (``LayerPassAttention``).
    """

    def __init__(self, kernel: AttentionKernel) -> None:
        super().__init__()
        self.kernel = kernel
        self.cache: KVCache | None = None
        self.shared: SharedUnitAttention | None = None
        self.replay: AttentionReplay | None = None
        self.layer_pass: LayerPassAttention | None = None
        self._dense = DenseCausalAttention()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, offset: int = 0, documents: Documents | None = None) -> Tensor:
        if self.layer_pass is not None:
            return self.layer_pass.attend(q, k, v, self.kernel, offset, documents)
        if self.shared is not None:
            if self.replay is not None:
                raise RuntimeError(
                    "A shared unit's attention cannot be recomputed (its group would have to run the exchange again);"
                    " shared units run on stage shells, which apply_recompute must not touch."
                )
            return self.shared.attend(q, k, v, self.kernel, documents)
        if self.cache is None:
            return self._dense(q, k, v, offset, documents)
        return subsequence_attention(q, k, v, self.cache, offset, self.kernel, documents, self.replay)
