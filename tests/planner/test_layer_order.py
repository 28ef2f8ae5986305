"""The layer order in the planner: where it is planned, what it wins, and that its plan runs as planned."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.planner import BUILTIN_PROFILES, NoFeasiblePlan, PlanRequest, solve
from lightning_sppo.planner.layer_order import best_layer_order, layer_order_refusal, layer_order_step
from lightning_sppo.planner.layout import Layout
from lightning_sppo.planner.solver import cost_model, fits
from lightning_sppo.strategy.autoplan import plan_settings
from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.core import SPPOCore
from tests.conftest import make_batch
from tests.planner.conftest import small_gpu

H100 = replace(BUILTIN_PROFILES["h100"], gpus_per_node=1)


def _request(seq_len: int, profile=H100, **options) -> PlanRequest:
    return PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=seq_len, nodes=1, profile=profile, **options)


def test_one_gpu_with_little_host_memory_trains_longer_in_the_layer_order():
    """On the first GPU run's machine (125 GiB of host memory), gpt-1b at 768K fits only in the layer order: the
    subsequence order keeps every layer's K/V and dK/dV (on host beyond R) and the blocks' inputs."""
    profile = replace(H100, host_bytes_per_gpu=125 * 2**30)
    with pytest.raises(NoFeasiblePlan):
        solve(_request(768 * 1024, profile, order=("subsequence",), compare_ac=False))
    plan = solve(_request(768 * 1024, profile, compare_ac=False))
    assert plan.order == "layer" and plan.peak_gpu_bytes <= profile.hbm_bytes
    assert plan.peak_host_bytes <= profile.host_bytes_per_gpu
    assert plan.other_schedules == ["order=subsequence: no layout fits"]
    assert fits(_request(768 * 1024, profile)) and not fits(_request(768 * 1024, profile, order=("subsequence",)))


def test_the_faster_order_wins_and_the_other_is_reported():
    plan = solve(_request(128 * 1024, compare_ac=False))
    layered = best_layer_order(
        plan_request := _request(128 * 1024), lambda r: cost_model(plan_request, Layout(1, 1, 1), r)
    )
    other = plan.other_schedules[-1]
    if plan.order == "layer":
        assert plan.step_time_s == layered.step_s and other.startswith("order=subsequence:")
    else:
        assert (
            plan.step_time_s <= layered.step_s
            and other == f"order=layer: {128 * 1024 / layered.step_s:.0f} tokens/GPU/s"
        )


def test_the_layer_order_is_refused_where_it_cannot_run():
    eight = replace(BUILTIN_PROFILES["h100"], gpus_per_node=8)
    assert layer_order_refusal(_request(64 * 1024, eight)) == "it runs on one GPU (one stage, no sequence parallelism)"
    assert layer_order_refusal(_request(64 * 1024, recompute=("none",))).startswith("it recomputes")
    assert layer_order_refusal(_request(64 * 1024, order=("subsequence",))) == "not asked for (--order)"
    with pytest.raises(NoFeasiblePlan, match="--order layer cannot plan this request: it runs on one GPU"):
        solve(_request(64 * 1024, eight, order=("layer",)))


def test_more_memory_kept_costs_no_time_and_the_copies_are_charged_where_they_do_not_hide():
    """K/V on host (R=0) and checkpoints on host hold less on the device; a small model's short chunks cannot hide
    their copies, which the step time shows (negative control: on the device nothing is charged)."""
    request = _request(64 * 1024)
    costs = cost_model(request, Layout(1, 1, 1), "selective")
    spans = [(i * 2048, 2048) for i in range(32)]
    device = layer_order_step(costs, spans, "selective", "none", None, 16384)
    hosted = layer_order_step(costs, spans, "selective", "full", 0, 2048)
    assert hosted.peak_gpu_bytes < device.peak_gpu_bytes and hosted.memory.host_bytes > 0
    assert device.time.offload_wait == device.time.spill == 0.0 and hosted.time.spill > 0
    assert hosted.step_s > device.step_s


def test_a_planned_layer_order_runs_as_planned():
    """A layer-order plan (``--order layer``) of a tiny model: ``plan_settings`` give a strategy that runs the
    layer-major engine with the planned chunks."""
    config = GPTConfig.from_name("tiny-gqa", block_size=4096)
    request = PlanRequest(config=config, seq_len=2048, nodes=1, profile=replace(small_gpu(1.0), gpus_per_node=1),
                          order=("layer",), min_tokens_per_device=128, compare_ac=False)  # fmt: skip
    plan = solve(request)
    assert plan.order == "layer"
    settings = plan_settings(plan)
    assert settings["order"] == "layer" and settings["recompute"] in ("selective", "full")
    core = SPPOCore(SPPOConfig(**settings))
    core.set_world_size(1)
    model = core.prepare_model(GPT(config), torch.device("cpu"))
    ids, targets = make_batch(config, 1, 2048)
    core.forward_backward(model, ids, targets)
    assert type(core.engine).__name__ == "LayerMajorEngine" and list(core.last_plan.lengths) == plan.partition
