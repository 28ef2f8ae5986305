"""``model_state="host"`` on one device: FSDP2's CPU offload over a process group of one, the plain model's numbers.

Parameters, gradients and AdamW state are host tensors under ``CPUOffloadPolicy`` (on CPU that placement cannot be
told from "device", so the tests check the policy FSDP holds: a run that ignored the setting has none), the loss,
gradients and the clipped update equal the plain model's, and a checkpoint round trip restores the state.
"""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.fabric import Fabric
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.parallel.fsdp import fsdp_modules
from tests.conftest import full_tensor, make_batch, parity_config, plain_loss_and_grads, relative_error

LR = 0.1


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def setup(model: GPT, model_state: str, optimizer: type = torch.optim.SGD, **settings):
    fabric = Fabric(strategy=SPPOStrategy(model_state=model_state, **settings), accelerator="cpu", devices=1)
    stage, opt = fabric.setup(model, optimizer(model.parameters(), lr=LR))
    return fabric, stage, opt


def offload_policies(stage) -> list:
    return [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in fsdp_modules(stage.module)]


def test_host_state_equals_the_plain_model_and_the_clipped_step():
    config = parity_config(gqa=True)
    torch.manual_seed(0)
    plain = GPT(config)
    ids, targets = make_batch(config, 2, 48)
    ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)

    fabric, stage, optimizer = setup(copy.deepcopy(plain), "host", num_subsequences=3, recompute="full")
    try:
        policies = offload_policies(stage)
        assert policies and all(isinstance(p, CPUOffloadPolicy) for p in policies), policies
        loss = fabric.strategy.forward_backward(stage, ids, targets)
        assert relative_error(loss, ref_loss) < 1e-5
        for name, param in stage.module.named_parameters():
            assert isinstance(param, DTensor) and param.device.type == "cpu", name
            assert relative_error(full_tensor(param.grad), ref_grads[name]) < 1e-5, name
        ref_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm()
        norm = fabric.clip_gradients(stage, optimizer, max_norm=0.5 * ref_norm.item())
        assert relative_error(norm, ref_norm) < 1e-5
        optimizer.step()
        scale = 0.5 * ref_norm / (ref_norm + 1e-6)
        expected = dict(plain.named_parameters())
        for name, param in stage.module.named_parameters():
            updated = expected[name].detach() - LR * scale * ref_grads[name]
            assert relative_error(full_tensor(param.detach()), updated) < 1e-5, name
    finally:
        fabric.strategy.teardown()


def test_device_state_has_no_offload_policy():
    """Negative control for the policy check above: with the default setting nothing is sharded to host."""
    fabric, stage, _ = setup(GPT(parity_config()), "device", num_subsequences=3)
    assert offload_policies(stage) == []
    assert not any(isinstance(p, DTensor) for p in stage.parameters())


def test_adamw_state_lives_with_the_host_shards_and_a_checkpoint_restores_it(tmp_path):
    config = parity_config()
    ids, targets = make_batch(config, 1, 45)
    fabric, stage, optimizer = setup(GPT(config), "host", torch.optim.AdamW, num_subsequences=3)
    try:
        fabric.strategy.forward_backward(stage, ids, targets)
        optimizer.step()
        moments = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
        assert moments and all(isinstance(t, DTensor) and t.device.type == "cpu" for t in moments)
        fabric.save(tmp_path / "ckpt", {"model": stage, "optimizer": optimizer, "step": 1})
        saved = {n: full_tensor(p.detach()).clone() for n, p in stage.module.named_parameters()}
        fabric.strategy.forward_backward(stage, ids, targets)
        optimizer.step()  # moves away from the checkpoint
        remainder = fabric.load(tmp_path / "ckpt", {"model": stage, "optimizer": optimizer})
        assert remainder["step"] == 1
        for name, param in stage.module.named_parameters():
            assert torch.equal(full_tensor(param.detach()), saved[name]), name
    finally:
        fabric.strategy.teardown()
