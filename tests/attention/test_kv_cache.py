"""What the K/V cache allocates, copies and adds: only what later subsequences can read or write (``KVCache``)."""

from __future__ import annotations

import math

import torch

from lightning_sppo import GPT
from lightning_sppo.attention import KVCache, SDPAKernel, subsequence_attention
from lightning_sppo.attention.kv_cache import grad_tokens
from lightning_sppo.partition import spans as to_spans
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import make_batch, parity_config, plain_loss_and_grads

B, G, H, DH = 1, 2, 4, 8


def _kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K owning its memory (as RoPE's output does) and V a view of a fused projection's output."""
    k = torch.randn(B, n, G, DH).transpose(1, 2)
    fused = torch.randn(B, n, 3 * G, DH)
    return k, fused[:, :, 2 * G :].transpose(1, 2)


def test_grad_tokens_are_the_tokens_before_the_last_subsequence():
    assert grad_tokens(to_spans([12]), 12) == 0
    assert grad_tokens(to_spans([5, 4, 3]), 12) == 9
    assert grad_tokens(to_spans([5, 4]), 12) == 12  # the sequence is not complete: more may come


def test_last_subsequence_keeps_k_by_reference_and_copies_v():
    cache = KVCache(12, last_offset=8)
    k0, v0 = _kv(8)
    k1, v1 = _kv(4)
    cache.write(0, k0, v0)
    cache.write(8, k1, v1)
    k, v = cache.read(8, 12)
    assert k.data_ptr() == k1.data_ptr()  # no copy of K
    assert v.data_ptr() != v1.data_ptr() and torch.equal(v, v1)  # V copied out of the fused output
    assert cache.k.shape[2] == 8  # the buffer holds what later subsequences read: [0, 8)
    assert cache.nbytes() == 2 * B * G * 12 * DH * 4
    both = cache.read(6, 10)  # across the buffer and the tail: a copy of both
    assert torch.equal(both[0], torch.cat([k0[:, :, 6:], k1[:, :, :2]], dim=2))
    cache.begin_backward(8)
    cache.end_backward(8)
    assert cache.nbytes() == 2 * B * G * 8 * DH * 4  # the tail is let go after its backward


def test_at_n1_nothing_is_copied_allocated_or_added():
    cache = KVCache(6, last_offset=0)
    q, (k, v) = torch.randn(B, H, 6, DH, requires_grad=True), _kv(6)
    k.requires_grad_()
    out = subsequence_attention(q, k, v, cache, 0, SDPAKernel())
    assert cache.k is None and cache.read(0, 6)[0].data_ptr() == k.data_ptr()
    out.sum().backward()
    assert cache._dk is None and cache.peak_nbytes() == 2 * B * G * 6 * DH * 4  # K/V only, no dK/dV ever
    assert cache.later_grads(0, 6) is None


def test_sums_are_zeroed_only_where_touched_and_added_only_where_written():
    """Buffers start as garbage: a backward touching [3, 8) zeroes just that, and hands out only [3, 8) later."""
    cache = KVCache(12)
    for offset, n in to_spans([4, 4, 4]):
        cache.write(offset, *_kv(n))
    dk, dv = cache._grads()
    assert dk.shape[2] == 8  # [0, o_last)
    dk.fill_(math.nan)
    dv.fill_(math.nan)
    assert cache.later_grads(8, 12) is None  # nothing can reach the last subsequence's tokens
    assert cache.later_grads(0, 4) is None  # nothing was touched yet
    for block in cache.grad_blocks(3, 8):  # e.g. a document starting at 3
        assert torch.equal(block.dk, torch.zeros_like(block.dk))
        block.dk.add_(1.0)
    later = cache.later_grads(0, 4)
    assert later.start == 3 and later.dk.shape[2] == 1 and torch.equal(later.dk, torch.ones_like(later.dk))
    assert torch.isnan(dk[:, :, :3]).all()  # untouched memory stays untouched
    cache.begin_backward(8)
    cache.end_backward(0)
    assert cache._dk is None  # freed after the sequence's last backward


def test_engine_cache_bytes_are_kv_of_the_sequence_and_sums_of_the_prefix():
    """Per layer: K/V of every token (fp32 here) and dK/dV of [0, o_last): 0 at N = 1."""
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 1, 24)
    _, ref_grads = plain_loss_and_grads(model, ids, targets)
    per_token = 2 * config.n_query_groups * config.head_size * 4  # K and V (or dK and dV), fp32
    for n, o_last in ((1, 0), (3, 16)):
        engine = SubsequenceEngine(n, "length")
        model.zero_grad(set_to_none=True)
        engine.forward_backward(model, ids, targets)
        assert engine.cache_peak_nbytes() == config.n_layer * per_token * (24 + o_last)
        assert engine.cache_nbytes() == config.n_layer * per_token * o_last  # after backward: the buffer only
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6)
