"""Document-masked attention: each kernel's block-diagonal pieces, and subsequence attention over the cache,
against a dense fp64 attention whose mask keeps every query inside its document."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo.attention import (
    KVCache,
    ReferenceKernel,
    SDPAKernel,
    attend,
    attend_backward,
    prefix_start,
    subsequence_attention,
)
from lightning_sppo.documents import Documents
from lightning_sppo.partition import spans as to_spans
from tests.conftest import document_ids_from_lengths, random_document_lengths

KERNELS = [ReferenceKernel(), ReferenceKernel(block_q=3), SDPAKernel()]


def masked_attention_fp64(q, k, v, document_ids, scale):
    """q [B, H, S, Dh], k/v [B, G, S, Dh]: query t sees key j when doc(j) == doc(t) and j <= t. (out, lse)."""
    q, k, v = q.double(), k.double(), v.double()
    H, G, S = q.shape[1], k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [B, S, S]
    scores = scores.masked_fill(~(causal & same)[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v, scores.logsumexp(-1)


def _inputs(B, H, G, S, D=8, dtype=torch.float32):
    return (
        torch.randn(B, H, S, D, dtype=dtype),
        torch.randn(B, G, S, D, dtype=dtype),
        torch.randn(B, G, S, D, dtype=dtype),
    )


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k.name}")
@pytest.mark.parametrize("groups", [4, 1])
@pytest.mark.parametrize("rows", [[[3, 1, 8, 5]], [[1, 16], [9, 8]]], ids=["one-row", "two-rows"])
def test_each_kernel_pieces_match_dense_masked_fp64(kernel, groups, rows):
    document_ids = document_ids_from_lengths(rows)
    B, S = document_ids.shape
    q, k, v = _inputs(B, 4, groups, S)
    scale = 1 / math.sqrt(q.shape[-1])
    pieces = Documents.from_ids(document_ids).window(0, S)
    out, lse = kernel.forward(q, k, v, True, scale, pieces=pieces)

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = masked_attention_fp64(*leaves, document_ids, scale)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=1e-5, atol=1e-5)

    dq, dk, dv = kernel.backward(dout.to(q.dtype), q, k, v, out, lse, True, scale, pieces=pieces)
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        assert got.shape == leaf.shape
        torch.testing.assert_close(got.double(), leaf.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k.name}")
def test_negative_control_pieces_change_the_result(kernel):
    document_ids = document_ids_from_lengths([[5, 11]])
    q, k, v = _inputs(1, 2, 2, 16)
    pieces = Documents.from_ids(document_ids).window(0, 16)
    masked, _ = kernel.forward(q, k, v, True, 0.3, pieces=pieces)
    causal, _ = kernel.forward(q, k, v, True, 0.3)
    torch.testing.assert_close(masked[:, :, :5], causal[:, :, :5])  # the first document sees the same keys
    assert not torch.allclose(masked[:, :, 5:], causal[:, :, 5:])


def test_pieces_are_refused_for_a_rectangular_or_non_causal_call():
    pieces = Documents.from_ids(torch.zeros(1, 6, dtype=torch.long)).window(0, 6)
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 9, 8)
    for kernel in KERNELS:
        with pytest.raises(ValueError, match="square causal attention"):
            kernel.forward(q, k, k, True, 0.3, pieces=pieces)
        with pytest.raises(ValueError, match="square causal attention"):
            kernel.forward(q, q, q, False, 0.3, pieces=pieces)


def _run(q, k, v, lengths, kernel, documents):
    """Every subsequence over the cache, backward last first; the output, the leaves' gradients and dout."""
    cache = KVCache(q.shape[2])
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    douts = torch.randn(q.shape, dtype=q.dtype)
    outs = []
    for off, n in to_spans(lengths):
        part = (x[:, :, off : off + n] for x in leaves)
        outs.append(subsequence_attention(*part, cache, off, kernel, documents))
    for (off, n), out in reversed(list(zip(to_spans(lengths), outs, strict=True))):
        out.backward(douts[:, :, off : off + n])
    return torch.cat([o.detach() for o in outs], dim=2), [x.grad for x in leaves], douts


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp(min=1.0)).item()


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    max_document=st.integers(1, 25),
    groups=st.sampled_from([1, 2, 4]),
    batch=st.integers(1, 2),
    kernel=st.sampled_from(KERNELS),
    seed=st.integers(0, 2**16),
)
def test_subsequences_with_documents_reproduce_masked_attention(lengths, max_document, groups, batch, kernel, seed):
    torch.manual_seed(seed)
    S = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    document_ids = document_ids_from_lengths([random_document_lengths(gen, S, max_document) for _ in range(batch)])
    q, k, v = _inputs(batch, 4, groups, S)
    out, grads, douts = _run(q, k, v, lengths, kernel, Documents.from_ids(document_ids))
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = masked_attention_fp64(*leaves, document_ids, 1 / math.sqrt(q.shape[-1]))
    ref.backward(douts.double())
    assert _rel(out, ref.detach()) < 1e-5
    assert max(_rel(g, leaf.grad) for g, leaf in zip(grads, leaves, strict=True)) < 1e-5


