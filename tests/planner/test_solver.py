"""The solver on small requests: what it picks, that the plan is consistent, and why nothing fits."""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import replace
from itertools import pairwise

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.planner import BUILTIN_PROFILES, NoFeasiblePlan, PlanRequest, resolve_profile, solve, solver
from lightning_sppo.planner.report import format_plan
from tests.planner.conftest import UNLIMITED, small_gpu

PLAIN = dict(recompute=("none",), kv_device_tokens=None, model_state=("device",))
"""What the runtime held before recompute, K/V spill and model state on host: the tests of offloading and of the
reasons nothing fits pin it, so the device and host limits they test are reached."""


def test_tiny_plan_is_consistent():
    config = GPTConfig.from_name("tiny", block_size=16384)
    plan = solve(PlanRequest(config=config, seq_len=16384, nodes=1, profile=UNLIMITED))
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
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**17, nodes=1, profile=small_gpu(24), **PLAIN)
    plan = solve(request)
    assert plan.offload in ("adaptive", "full")
    assert plan.peak_host_bytes > 0 and plan.peak_gpu_bytes <= 24 * 2**30
    assert all(a >= b for a, b in pairwise(plan.alpha))


def test_the_fastest_plan_wins_wherever_its_pipeline_runs():
    """No preference for pipelines inside nodes: the cost model charges every link, and the fastest simulated wins."""
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**16, nodes=2, profile=UNLIMITED)
    plan = solve(request)
    assert plan.runner_ups
    for runner_up in plan.runner_ups:
        assert runner_up.tokens_per_gpu_per_s <= plan.tokens_per_gpu_per_s
        assert "slower" in runner_up.why


@pytest.mark.parametrize(
    ("model", "seq_len", "nodes", "layouts"),
    [
        ("gpt-1b", 2**17, 1, [(4, 2, 32), (8, 1, 16), (2, 4, 64), (8, 1, 96)]),
        ("gpt-1b", 2**16, 2, [(8, 2, 48), (16, 1, 24), (4, 2, 80)]),  # sp=16: a group of two whole nodes
    ],
)
def test_never_slower_than_a_layout_it_could_have_tried(model, seq_len, nodes, layouts):
    """The search returns the best it scores: no (sp, pp, N) on its grid, assessed by the same model, is faster."""
    config = GPTConfig.from_name(model, block_size=seq_len)
    request = PlanRequest(config=config, seq_len=seq_len, nodes=nodes, profile=BUILTIN_PROFILES["h100"])
    plan = solve(request)
    for sp, pp, n in layouts:
        assessed = solver.assess_layout(request, sp, pp, n)
        assert assessed.feasible, (sp, pp, n)
        assert plan.tokens_per_gpu_per_s >= assessed.tokens_per_gpu_per_s * (1 - 1e-9), (sp, pp, n, plan)


def _exhaustive(monkeypatch) -> None:
    monkeypatch.setattr(solver, "_threshold", lambda searches: math.inf)


def test_pruning_keeps_the_answer(monkeypatch):
    """The best-first search with bounds picks what evaluating every (layout, N) picks, at a fraction of the
    evaluations; negative control: a bound that overstates (x3) prunes the winner away."""
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**17, nodes=2, profile=small_gpu(24))
    counted = {"evaluate": 0}
    evaluate = solver.evaluate

    def counting(*args, **kwargs):
        counted["evaluate"] += 1
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(solver, "evaluate", counting)
    pruned = solve(request)
    pruned_calls, counted["evaluate"] = counted["evaluate"], 0
    with monkeypatch.context() as patch:
        _exhaustive(patch)
        full = solve(request)
    assert pruned.pruned > 0 and full.pruned == 0
    assert pruned_calls < counted["evaluate"]
    assert (pruned.sp, pruned.pp, pruned.num_subsequences) == (full.sp, full.pp, full.num_subsequences)
    assert pruned.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    bound = solver._bound
    monkeypatch.setattr(solver, "_bound", lambda frontier, lengths: 3 * bound(frontier, lengths))
    wrong = solve(request)
    assert wrong.tokens_per_gpu_per_s < full.tokens_per_gpu_per_s


