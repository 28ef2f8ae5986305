"""Recompute (``lightning_sppo.recompute``): the plain model's loss and gradients, fewer bytes kept, offload on top."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.fabric import Fabric

import lightning_sppo.recompute as recompute
from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.offload import OffloadCallback, build_offloader
from lightning_sppo.recompute import apply_recompute
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import (
    document_ids_from_lengths,
    make_batch,
    max_relative_error,
    parity_config,
    plain_loss_and_grads,
    relative_error,
    separate_documents_loss_and_grads,
)

S = 45
DOCUMENTS = [[10, 1, 26, 8], [20, 25]]  # two rows of packed documents, S tokens each


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def strategy_step(model, ids, targets, document_ids, recompute_mode, offload, kv_device_tokens=None):
    """One Fabric step with ``recompute``, ``offload`` and the K/V beyond ``kv_device_tokens`` on host:
    (loss, its offloader's stats or None, the Fabric, module)."""
    callback = offload if offload == "none" else OffloadCallback(offload, min_bytes=0)  # tiny tensors count
    strategy = SPPOStrategy(
        num_subsequences=5, partition="flops", recompute=recompute_mode, offload=callback,
        kv_device_tokens=kv_device_tokens, kv_chunk_tokens=4,
    )  # fmt: skip
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    module = fabric.setup(model)
    loss = fabric.strategy.forward_backward(module, ids, targets, document_ids)
    hooks = fabric.strategy.core.hooks
    return loss, (hooks.last_stats if hooks is not None else None), fabric, module


def parity_errors(loss, model, ref_loss, ref_grads) -> tuple[float, float]:
    return relative_error(loss, ref_loss), max_relative_error(ref_grads, model)[0]


@pytest.mark.parametrize("kv_device_tokens", [None, 13], ids=["kv-on-device", "kv-spilled"])
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("offload", ["none", "adaptive"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_equals_the_plain_model_with_and_without_offload(mode, offload, documents, kv_device_tokens):
    """Every recompute mode x offload x K/V on host or not x packed documents or not."""
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    document_ids = document_ids_from_lengths(DOCUMENTS) if documents else None
    if documents:
        ref_loss, ref_grads = separate_documents_loss_and_grads(model, ids, targets, document_ids)
    else:
        ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    plain_eval = SubsequenceEngine(3).evaluate(copy.deepcopy(model), ids, targets, document_ids)

    loss, stats, fabric, module = strategy_step(model, ids, targets, document_ids, mode, offload, kv_device_tokens)
    assert all(block.recompute == mode for block in model.blocks.values())
    if kv_device_tokens is not None:
        assert fabric.strategy.engine.cache_host_nbytes() > 0  # the K/V beyond it really lived on host
    if offload != "none":
        assert stats.offloaded_bytes > 0, stats  # what recompute keeps went through host memory
    loss_err, grad_err = parity_errors(loss, model, ref_loss, ref_grads)
    assert loss_err < 1e-5 and grad_err < 1e-5, (loss_err, grad_err)
    total, count = fabric.strategy.evaluate(module, ids, targets, document_ids)  # forward only: the plain forward
    assert relative_error(total, plain_eval[0]) < 1e-5 and torch.equal(count, plain_eval[1])


def level2_bytes(model, ids, targets, mode, n=5) -> int:
    """Bytes one step's subsequences save for backward (the offloader's count, every size included)."""
    hooks = build_offloader("full", "cpu", min_bytes=0)
    SubsequenceEngine(n, hooks=hooks).forward_backward(apply_recompute(copy.deepcopy(model), mode), ids, targets)
    return hooks.last_stats.level2_bytes


def test_recompute_keeps_fewer_bytes_full_fewest():
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    saved = {mode: level2_bytes(model, ids, targets, mode) for mode in ("none", "selective", "full")}
    assert saved["full"] < saved["selective"] < saved["none"], saved


def bytes_per_token_per_layer(mode: str, config_overrides: dict, seq_len: int = 64) -> float:
    """What one layer keeps per token: the difference of a 4- and a 2-layer model's saved bytes, per token."""
    counts = {}
    for layers in (2, 4):
        config = parity_config(n_layer=layers, **config_overrides)
        ids, targets = make_batch(config, 1, seq_len)
        counts[layers] = level2_bytes(GPT(config), ids, targets, mode, n=4)
    return (counts[4] - counts[2]) / 2 / seq_len


def test_bytes_per_token_per_layer_are_what_each_mode_keeps():
    """fp32, no GQA: full keeps the block input (D floats; the RoPE tables are one storage per subsequence, shared by
    every layer); selective keeps also the attention output (H Dh floats) and its log-sum-exp (H floats)."""
    D, H, Dh = 32, 4, 8
    full = bytes_per_token_per_layer("full", {})
    selective = bytes_per_token_per_layer("selective", {})
    none = bytes_per_token_per_layer("none", {})
    assert full == 4 * D
    assert selective == 4 * (D + H * Dh + H)
    assert none > 4 * selective


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_negative_control_a_wrong_kept_tensor_breaks_parity(mode, monkeypatch):
    """The parity check sees a recompute that restores a perturbed tensor: the block input (full) or the kept
    attention output (selective)."""
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    restored = recompute._restored

    def perturbed(ctx):
        x, cos, sin, replays = restored(ctx)
        if mode == "full":
            return x * 1.001, cos, sin, replays
        for replay in replays:
            out, lse = replay.kept
            replay.kept = (out * 1.001, lse)
        return x, cos, sin, replays

    monkeypatch.setattr(recompute, "_restored", perturbed)
    loss, _, _, _ = strategy_step(model, ids, targets, None, mode, "adaptive")
    loss_err, grad_err = parity_errors(loss, model, ref_loss, ref_grads)
    assert loss_err < 1e-5  # the forward is untouched ...
    assert grad_err > 1e-5, grad_err  # ... the gradients are not


def test_forward_without_grad_saves_nothing_and_none_restores_the_plain_forward():
    config = parity_config()
    model = apply_recompute(GPT(config), "full")
    block = next(iter(model.blocks.values()))
    assert "forward" in vars(block)
    ids, _ = make_batch(config, 1, 8)
    saved = []
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(ids)
    assert not saved
    apply_recompute(model, "none")
    assert "forward" not in vars(block) and not hasattr(block, "recompute")
    with pytest.raises(ValueError, match="recompute="):
        apply_recompute(model, "some")
