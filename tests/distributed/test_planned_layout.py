"""Unset ``pipeline_parallel`` / ``sequence_parallel``: the planner picks them in ``fabric.setup``, on every rank
alike, and the run trains exactly like the plain model (gloo, real processes), in either order."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from lightning.fabric import Fabric
from torch.distributed.tensor import DTensor

from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.parallel import ParallelDims
from lightning_sppo.planner import BUILTIN_PROFILES, PlanRequest, load_profile, solve
from tests.conftest import make_batch, parity_config, plain_loss_and_grads
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.slow  # several processes (gloo) per test

S = 48


def planned_layout(rank: int, world_size: int) -> None:
    config = parity_config(gqa=True, n_layer=2)
    torch.manual_seed(0)
    plain = GPT(config)
    strategy = SPPOStrategy(pipeline_parallel=None, sequence_parallel=None, num_subsequences=2, partition="flops")
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    stage = fabric.setup(copy.deepcopy(plain))

    # The solver's answer for this run: the model's block_size tokens, one node of two, fp32.
    profile = replace(BUILTIN_PROFILES["a100-80gb"], gpus_per_node=world_size)
    request = PlanRequest(config=config, seq_len=config.block_size, nodes=1, profile=profile, precision="fp32",
                          offload=("none",), fsdp_sync=("step",), schedule=("seq1f1b",))  # fmt: skip
    plan = solve(request)
    assert fabric.strategy.dims == ParallelDims(plan.pp, plan.dp, plan.sp), (rank, fabric.strategy.dims, plan)

    dims = fabric.strategy.dims
    ids, targets = make_batch(config, 2 * dims.dp, S)
    ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)
    rows = slice(dims.coordinates(rank)[1] * 2, (dims.coordinates(rank)[1] + 1) * 2)
    loss = fabric.strategy.forward_backward(stage, ids[rows], targets[rows])
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (rank, loss.item(), ref_loss.item())
    for name, param in stage.module.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        assert ((grad - ref_grads[name]).norm() / ref_grads[name].norm()).item() < 1e-5, (rank, name)


def test_unset_sizes_are_planned_in_setup_and_train_like_the_plain_model():
    run_distributed(planned_layout, 2)


def planned_layer_layout(rank: int, world_size: int, profile_path: str) -> None:
    """order="layer" with sequence_parallel=None on a GPU profile too small for whole sequences per rank: the
    solver's layer-order layout (sp=2 here) is what runs, and it trains like the plain model."""
    config = replace(parity_config(gqa=True, n_layer=2), block_size=16384)
    torch.manual_seed(0)
    plain = GPT(config)
    strategy = SPPOStrategy(order="layer", recompute="selective", offload="none", sequence_parallel=None,
                            num_subsequences=3, planner_profile=profile_path)  # fmt: skip
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    stage = fabric.setup(copy.deepcopy(plain))

    profile = replace(load_profile(profile_path), gpus_per_node=world_size)
    request = PlanRequest(config=config, seq_len=config.block_size, nodes=1, profile=profile, precision="fp32", pp=1,
                          offload=("none",), fsdp_sync=("step",), schedule=("seq1f1b",), recompute=("selective",),
                          order=("layer",))  # fmt: skip
    plan = solve(request)
    assert plan.order == "layer" and plan.sp == world_size, plan  # the profile leaves no room for dp
    assert fabric.strategy.dims == ParallelDims(1, plan.dp, plan.sp), (rank, fabric.strategy.dims, plan)
    assert type(fabric.strategy.engine).__name__ == "LayerMajorEngine"

    ids, targets = make_batch(config, 2, S)
    ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)
    loss = fabric.strategy.forward_backward(stage, ids, targets)  # every sp rank passes the whole batch
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (rank, loss.item(), ref_loss.item())
    for name, param in stage.module.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        assert ((grad - ref_grads[name]).norm() / ref_grads[name].norm()).item() < 1e-5, (rank, name)


def test_the_layer_orders_unset_sequence_parallel_is_planned_and_trains_like_the_plain_model(tmp_path):
    path = tmp_path / "small.json"  # 30 MiB: a rank cannot hold whole 16K-token sequences of the tiny model
    profile = replace(BUILTIN_PROFILES["a100-80gb"], name="small", hbm_bytes=30 * 2**20, reserved_bytes=0,
                      allocator_slack_bytes=0, gpus_per_node=1)  # fmt: skip
    profile.save(path)
    run_distributed(planned_layer_layout, 2, str(path))