@pytest.mark.slow
def test_sequence_too_long_names_the_limit():
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**20, nodes=1, profile=small_gpu(40), **PLAIN)
    with pytest.raises(NoFeasiblePlan, match=r"GPU memory.*over the 40.0 GiB.*too long for the memory") as error:
        solve(request)
    assert error.value.limit == "gpu" and error.value.overflow_bytes > 0


def test_host_limit_is_reported():
    """The device needs offloading (as above) but the host cannot take it."""
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**17, nodes=1,
                          profile=small_gpu(24, host_gib=0.5), **PLAIN)  # fmt: skip
    with pytest.raises(NoFeasiblePlan, match=r"host memory .* over the 512.0 MiB per GPU of --gpu=small-gpu") as error:
        solve(request)
    assert error.value.limit == "host"


def test_too_few_gpus_for_the_model(a100):
    request = PlanRequest(config=GPTConfig.from_name("gpt-65b"), seq_len=2**15, nodes=1, profile=a100, **PLAIN)
    with pytest.raises(NoFeasiblePlan, match=r"too few GPUs for the model.*AdamW state alone take .* use more --nodes"):
        solve(request)


def test_request_errors_name_the_flag(a100):
    with pytest.raises(ValueError, match=r"--nodes must be a positive integer, got --nodes=0"):
        PlanRequest(config=GPTConfig.from_name("tiny"), seq_len=1024, nodes=0, profile=a100)
    with pytest.raises(ValueError, match=r"--seq-len=8192 exceeds the model's block_size=4096"):
        PlanRequest(config=GPTConfig.from_name("tiny"), seq_len=8192, nodes=1, profile=a100)
    with pytest.raises(ValueError, match=r"--precision='bf16-fsdp-mp'"):
        PlanRequest(config=GPTConfig.from_name("tiny"), seq_len=1024, nodes=1, profile=a100, precision="bf16-fsdp-mp")


