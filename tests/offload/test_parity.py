"""Offloading changes where activations live, never the numbers: gradients are bit-identical (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_sppo import GPT
from lightning_sppo.offload import OffloadCosts, Offloader, build_offloader
from lightning_sppo.offload.pool import HostPool
from lightning_sppo.offload.streams import SyncCopies
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import make_batch, max_relative_error, parity_config, plain_loss_and_grads

S = 45  # a multiple of none of N > 1 below


def engine_grads(model, ids, targets, num_subsequences, partition, hooks=None, **kwargs):
    """Loss and gradients of one engine step from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    loss = SubsequenceEngine(num_subsequences, partition, hooks=hooks).forward_backward(model, ids, targets, **kwargs)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_bit_identical(grads, reference):
    for name, grad in grads.items():
        assert torch.equal(grad, reference[name]), name


def fractional_costs(stats) -> OffloadCosts:
    """Costs under which adaptive alpha_0 is about 0.6: each copy hides 60% of a mean subsequence's bytes."""
    mean = sum(s.level2_bytes for s in stats.subsequences) / len(stats.subsequences)
    return OffloadCosts(d2h_bytes_per_s=1.0, forward_s=(0.6 * mean,))


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("partition", ["length", "flops"])
@pytest.mark.parametrize("num_subsequences", [1, 2, 3, 5, 8])
def test_offload_policies_are_bit_identical_and_match_plain(num_subsequences, partition, batch_size, gqa):
    config = parity_config(gqa)
    model = GPT(config)
    ids, targets = make_batch(config, batch_size, S)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    assert build_offloader("none", "cpu") is None
    loss_none, grads_none = engine_grads(model, ids, targets, num_subsequences, partition)

    full = build_offloader("full", "cpu", min_bytes=0)
    loss_full, grads_full = engine_grads(model, ids, targets, num_subsequences, partition, full)
    adaptive = build_offloader("adaptive", "cpu", min_bytes=0, costs=fractional_costs(full.last_stats))
    loss_adaptive, grads_adaptive = engine_grads(model, ids, targets, num_subsequences, partition, adaptive)

    assert full.last_stats.offloaded_bytes == full.last_stats.level2_bytes > 0
    if num_subsequences > 1:  # something really went through host memory and came back
        assert full.last_stats.prefetched_bytes > 0 and adaptive.last_stats.alphas[0] < 1
    for loss, grads in ((loss_full, grads_full), (loss_adaptive, grads_adaptive)):
        assert torch.equal(loss, loss_none)
        assert_bit_identical(grads, grads_none)
    assert abs(loss_none.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    err, where = max_relative_error(ref_grads, model)
    assert err < 1e-5, f"{where}: {err}"


class _PerturbingCopies(SyncCopies):
    """A broken host round trip: every restored float buffer is off by one ulp."""

    def h2d(self, pairs):
        ticket = super().h2d(pairs)
        for device, _ in pairs:
            if device.is_floating_point():
                device.copy_(torch.nextafter(device, torch.full_like(device, float("inf"))))
        return ticket


class _AliasingPool(HostPool):
    """A broken pool: float slices share one buffer, so later copies overwrite earlier ones (ids stay intact)."""

    shared = torch.empty(2**20, dtype=torch.uint8)

    def take(self, numel, dtype):
        if not dtype.is_floating_point:
            return super().take(numel, dtype)
        return self.shared[: numel * dtype.itemsize].view(dtype)


@pytest.mark.parametrize("broken", ["perturbed copy", "aliasing pool"])
def test_negative_control_corrupted_host_copies_are_caught(broken):
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    _, grads_none = engine_grads(model, ids, targets, 3, "length")
    parts = {"copies": _PerturbingCopies()} if broken == "perturbed copy" else {"pool": _AliasingPool(slab_bytes=2**20)}
    offloader = Offloader("full", "cpu", min_bytes=0, **parts)
    _, grads = engine_grads(model, ids, targets, 3, "length", offloader)
    assert any(not torch.equal(grads[name], grads_none[name]) for name in grads)


def test_activation_checkpointing_inside_a_subsequence():
    """Non-reentrant checkpointed MLPs: the checkpoint's inputs are offloaded, its recomputation is not.

    (Whole blocks cannot be checkpointed under the engine: recomputing attention would write the K/V cache again.)
    """
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    for block in model.blocks.values():
        block.mlp.forward = lambda x, f=block.mlp.forward: checkpoint(f, x, use_reentrant=False)
    loss_none, grads_none = engine_grads(model, ids, targets, 4, "flops")
    full = build_offloader("full", "cpu", min_bytes=0)
    loss_full, grads_full = engine_grads(model, ids, targets, 4, "flops", full)
    assert full.last_stats.prefetched_bytes > 0
    assert torch.equal(loss_full, loss_none)
    assert_bit_identical(grads_full, grads_none)
    assert abs(loss_full.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert max_relative_error(ref_grads, model)[0] < 1e-5


def test_bf16_autocast_is_bit_identical():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, S)
    autocast = dict(forward_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    _, grads_none = engine_grads(model, ids, targets, 3, "flops", **autocast)
    full = build_offloader("full", "cpu", min_bytes=0)
    _, grads_full = engine_grads(model, ids, targets, 3, "flops", full, **autocast)
    assert full.last_stats.prefetched_bytes > 0
    assert_bit_identical(grads_full, grads_none)


def test_measured_adaptive_policy_over_steps():
    """No costs given: the first steps offload fully and measure; later steps use the measured alpha rule."""
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    _, grads_none = engine_grads(model, ids, targets, 5, "flops")
    offloader = build_offloader("adaptive", "cpu", min_bytes=0, measure_steps=2)
    measured = []
    for _ in range(4):
        _, grads = engine_grads(model, ids, targets, 5, "flops", offloader)
        assert_bit_identical(grads, grads_none)
        measured.append(offloader.last_stats.measured)
    assert measured == [True, True, False, False]
    assert offloader.costs.spans == tuple(SubsequenceEngine(5, "flops").plan(ids, config).spans)
    assert offloader.costs.d2h_bytes_per_s > 0 and len(offloader.costs.forward_s) == 5


class _AsMicroBatch:
    """Gives one engine's hooks calls the key (micro_batch, i), so two engines can share one offloader."""

    def __init__(self, offloader, micro_batch):
        self.offloader, self.micro_batch = offloader, micro_batch

    def begin_step(self, spans):
        pass

    def end_step(self):
        pass

    def forward_context(self, key):
        return self.offloader.forward_context((self.micro_batch, key[1]))

    def after_forward(self, key):
        self.offloader.after_forward((self.micro_batch, key[1]))

    def before_backward(self, key):
        self.offloader.before_backward((self.micro_batch, key[1]))

    def after_backward(self, key):
        self.offloader.after_backward((self.micro_batch, key[1]))


def test_two_micro_batches_in_flight_interleaved():
    """1F1B-like order across two micro-batches: state is per key, prefetch follows each micro-batch."""
    config = parity_config()
    models = [GPT(config), None]
    models[1] = copy.deepcopy(models[0])
    batches = [make_batch(config, 1, S, seed=seed) for seed in (0, 1)]
    expected = [engine_grads(m, *batch, 3, "length")[1] for m, batch in zip(models, batches, strict=True)]

    offloader = build_offloader("full", "cpu", min_bytes=0)
    engines = [SubsequenceEngine(3, "length", hooks=_AsMicroBatch(offloader, mb)) for mb in (0, 1)]
    for m in models:
        m.zero_grad(set_to_none=True)
    states = [engine.begin(m, *batch) for engine, m, batch in zip(engines, models, batches, strict=True)]
    offloader.begin_step(states[0].spans)
    order = ["F0", "F1", "F0", "F1", "F0", "B0", "F1", "B0", "B1", "B0", "B1", "B1"]  # micro-batch of each action
    next_forward, next_backward = [0, 0], [2, 2]
    for action in order:
        mb = int(action[1])
        if action[0] == "F":
            engines[mb].forward(states[mb], next_forward[mb])
            next_forward[mb] += 1
        else:
            engines[mb].backward(states[mb], next_backward[mb])
            next_backward[mb] -= 1
    offloader.end_step()
    for engine, state in zip(engines, states, strict=True):
        engine.end(state)

    assert {s.key for s in offloader.last_stats.subsequences} == {(mb, i) for mb in (0, 1) for i in range(3)}
    assert offloader.last_stats.prefetched_bytes > 0
    for m, grads in zip(models, expected, strict=True):
        assert_bit_identical({name: p.grad for name, p in m.named_parameters()}, grads)
