"""The solver on small requests: what it picks, that the plan is consistent, and why nothing fits."""

from __future__ import annotations

import time

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.planner import NoFeasiblePlan, PlanRequest, solve
from tests.planner.conftest import UNLIMITED, small_gpu


def test_tiny_plan_is_consistent():
    plan = solve(PlanRequest(config=GPTConfig.from_name("tiny"), seq_len=16384, nodes=1, profile=UNLIMITED))
    assert plan.sp * plan.pp * plan.dp == 8
    assert sum(plan.partition) == 16384 and len(plan.partition) == plan.num_subsequences
    assert all(length % plan.sp == 0 for length in plan.partition)
    assert sum(plan.layers_per_stage) == 2 and len(plan.alpha_by_stage) == plan.pp
    assert plan.offload == "none"  # nothing needs to move when memory is plentiful
    assert plan.peak_gpu_bytes == plan.memory.peak_gpu_bytes
    assert plan.tokens_per_gpu_per_s == pytest.approx(16384 / (plan.step_time_s * plan.pp * plan.sp))
    assert 0 < plan.mfu < UNLIMITED.mfu and plan.bubble_ratio >= 0


def test_memory_pressure_turns_offloading_on():
    """gpt-1b at 128K on one 8-GPU node: the device cannot hold every subsequence's activations."""
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**17, nodes=1, profile=small_gpu(24))
    plan = solve(request)
    assert plan.offload in ("adaptive", "full")
    assert plan.peak_host_bytes > 0 and plan.peak_gpu_bytes <= 24 * 2**30
    assert all(a >= b for a, b in zip(plan.alpha, plan.alpha[1:]))


def test_prefers_a_pipeline_inside_nodes_when_one_fits():
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**16, nodes=2, profile=UNLIMITED)
    plan = solve(request)
    assert not plan.pp_cross_node
    for runner_up in plan.runner_ups:
        assert "slower" in runner_up.why or "crosses nodes" in runner_up.why


def test_sequence_too_long_names_the_limit():
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**20, nodes=1, profile=small_gpu(40))
    with pytest.raises(NoFeasiblePlan, match=r"GPU memory.*over the 40.0 GiB.*too long for the device memory") as error:
        solve(request)
    assert error.value.limit == "gpu" and error.value.overflow_bytes > 0


def test_host_limit_is_reported():
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**19, nodes=1,
                          profile=small_gpu(80, host_gib=1))  # fmt: skip
    with pytest.raises(NoFeasiblePlan) as error:
        solve(request)
    assert error.value.limit in ("gpu", "host")


def test_too_few_gpus_for_the_model(a100):
    request = PlanRequest(config=GPTConfig.from_name("gpt-65b"), seq_len=2**15, nodes=1, profile=a100)
    with pytest.raises(NoFeasiblePlan, match=r"too few GPUs for the model.*AdamW state alone take .* use more --nodes"):
        solve(request)


def test_request_errors_name_the_flag(a100):
    with pytest.raises(ValueError, match=r"--nodes must be a positive integer, got --nodes=0"):
        PlanRequest(config=GPTConfig.from_name("tiny"), seq_len=1024, nodes=0, profile=a100)
    with pytest.raises(ValueError, match=r"--seq-len=8192 exceeds the model's block_size=4096"):
        PlanRequest(config=GPTConfig.from_name("tiny"), seq_len=8192, nodes=1, profile=a100)
    with pytest.raises(ValueError, match=r"--precision='fp16'"):
        PlanRequest(config=GPTConfig.from_name("tiny"), seq_len=1024, nodes=1, profile=a100, precision="fp16")


def test_paper_scale_plan_is_fast(a100):
    """GPT-65B at 1M tokens on 128 GPUs (an H200 profile, where it fits) plans in a few seconds."""
    from lightning_sppo.planner import BUILTIN_PROFILES

    start = time.perf_counter()
    plan = solve(PlanRequest(config=GPTConfig.from_name("gpt-65b"), seq_len=2**20, nodes=16,
                             profile=BUILTIN_PROFILES["h200"]))  # fmt: skip
    assert time.perf_counter() - start < 10
    assert plan.sp * plan.pp * plan.dp == 128