@pytest.mark.slow
def test_paper_scale_search_stays_pruned(a100, monkeypatch, precision="bf16-mixed"):
    """GPT-65B at 1M tokens on 128 GPUs: the search stays within a fixed budget of evaluations and simulations.

    Counted, not timed (a wall-clock bound fails on a loaded machine): an evaluation costs ~10 ms and a step
    simulation more. bf16-mixed only: with recompute, spill and host model state the search takes 30-45 s here, and
    fp32 prunes the same way (it ran as a second case until the suite outgrew its time).
    """
    calls = {"evaluate": 0, "simulate": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(solver, "evaluate", counting("evaluate", solver.evaluate))
    monkeypatch.setattr(solver, "simulate_step_time", counting("simulate", solver.simulate_step_time))
    request = PlanRequest(config=GPTConfig.from_name("gpt-65b"), seq_len=2**20, nodes=16, profile=a100,
                          precision=precision)  # fmt: skip
    with contextlib.suppress(NoFeasiblePlan):  # the search's size is the point, not its answer
        solve(request)
    # 1000 before recompute, K/V spill and model state on host; with them this request fits (selective recompute,
    # K/V partly on host) and the layouts that fit are searched over every (recompute, model state) at each N.
    assert 0 < calls["evaluate"] <= 2500, calls
    most_simulated = solver._SIMULATED_LAYOUTS * (2 + len(request.schedule)) * solver._SIMULATED_PER_LAYOUT
    assert calls["simulate"] <= most_simulated, calls


def test_no_fit_says_when_bf16_dkdv_would_fit():
    """Over by less than what bf16 dK/dV save: the reason names the flag, that it is lossy, and by how much."""
    config = GPTConfig.from_name("tiny-gqa", block_size=2**20)
    request = PlanRequest(config=config, seq_len=2**20, nodes=1, profile=small_gpu(0.85), sp=1, pp=1, **PLAIN)
    with pytest.raises(NoFeasiblePlan, match=r"K/V \+ fp32 dK/dV") as error:
        solve(request)
    message = str(error.value)
    assert "fits with --kv-grad-dtype=bf16 (dK/dV accumulated in bf16: lossy)" in message
    taking = re.search(r"its dK/dV taking ([\d.]+) MiB instead of ([\d.]+) MiB", message)
    assert taking and float(taking[2]) == pytest.approx(2 * float(taking[1]), abs=0.1), message  # bf16: half of fp32
    assert "MiB under the 870.4 MiB" in message
    plan = solve(PlanRequest(**{**request.__dict__, "kv_grad_dtype": "bf16"}))
    assert plan.kv_grad_dtype == "bf16" and plan.peak_gpu_bytes <= request.profile.hbm_bytes


def test_no_fit_says_when_bf16_dkdv_would_not_fit_either():
    """Negative control: far over the limit, the reason says bf16 dK/dV would not be enough."""
    config = GPTConfig.from_name("tiny-gqa", block_size=2**20)
    request = PlanRequest(config=config, seq_len=2**20, nodes=1, profile=small_gpu(0.3), sp=1, pp=1, **PLAIN)
    with pytest.raises(NoFeasiblePlan) as error:
        solve(request)
    assert "fits with --kv-grad-dtype=bf16" not in str(error.value)
    assert "even --kv-grad-dtype=bf16 (dK/dV accumulated in bf16: lossy) leaves" in str(error.value)
    # The bf16 shortfall says what it counts, so it is not read against the fp32 peak with activations.
    assert re.search(r"lossy\) leaves [^;]* over [^;]*(before any activation|with its activations)", str(error.value))


def test_when_nothing_fits_only_the_nearest_layout_of_each_kind_is_evaluated():
    """Layouts ruled out by their bytes are evaluated for the message only where nothing fits, and then only the
    nearest of each kind per schedule (over the device before any activation; over device and host together): one
    evaluation of each at tens of millions of tokens took minutes. The message still names the nearest layout. (The
    layer order fits this request: the subsequence order's search is what is checked.)"""
    request = PlanRequest(
        config=GPTConfig.from_name("gpt-7b"),
        seq_len=2**22,
        nodes=1,
        profile=BUILTIN_PROFILES["a100-80gb"],
        order=("subsequence",),
    )
    with pytest.raises(NoFeasiblePlan, match=r"the closest \(sp=8 pp=1 dp=1, schedule=seq1f1b"):
        solve(request)
    profile = request.profile
    limits = solver.Limits(profile.hbm_bytes - profile.reserved_bytes, profile.host_bytes_per_gpu)
    searches = solver._search_all(request, limits, solver._Partitions(request.seq_len, request.config))
    evaluated = [(s.schedule, bool(s.fixed_overflow)) for s in searches if s.closest is not None]
    assert evaluated and len(evaluated) == len(set(evaluated)), evaluated
    ruled_out = [s for s in searches if s.closest is None and s.skipped]
    assert len(ruled_out) >= 10 and all(
        "before any activation" in s.skipped or "fits at no N" in s.skipped for s in ruled_out
    )


def test_plain_model_with_checkpointing_is_scored_beside_the_plan_and_advised_when_faster():
    """gpt-1b at 64K on one H100 with today's engine (FlashAttention-2 in the engine, cuDNN in the plain model):
    activation checkpointing is faster, and the plan says so with both figures; with cuDNN in the engine too, the
    plan is faster and there is no advice (negative control)."""
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=65536, nodes=1,
                          profile=resolve_profile("h100", gpus_per_node=1), attention="sdpa")  # fmt: skip
    plan = solve(request)
    ac = plan.plain_ac
    assert ac["fits"] and ac["kernel"] == "cudnn" and plan.attention_kernel == "flash"
    assert ac["tokens_per_gpu_per_s"] > plan.tokens_per_gpu_per_s
    assert f"{ac['tokens_per_gpu_per_s']:.0f}" in plan.advice and f"{plan.tokens_per_gpu_per_s:.0f}" in plan.advice
    assert "train without sppo" in format_plan(plan)
    faster = solve(replace(request, attention="cudnn"))
    assert faster.tokens_per_gpu_per_s > faster.plain_ac["tokens_per_gpu_per_s"] and faster.advice == ""
    assert faster.to_dict()["plain_ac"]["step_time_s"] == pytest.approx(ac["step_time_s"])