class CountingKernel(SDPAKernel):
    """Records the key lengths of every non-causal (prefix) call."""

    def __init__(self) -> None:
        self.prefix_keys: list[tuple[int, int]] = []

    def forward(self, q, k, v, causal, scale, *, pieces=None):
        if not causal:
            self.prefix_keys.append((q.shape[0], k.shape[2]))
        return super().forward(q, k, v, causal, scale, pieces=pieces)


def test_rows_whose_document_starts_in_the_subsequence_read_no_prefix():
    """The compute saving: only the first piece's document, and only from its start, is read from the cache."""
    document_ids = document_ids_from_lengths([[10, 14], [3, 21]])
    q, k, v = _inputs(2, 2, 2, 24)
    kernel = CountingKernel()
    _run(q, k, v, [8, 8, 8], kernel, Documents.from_ids(document_ids))
    # Subsequence at 8: row 0's document began at 0 (keys 0..7), row 1's at 3 (keys 3..7). At 16: row 0's began
    # at 10 (keys 10..15), row 1's at 3 (keys 3..15).
    assert kernel.prefix_keys == [(1, 8), (1, 5), (1, 6), (1, 13)]
    kernel = CountingKernel()
    _run(q, k, v, [8, 8, 8], kernel, None)  # without documents: the whole prefix, all rows at once
    assert kernel.prefix_keys == [(2, 8), (2, 16)]


@pytest.mark.parametrize(
    ("rows", "offset", "first"),
    [([[10, 14], [3, 21]], 16, 3), ([[16, 8], [18, 6]], 16, 0), ([[20, 4], [20, 4]], 16, 0), ([[16, 8]] * 2, 16, 16)],
    ids=["rows-differ", "one-row-reads", "all-rows-agree", "no-prefix"],
)
def test_attend_over_a_prefix_from_prefix_start_matches_masked_fp64(rows, offset, first):
    """``attend``/``attend_backward`` as a shared unit calls them: the prefix given is only [p0, o), p0 the earliest
    start any row needs; out, dq, the diagonal and the prefix dK/dV equal the dense masked attention's."""
    document_ids = document_ids_from_lengths(rows)
    B, S = document_ids.shape
    q, k, v = _inputs(B, 4, 2, S)
    scale = 1 / math.sqrt(q.shape[-1])
    pieces = Documents.from_ids(document_ids).window(offset, S - offset)
    assert prefix_start(offset, pieces) == first
    mine = slice(offset, S)
    prefix = (k[:, :, first:offset], v[:, :, first:offset]) if first < offset else (None, None)
    kernel = ReferenceKernel()
    out, lse = attend(q[:, :, mine], k[:, :, mine], v[:, :, mine], *prefix, kernel, scale, pieces)

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = masked_attention_fp64(*leaves, document_ids, scale)
    dout = torch.randn_like(ref)
    ref[:, :, mine].backward(dout[:, :, mine])
    torch.testing.assert_close(out.double(), ref[:, :, mine].detach(), rtol=1e-5, atol=1e-5)
    grads = attend_backward(
        dout[:, :, mine].float(), q[:, :, mine], k[:, :, mine], v[:, :, mine], out, lse, *prefix, kernel, scale, pieces
    )
    dq, dk, dv, dk_p, dv_p = (None if g is None else g.double() for g in grads)
    torch.testing.assert_close(dq, leaves[0].grad[:, :, mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk, leaves[1].grad[:, :, mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dv, leaves[2].grad[:, :, mine], rtol=1e-5, atol=1e-5)
    if first == offset:
        assert dk_p is None and dv_p is None
    else:
        torch.testing.assert_close(dk_p, leaves[1].grad[:, :, first:offset], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dv_p, leaves[2].grad[:, :, first:offset], rtol=1e-5, atol=1e-5)
    assert leaves[1].grad[:, :, :first].abs().sum() == 0  # nothing before p0 was attended


def test_attend_refuses_a_prefix_that_misses_a_documents_start():
    document_ids = document_ids_from_lengths([[10, 14], [3, 21]])
    q, k, v = _inputs(2, 4, 2, 24)
    pieces = Documents.from_ids(document_ids).window(16, 8)
    mine = slice(16, 24)
    with pytest.raises(ValueError, match=r"attend to keys from 3.*covers only \[10, 16\).*prefix_start"):
        attend(
            q[:, :, mine], k[:, :, mine], v[:, :, mine], k[:, :, 10:16], v[:, :, 10:16], ReferenceKernel(), 0.3, pieces
        )
