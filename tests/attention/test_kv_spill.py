"""K/V that live partly on host (``kv_device_tokens``): blocks of a prefix, the spilled cache, and the engine (fp32).

The negative control: ``DeferredCopies`` runs a copy only when the compute side waits for it (a side stream that is
always late) and fills host -> device destinations with NaN until then. The spill code passes with it; the same
code with its waits skipped must not.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo import GPT
from lightning_sppo.attention import KVCache, ReferenceKernel, attend, attend_backward
from lightning_sppo.attention.kv_cache import KVBlock, KVGradBlock
from lightning_sppo.attention.kv_spill import KVSpill
from lightning_sppo.attention.subsequence import attend_backward_blocks, attend_blocks
from lightning_sppo.documents import Documents
from lightning_sppo.offload import build_offloader
from lightning_sppo.offload.streams import CopyTicket
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import (
    document_ids_from_lengths,
    make_batch,
    max_relative_error,
    parity_config,
    plain_loss_and_grads,
    separate_documents_loss_and_grads,
)

S = 45


def _split(x: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, [b - a for a, b in zip([0, *cuts], [*cuts, x.shape[2]], strict=True)], dim=2))


@settings(max_examples=25, deadline=None)
@given(
    s=st.integers(1, 9),
    p=st.integers(1, 30),
    data=st.data(),
    documents=st.booleans(),
)
def test_prefix_in_blocks_equals_one_prefix(s, p, data, documents):
    """Forward and backward over a prefix cut into blocks equal one prefix tensor (to fp32 rounding)."""
    gen = torch.Generator().manual_seed(p * 31 + s)
    B, H, G, Dh = 2, 4, 2, 8
    q = torch.randn(B, H, s, Dh, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, G, s, Dh, generator=gen, dtype=torch.float64) for _ in range(2))
    kp, vp = (torch.randn(B, G, p, Dh, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, H, s, Dh, generator=gen, dtype=torch.float64)
    cuts = sorted(data.draw(st.sets(st.integers(1, p - 1), max_size=4)) if p > 1 else [])
    pieces = None
    if documents:  # row 0: one document from the start; row 1: a document beginning inside the prefix
        start = data.draw(st.integers(0, p - 1))
        ids = torch.tensor([[0] * (p + s), [0] * start + [1] * (p + s - start)])
        pieces = Documents.from_ids(ids).window(p, s)
    kernel, scale = ReferenceKernel(), 1 / math.sqrt(Dh)
    out, lse = attend(q, k, v, kp, vp, kernel, scale, pieces)
    blocks = [KVBlock(a, kb, vb) for a, kb, vb in zip([0, *cuts], _split(kp, cuts), _split(vp, cuts), strict=True)]
    out_b, lse_b = attend_blocks(q, k, v, blocks, kernel, scale, pieces)
    torch.testing.assert_close(out_b, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_b, lse, rtol=1e-12, atol=1e-12)

    into = (torch.zeros_like(kp), torch.zeros_like(vp))
    dq, dk, dv, _, _ = attend_backward(dout, q, k, v, out, lse, kp, vp, kernel, scale, pieces, into)
    dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
    grad_blocks = [
        KVGradBlock(a, kb, vb, dkb, dvb)
        for a, kb, vb, dkb, dvb in zip([0, *cuts], *(_split(x, cuts) for x in (kp, vp, dkp, dvp)), strict=True)
    ]
    dq_b, dk_b, dv_b = attend_backward_blocks(dout, q, k, v, out, lse, grad_blocks, kernel, scale, pieces)
    for got, want in ((dq_b, dq), (dk_b, dk), (dv_b, dv), (dkp, into[0]), (dvp, into[1])):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_one_block_is_bit_identical_to_the_old_single_prefix_rule():
    """attend over one block takes exactly the old calls: the merge of one prefix partial into the diagonal."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 8, generator=gen)
    k, v, kp, vp = (torch.randn(1, 2, n, 8, generator=gen) for n in (5, 5, 7, 7))
    kernel = ReferenceKernel()
    out, lse = attend(q, k, v, kp, vp, kernel, 0.3)
    from lightning_sppo.attention import merge_partials

    want = merge_partials(*kernel.forward(q, kp, vp, False, 0.3), *kernel.forward(q, k, v, True, 0.3))
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


