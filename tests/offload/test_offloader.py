"""The offloader's bookkeeping (bytes, alpha, peak), what it keeps on the device, and its errors (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_sppo import GPT
from lightning_sppo.offload import OffloadCosts, Offloader, alphas, build_offloader, memory_dynamics, peak_saved_bytes
from lightning_sppo.offload.streams import SyncCopies
from lightning_sppo.offload.units import kept_on_device
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import make_batch, parity_config

S = 45


def run_step(offloader, num_subsequences=5, partition="flops", batch_size=2, steps=1, model=None):
    config = parity_config(gqa=True)
    model = model or GPT(config)
    ids, targets = make_batch(config, batch_size, S)
    engine = SubsequenceEngine(num_subsequences, partition, hooks=offloader)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        engine.forward_backward(model, ids, targets)
    return offloader.last_stats


def threshold_costs(threshold_bytes: float) -> OffloadCosts:
    return OffloadCosts(d2h_bytes_per_s=1.0, forward_s=(threshold_bytes,))


@pytest.mark.parametrize("policy", ["none", "full", "adaptive"])
@pytest.mark.parametrize(("num_subsequences", "partition"), [(1, "length"), (3, "length"), (5, "flops"), (8, "flops")])
def test_offloaded_bytes_are_alpha_times_level2_and_peak_follows_the_dynamics(policy, num_subsequences, partition):
    costs = threshold_costs(25_000) if policy == "adaptive" else None
    stats = run_step(Offloader(policy, "cpu", min_bytes=0, costs=costs), num_subsequences, partition)
    level2 = [s.level2_bytes for s in stats.subsequences]
    offloaded = [s.offloaded_bytes for s in stats.subsequences]

    assert list(stats.alphas) == alphas(policy, level2, costs)
    for sub in stats.subsequences:  # whole units, never above alpha A, short of it by less than one unit
        budget = sub.alpha * sub.level2_bytes
        assert budget - sub.largest_unit_bytes < sub.offloaded_bytes <= budget or sub.offloaded_bytes == budget
    assert stats.offloaded_bytes == sum(offloaded)
    assert stats.prefetched_bytes == sum(offloaded[:-1])  # the last one's device copy is still there
    assert stats.peak_saved_bytes == peak_saved_bytes(level2, offloaded)
    if policy == "none":
        assert stats.peak_saved_bytes == sum(level2)
    if policy == "adaptive" and num_subsequences > 1:
        assert 0 < stats.alphas[0] < 1 and stats.alphas[-1] == 0


def test_alpha_is_non_increasing_for_the_flops_partition():
    for threshold in (20_000, 40_000, 70_000, 10**9):
        stats = run_step(Offloader("adaptive", "cpu", min_bytes=0, costs=threshold_costs(threshold)), 8, "flops")
        assert list(stats.alphas) == sorted(stats.alphas, reverse=True), stats.alphas
        for sub in stats.subsequences[:-1]:  # every offload fits under M_threshold: hideable
            assert sub.offloaded_bytes <= threshold


def test_memory_dynamics_formula_by_hand():
    level2, offloaded = [100, 80, 60, 40], [50, 40, 30, 0]
    assert memory_dynamics(level2, offloaded) == [100, 130, 150, 160]  # M_i = M_{i-1} + A_i - alpha_{i-1} A_{i-1}
    assert peak_saved_bytes(level2, offloaded) == 190  # M_2 + A_3 - nothing freed yet: 150 + 40
    assert peak_saved_bytes(level2, [0, 0, 0, 0]) == 280


class _RecordingCopies(SyncCopies):
    """Remembers, per D2H batch (one per subsequence), weak references to the device storages copied."""

    def __init__(self):
        super().__init__()
        self.batches: list[list[tuple[StorageWeakRef, int]]] = []

    def d2h(self, pairs):
        self.batches.append([(StorageWeakRef(device.untyped_storage()), device.nbytes) for _, device in pairs])
        return super().d2h(pairs)


def test_offloaded_device_storages_are_really_freed():
    """Independent of the bookkeeping: once the next forward is done, the offloaded storages no longer exist."""
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    copies = _RecordingCopies()
    engine = SubsequenceEngine(4, "length", hooks=Offloader("full", "cpu", min_bytes=0, copies=copies))
    state = engine.begin(model, ids, targets)
    for i in range(4):
        engine.forward(state, i)
    # Activations only: ids, targets and the loss normaliser are small and owned by the batch.
    alive = [[not ref.expired() for ref, nbytes in batch if nbytes > 1024] for batch in copies.batches]
    assert len(alive) == 4 and all(alive)
    assert not any(any(batch) for batch in alive[:-1])
    assert all(alive[-1])  # the last subsequence's backward comes next: its device copy is kept
    for i in reversed(range(4)):
        engine.backward(state, i)
    engine.end(state)


def test_weights_and_small_tensors_stay_on_the_device():
    weight = nn.Parameter(torch.randn(4, 3))
    received = torch.randn(2, 3, requires_grad=True)  # e.g. a pipeline stage's input: the runtime holds it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = weight.to(torch.bfloat16)
    assert kept_on_device(weight) and kept_on_device(weight.t()) and kept_on_device(weight[1:])
    assert kept_on_device(cast) and kept_on_device(cast.t())
    assert kept_on_device(received) and kept_on_device(received.t())
    activation = received * 2
    assert not kept_on_device(activation) and not kept_on_device(activation.t())
    assert not kept_on_device(received.to(torch.half))  # a new storage the graph owns
    assert not kept_on_device(torch.randn(3))  # e.g. a log-sum-exp a kernel returned

    large = run_step(Offloader("full", "cpu", min_bytes=0), 3, "length")
    small = run_step(Offloader("full", "cpu", min_bytes=1024), 3, "length")
    assert all(s.small_bytes == 0 for s in large.subsequences)
    for a, b in zip(large.subsequences, small.subsequences, strict=True):
        assert b.small_bytes > 0 and b.level2_bytes + b.small_bytes == a.level2_bytes
        assert b.level2_bytes > 0 and b.largest_unit_bytes >= 1024


def test_in_place_change_of_a_saved_tensor_is_reported():
    """Hooks switch off autograd's own check; the offloader restores it, offloaded or not."""
    for policy in ("none", "full"):
        offloader = Offloader(policy, "cpu", min_bytes=0)
        offloader.begin_step([(0, 3)])
        x = torch.randn(3, requires_grad=True)
        with offloader.forward_context((0, 0)):
            y = x * 2
            z = y.sin()
            y.add_(1)
        with pytest.raises(RuntimeError, match="modified in place"):
            offloader.after_forward((0, 0))
            offloader.before_backward((0, 0))
            z.sum().backward()
        offloader.end_step()


