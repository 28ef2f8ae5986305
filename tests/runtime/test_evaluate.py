"""Forward-only evaluation through subsequences equals the plain full-sequence model's loss (one process)."""

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.attention import subsequence_cores
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import IGNORE, make_batch, parity_config, plain_loss_and_grads

S = 45


def _plain_sum_and_count(model: GPT, ids: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    with torch.no_grad():
        logits = model(ids)
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return total.item(), int((targets != IGNORE).sum())


@pytest.mark.parametrize("num_subsequences", [1, 3, 5])
def test_evaluate_equals_the_plain_model_without_gradients_or_dkdv(num_subsequences):
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    expected_sum, expected_count = _plain_sum_and_count(model, ids, targets)

    engine = SubsequenceEngine(num_subsequences, "flops")
    total, count = engine.evaluate(model, ids, targets)

    assert len(engine.plan(ids, config).lengths) == num_subsequences
    assert count.item() == expected_count
    assert abs(total.item() - expected_sum) / expected_sum < 1e-5
    assert not total.requires_grad
    assert all(p.grad is None for p in model.parameters())
    caches = engine._pool.caches()
    assert caches and all(c._dk is None and c._dv is None for c in caches)  # no K/V gradient buffers
    assert all(core.cache is None for core in subsequence_cores(model))  # unbound: plain attention outside


def test_subsequences_without_their_prefix_give_another_loss():
    """Negative control: the comparison above sees a missing K/V prefix (subsequences evaluated alone): the
    loss moves by more than ten times its tolerance (seeded; 1.9e-4 relative)."""
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    expected_sum, _ = _plain_sum_and_count(model, ids, targets)
    alone = sum(_plain_sum_and_count(model, ids[:, o : o + 15], targets[:, o : o + 15])[0] for o in range(0, S, 15))
    assert abs(alone - expected_sum) / expected_sum > 1e-4


def test_evaluate_under_inference_mode_leaves_caches_trainable():
    """Lightning validates under inference mode: the caches it fills must still take the next training step."""
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    engine = SubsequenceEngine(3, "length")
    with torch.inference_mode():
        total, count = engine.evaluate(model, ids, targets)
    ref_loss, _ = plain_loss_and_grads(model, ids, targets)
    assert abs(total.item() / count.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    loss = engine.forward_backward(model, ids, targets)  # reuses the caches filled above
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5


def test_fabric_strategy_evaluates_the_mean_loss_of_the_batch():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    ref_loss, _ = plain_loss_and_grads(model, ids, targets)
    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=4, partition="flops"), accelerator="cpu", devices=1)
    module = fabric.setup_module(model)
    total, count = fabric.strategy.evaluate(module, ids, targets)
    assert abs(total.item() / count.item() - ref_loss.item()) / ref_loss.item() < 1e-5