class DeferredCopies:
    """A copy engine whose side stream is always late: copies run, in issue order, only when a ticket is waited
    for (or at ``synchronize``); a host -> device destination holds NaN until its copy ran, and a device -> host
    copy reads its source when it runs, not when it is issued."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self.issued = self.waits = 0

    def mark(self) -> int:
        return self.issued

    def elapsed(self, start, end) -> float:
        return 0.0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def _issue(self, pairs) -> CopyTicket:
        self.issued += 1
        self.queue.append((self.issued, list(pairs)))
        return CopyTicket(self.issued, self.issued)

    def d2h(self, pairs) -> CopyTicket:
        return self._issue(pairs)

    def h2d(self, pairs) -> CopyTicket:
        for device, _ in pairs:
            device.fill_(float("nan"))
        return self._issue(pairs)

    def wait(self, ticket: CopyTicket) -> None:
        self.waits += 1
        while self.queue and self.queue[0][0] <= ticket.done:
            for dst, src in self.queue.pop(0)[1]:
                dst.copy_(src)

    def synchronize(self) -> None:
        self.wait(CopyTicket(self.issued, self.issued))


class SkippedWaits(DeferredCopies):
    """The bug the control catches: the spill reads chunks without waiting for their copies."""

    def wait(self, ticket: CopyTicket) -> None:
        self.waits += 1


def _engine(device_tokens, chunk_tokens=4, hooks=None, n=5, partition="length") -> SubsequenceEngine:
    return SubsequenceEngine(n, partition, hooks=hooks, kv_device_tokens=device_tokens, kv_chunk_tokens=chunk_tokens)


def _run(engine: SubsequenceEngine, model, ids, targets, document_ids=None, copies=None):
    if copies is not None:  # the pool is built at the first step: build it now and give its spill the engine
        engine._bind(model, ids, targets, torch.ones(()), document_ids)
        engine._pool.unbind()
        engine._pool.spill.copies = copies
    return engine.forward_backward(model, ids, targets, document_ids)


def _check(loss, model, ref_loss, ref_grads, where=""):
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (where, loss.item(), ref_loss.item())
    err, name = max_relative_error(ref_grads, model)
    assert err < 1e-5, f"{where} {name}: {err}"


@pytest.mark.parametrize("offload", ["none", "adaptive"])
@pytest.mark.parametrize("device_tokens", [0, 13, None], ids=["all-host", "partial", "all-device"])
def test_engine_with_spilled_kv_equals_plain_model(device_tokens, offload):
    """Two steps (the host pool and the dK/dV bookkeeping are reused), chunks of 4 tokens that cut across
    subsequence boundaries and across R."""
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    hooks = None if offload == "none" else build_offloader(offload, "cpu", min_bytes=0)
    engine = _engine(device_tokens, hooks=hooks, partition="flops")
    for step in range(2):
        model.zero_grad(set_to_none=True)
        loss = _run(engine, model, ids, targets)
        _check(loss, model, ref_loss, ref_grads, (device_tokens, offload, step))
    if device_tokens is not None:
        assert engine.cache_host_nbytes() > 0 and engine._pool.spill.host_capacity_bytes() > 0


def test_engine_with_spilled_kv_and_packed_documents():
    config = parity_config(gqa=True)
    document_ids = document_ids_from_lengths([[14, 1, 15, 15], [1, 1, 9, 34]])
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    ref_loss, ref_grads = separate_documents_loss_and_grads(model, ids, targets, document_ids)
    hooks = build_offloader("adaptive", "cpu", min_bytes=0)
    loss = _run(_engine(10, chunk_tokens=3, hooks=hooks, n=4), model, ids, targets, document_ids)
    _check(loss, model, ref_loss, ref_grads)


@pytest.mark.parametrize("documents", [False, True])
def test_spill_waits_for_every_copy(documents):
    """With copies that land only when waited for, the spill still matches; skipping the waits must not."""
    config = parity_config(gqa=True)
    document_ids = document_ids_from_lengths([[14, 1, 15, 15], [1, 1, 9, 34]]) if documents else None
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    if documents:
        ref_loss, ref_grads = separate_documents_loss_and_grads(model, ids, targets, document_ids)
    else:
        ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    deferred = DeferredCopies()
    loss = _run(_engine(13), model, ids, targets, document_ids, copies=deferred)
    _check(loss, model, ref_loss, ref_grads)
    assert deferred.waits > 10

    model.zero_grad(set_to_none=True)
    skipped = SkippedWaits()
    loss = _run(_engine(13), model, ids, targets, document_ids, copies=skipped)
    broken = not torch.isfinite(loss) or abs(loss.item() - ref_loss.item()) / ref_loss.item() > 1e-3
    broken = (
        broken
        or max_relative_error(ref_grads, model)[0] > 1e-3
        or any(not torch.isfinite(p.grad).all() for p in model.parameters())
    )
    assert broken, "reading chunks before their copies finished went unnoticed"


def test_cache_bytes_match_the_formula():
    """Device: R tokens x (K + V in the act dtype + dK/dV in the grad dtype) x groups x head size; host: K/V of the
    rest, dK/dV of the rest up to the last subsequence's offset (no later query adds to the tokens after it)."""
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 1, S)
    R, B = 13, 1
    engine = _engine(R)
    _run(engine, model, ids, targets)
    caches = engine._pool.caches()
    G, Dh = config.n_query_groups, config.head_size
    per_token = 2 * 4 + 2 * 4  # fp32 K, V and fp32 dK, dV
    for cache in caches:
        assert cache.peak_nbytes() == B * R * G * Dh * per_token  # R is below o_last: dK/dV of all R tokens
        assert cache.nbytes() == B * R * G * Dh * 2 * 4  # after the step: the K/V buffer only
        last_offset = S - engine.plan(ids, config).lengths[-1]
        assert cache.host_nbytes() == B * G * Dh * ((S - R) * 2 * 4 + (last_offset - R) * 2 * 4)