def test_measured_costs_come_from_the_step():
    offloader = build_offloader("adaptive", "cpu", min_bytes=0, measure_steps=1)
    stats = run_step(offloader, 4, "flops")
    assert stats.measured and stats.alphas == (1.0, 1.0, 1.0, 0.0)
    costs = offloader.costs
    assert costs.level2_bytes == tuple(s.level2_bytes for s in stats.subsequences)
    assert costs.d2h_bytes_per_s > 0 and all(t > 0 for t in costs.forward_s)
    stats = run_step(offloader, 4, "flops")
    assert not stats.measured and list(stats.alphas) == alphas("adaptive", costs.level2_bytes, costs)
    stats = run_step(offloader, 3, "flops")  # another partition: measured afresh
    assert stats.measured and len(offloader.costs.forward_s) == 3


def test_stats_as_metrics():
    stats = run_step(Offloader("full", "cpu", min_bytes=0), 3)
    metrics = stats.as_metrics("offload/")
    assert metrics["offload/offloaded_bytes"] == stats.offloaded_bytes > 0
    assert set(metrics) >= {"offload/prefetched_bytes", "offload/peak_saved_bytes", "offload/host_pool_bytes"}
    assert "offload/wait_s" not in metrics  # CPU: copies are synchronous, no stream ever waits


def test_unknown_policy_and_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match=r"offload='partial'.*'none', 'full', 'adaptive'"):
        build_offloader("partial", "cpu")
    with pytest.raises(ValueError, match="min_bytes=-1"):
        Offloader("full", "cpu", min_bytes=-1)
    with pytest.raises(ValueError, match="measure_steps=0"):
        Offloader("adaptive", "cpu", measure_steps=0)
    with pytest.raises(ValueError, match="forward_s"):
        OffloadCosts(d2h_bytes_per_s=1.0, forward_s=())
    assert build_offloader("none", "cpu") is None


def test_hooks_out_of_order_are_refused():
    offloader = Offloader("full", "cpu", min_bytes=0)
    with pytest.raises(RuntimeError, match="outside a step"):
        offloader.forward_context((0, 0))
    offloader.begin_step([(0, 1)])
    with pytest.raises(RuntimeError, match=r"before_backward\(\(0, 0\)\) without the forward"):
        offloader.before_backward((0, 0))
    offloader.end_step()
