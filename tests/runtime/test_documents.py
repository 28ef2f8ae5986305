"""Packed documents on one device: the engine and the Fabric strategy against the documents trained alone (fp32).

The reference runs every document of every row alone through the plain model; the loss is the sum of all token
losses over the valid targets of the whole batch, gradients summed (``separate_documents_loss_and_grads``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.fabric import Fabric

from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.documents import Documents
from lightning_sppo.offload import OffloadCallback, build_offloader
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import (
    document_ids_from_lengths,
    make_batch,
    max_relative_error,
    parity_config,
    random_document_lengths,
    separate_documents_loss_and_grads,
)

S = 45
# Row 0: a document across several boundaries of every N below, a one-token document, two that meet at 15 (a
# subsequence boundary for N=3 "length"); row 1: a different layout, starting with one-token documents.
LAYOUTS = {
    "spanning": [[31, 1, 13]],
    "two-rows": [[14, 1, 15, 15], [1, 1, 9, 34]],
    "one-token-documents": [[1] * 5 + [40], [40] + [1] * 5],
}


def _check(loss, model, ref_loss, ref_grads, where=""):
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (where, loss.item(), ref_loss.item())
    err, name = max_relative_error(ref_grads, model)
    assert err < 1e-5, f"{where} {name}: {err}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("partition", ["length", "flops"])
@pytest.mark.parametrize("num_subsequences", [1, 2, 3, 5])
def test_engine_equals_documents_trained_alone(num_subsequences, partition, layout):
    config = parity_config(gqa=True)
    document_ids = document_ids_from_lengths(LAYOUTS[layout])
    model = GPT(config)
    ids, targets = make_batch(config, document_ids.shape[0], S)
    ref_loss, ref_grads = separate_documents_loss_and_grads(model, ids, targets, document_ids)
    engine = SubsequenceEngine(num_subsequences, partition)
    loss = engine.forward_backward(model, ids, targets, document_ids)
    lengths = list(engine.plan(ids, config, document_ids).lengths)
    assert len(lengths) == num_subsequences
    _check(loss, model, ref_loss, ref_grads, lengths)


def test_a_document_boundary_on_a_subsequence_boundary():
    """N=3 "length" cuts at 15 and 30: documents end exactly there, so later subsequences read no prefix."""
    config = parity_config()
    document_ids = document_ids_from_lengths([[15, 15, 15], [15, 30]])
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    ref_loss, ref_grads = separate_documents_loss_and_grads(model, ids, targets, document_ids)
    engine = SubsequenceEngine(3, "length")
    loss = engine.forward_backward(model, ids, targets, document_ids)
    assert engine.plan(ids, config, document_ids).lengths == (15, 15, 15)
    _check(loss, model, ref_loss, ref_grads)
    pieces = Documents.from_ids(document_ids).window(30, 15)
    assert pieces.prefix_groups() == [(slice(1, 2), 15, 15)]  # row 0 starts a document at 30: no prefix


@pytest.mark.parametrize("attention", ["reference", "sdpa"])
@pytest.mark.parametrize("name", ["tiny-gelu", "tiny-gqa"])
def test_other_architectures_and_kernels(name, attention):
    from lightning_sppo import GPTConfig

    config = GPTConfig.from_name(name)
    document_ids = document_ids_from_lengths([[10, 1, 26], [20, 17]])
    model = GPT(config)
    ids, targets = make_batch(config, 2, 37)
    ref_loss, ref_grads = separate_documents_loss_and_grads(model, ids, targets, document_ids)
    loss = SubsequenceEngine(4, "length", attention=attention).forward_backward(model, ids, targets, document_ids)
    _check(loss, model, ref_loss, ref_grads)


@pytest.mark.parametrize("offload", ["none", "full", "adaptive"])
@pytest.mark.parametrize("partition", ["length", "flops"])
def test_fabric_strategy_with_offload(offload, partition):
    config = parity_config(gqa=True)
    document_ids = document_ids_from_lengths(LAYOUTS["two-rows"])
    model = GPT(config)
    ids, targets = make_batch(config, 2, S, ignore_fraction=0.4)
    ref_loss, ref_grads = separate_documents_loss_and_grads(model, ids, targets, document_ids)
    callback = offload if offload == "none" else OffloadCallback(offload, min_bytes=0)
    strategy = SPPOStrategy(num_subsequences=3, partition=partition, offload=callback)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    loss = fabric.strategy.forward_backward(fabric.setup(model), ids, targets, document_ids)
    if offload != "none":
        assert fabric.strategy.core.hooks.last_stats.offloaded_bytes > 0
    _check(loss, model, ref_loss, ref_grads, offload)


def test_offload_is_bit_identical_with_documents():
    config = parity_config()
    document_ids = document_ids_from_lengths(LAYOUTS["two-rows"])
    ids, targets = make_batch(config, 2, S)
    grads = {}
    for policy in ("none", "full", "adaptive"):
        torch.manual_seed(0)
        model = GPT(config)
        hooks = build_offloader(policy, "cpu", min_bytes=0)
        SubsequenceEngine(4, "flops", hooks=hooks).forward_backward(model, ids, targets, document_ids)
        grads[policy] = [p.grad for p in model.parameters()]
    for policy in ("full", "adaptive"):
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[policy], strict=True)), policy


def test_one_document_per_row_is_bit_identical_to_no_documents():
    """Rows that are one document each take exactly the calls of the plain path (one batched prefix call)."""
    config = parity_config(gqa=True)
    ids, targets = make_batch(config, 2, S)
    torch.manual_seed(0)
    plain, packed = GPT(config), None
    packed = copy.deepcopy(plain)
    loss = SubsequenceEngine(5, "length").forward_backward(plain, ids, targets)
    loss_docs = SubsequenceEngine(5, "length").forward_backward(packed, ids, targets, torch.zeros_like(ids))
    assert torch.equal(loss, loss_docs)
    for a, b in zip(plain.parameters(), packed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_negative_control_without_the_mask_gradients_differ():
    config = parity_config(gqa=True)
    document_ids = document_ids_from_lengths(LAYOUTS["two-rows"])
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    ref_loss, ref_grads = separate_documents_loss_and_grads(model, ids, targets, document_ids)
    loss = SubsequenceEngine(3, "length").forward_backward(model, ids, targets)  # document_ids dropped
    assert loss.item() != ref_loss.item()
    assert max_relative_error(ref_grads, model)[0] > 1e-2


def test_masked_flops_partition_follows_the_documents():
    """Many short documents make attention cheap everywhere: the flops cut is far more even than the causal one,
    and the lengths change with the documents (so the strategies decide them per batch)."""
    config = parity_config()
    engine = SubsequenceEngine(4, "flops")
    short = Documents.from_ids(document_ids_from_lengths([[4] * 40]))
    one = Documents.from_ids(torch.zeros(1, 160, dtype=torch.long))
    ids = torch.zeros(1, 160, dtype=torch.long)
    causal, ones, shorts = (list(engine.plan(ids, config, docs).lengths) for docs in (None, one, short))
    assert ones != shorts
    assert max(causal) - min(causal) > 2 * (max(shorts) - min(shorts))
    assert ones == sorted(ones, reverse=True)


@settings(max_examples=20, deadline=None)
@given(
    seq_len=st.integers(2, 50),
    num_subsequences=st.integers(1, 6),
    partition=st.sampled_from(["length", "flops"]),
    batch_size=st.integers(1, 2),
    max_document=st.integers(1, 30),
    groups=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_random_document_layouts(seq_len, num_subsequences, partition, batch_size, max_document, groups, seed):
    if num_subsequences > seq_len:
        return
    gen = torch.Generator().manual_seed(seed)
    document_ids = document_ids_from_lengths(
        [random_document_lengths(gen, seq_len, max_document) for _ in range(batch_size)]
    )
    torch.manual_seed(seed)
    config = parity_config(n_query_groups=groups)
    model = GPT(config)
    ids, targets = make_batch(config, batch_size, seq_len, seed=seed)
    ref_loss, ref_grads = separate_documents_loss_and_grads(model, ids, targets, document_ids)
    loss = SubsequenceEngine(num_subsequences, partition).forward_backward(model, ids, targets, document_ids)
    _check(loss, model, ref_loss, ref_grads, document_ids.tolist())


@pytest.mark.parametrize(
    ("document_ids", "match"),
    [
        (torch.tensor([[0, 0, 1, 0, 2, 2]]), r"non-decreasing.*document_ids\[0, 2\]=1 followed by 0"),
        (torch.zeros(1, 5, dtype=torch.long), r"document_ids must have the shape of input_ids \(1, 6\)"),
        (torch.zeros(1, 6), r"document_ids must be an integer tensor"),
    ],
)
def test_bad_document_ids_are_named(document_ids, match):
    config = parity_config()
    model = GPT(config)
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        SubsequenceEngine(2).forward_backward(model, ids, ids, document_ids)
    with pytest.raises(ValueError, match=match):
        model(ids, document_ids)


def test_adaptive_offload_stops_measuring_when_every_batch_is_cut_anew():
    """Packed documents under "flops": each batch has its own lengths. The adaptive offloader measures two of
    them, then keeps balanced costs for every later cut into as many subsequences (no full-offload steps)."""
    config = parity_config()
    offloader = build_offloader("adaptive", "cpu", min_bytes=0, measure_steps=2)
    engine = SubsequenceEngine(4, "flops", hooks=offloader)
    model = GPT(config)
    ids, targets = make_batch(config, 1, 160)
    layouts = [[40] * 4, [100, 60], [20, 140], [150, 10], [80, 80]]
    cuts, measured = [], []
    for lengths in layouts:
        plan = engine.plan(ids, config, document_ids_from_lengths([lengths]))
        engine.forward_backward(model, ids, targets, plan=plan)
        cuts.append(plan.lengths)
        measured.append(offloader.last_stats.measured)
    assert len(set(cuts)) == len(cuts), cuts  # every batch cut differently
    assert measured == [True, True, False, False, False]
    assert offloader.costs.spans is None and len(offloader.costs.forward_s) == 4