def test_host_grads_read_zero_where_nothing_was_written_back():
    """Host dK/dV are never cleared: a window reads zeros where no sum was written back, even over garbage."""
    spill = KVSpill(device_tokens=2, chunk_tokens=3)
    cache = KVCache(10, spill=spill)
    kv = torch.randn(1, 1, 10, 2)
    cache.write(0, kv[:, :, :8], kv[:, :, :8])  # two subsequences: tokens [0, 8) can receive dK/dV
    cache.write(8, kv[:, :, 8:], kv[:, :, 8:])
    cache.grad_buffers()
    dk_host, _ = cache._host_grads
    dk_host.fill_(float("nan"))  # what an earlier step may have left there
    with cache.grad_window(4, 7) as (dk, dv):
        assert torch.equal(dk, torch.zeros_like(dk))
        dk += 1
    got, _ = cache.read_grads(0, 10)
    assert got[0, 0, :, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]


def test_evaluate_with_spilled_kv_equals_all_on_device():
    """The forward-only pass streams the prefix the same way (no dK/dV on either side)."""
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    want = SubsequenceEngine(5, "length").evaluate(model, ids, targets)
    engine = _engine(7, chunk_tokens=5)
    got = engine.evaluate(model, ids, targets)
    assert abs(got[0].item() - want[0].item()) / want[0].item() < 1e-6 and got[1] == want[1]
    assert all(cache._dk is None and cache._host_grads is None for cache in engine._pool.caches())
    rows, k_and_v, fp32 = 2, 2, 4
    per_layer = rows * (S - 7) * config.n_query_groups * config.head_size * k_and_v * fp32
    assert engine.cache_host_nbytes() == config.n_layer * per_layer  # K/V only: no dK/dV without backward
