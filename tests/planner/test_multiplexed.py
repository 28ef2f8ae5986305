"""The "sppo" schedule in the planner (``planner.multiplexed``): replicas, the activation walk, time, the search."""

from __future__ import annotations

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.offload.policy import peak_saved_bytes
from lightning_sppo.planner import CostModel, Layout, PlanRequest, precision_bytes, solve, stage_specs
from lightning_sppo.planner.activations import kv_cache_bytes_per_layer
from lightning_sppo.planner.evaluate import Limits, evaluate
from lightning_sppo.planner.layout import placement
from lightning_sppo.planner.memory import stage_parameter_counts
from lightning_sppo.planner.multiplexed import activation_peak, rank_actions, replica_bytes, shared_units
from lightning_sppo.planner.step_time import simulate_step_time
from lightning_sppo.schedule import build_schedule
from tests.planner.conftest import UNLIMITED

SEQ_LEN = 2**15


def _evaluate(config: GPTConfig, layout: Layout, schedule: str, n: int = 8, precision: str = "bf16-mixed"):
    dtypes = precision_bytes(precision, sharded=layout.dp * layout.sp > 1)
    return evaluate(
        CostModel(config, dtypes, UNLIMITED), layout, placement(layout, 8), stage_specs(config, layout.pp),
        [SEQ_LEN // n] * n, Limits(2**50, 2**50), offloads=("none",), schedule=schedule,
    )  # fmt: skip


def test_every_rank_holds_replicas_of_all_other_stages():
    """Weights and grads of the other stages in the activation dtype; K/V of the other stages' layers, whole sequence."""
    config = GPTConfig.from_name("gpt-1b")
    dtypes = precision_bytes("bf16-mixed", sharded=True)
    stages = stage_specs(config, 4)
    kv, grad = kv_cache_bytes_per_layer(config, dtypes, SEQ_LEN, sp=2)
    for stage in stages:
        replicas = replica_bytes(config, dtypes, stages, stage.index, SEQ_LEN, sp=2)
        others = [stage_parameter_counts(config, s).total for s in stages if s is not stage]
        assert replicas.weights == replicas.grads == 2 * sum(others)  # bf16, like FSDP's gathered weights
        assert replicas.kv_cache == (config.n_layer - stage.layers) * kv
        assert replicas.kv_grad == (config.n_layer - stage.layers) * grad


def test_every_rank_shares_units_of_every_other_stage():
    """What makes every replica's caches allocated: each rank helps each other stage at least once."""
    pp, n = 4, 8
    for rank in range(pp):
        helped = {a.stage for a in rank_actions(pp, n, rank) if a.multiplexed and a.stage != rank}
        assert helped == set(range(pp)) - {rank}


def test_sppo_costs_memory_and_removes_the_bubble():
    """Same layout and N: "sppo" holds more (replicas) and has a smaller bubble; seq1f1b holds no replicas."""
    config = GPTConfig.from_name("gpt-1b")
    layout = Layout(sp=2, pp=4, dp=1)
    plain, shared = _evaluate(config, layout, "seq1f1b"), _evaluate(config, layout, "sppo")
    assert all(s.memory.replica_bytes == 0 for s in plain.stages)
    for before, after in zip(plain.stages, shared.stages, strict=True):
        assert after.memory.replica_bytes > 0
        assert after.memory.peak_gpu_bytes > before.memory.peak_gpu_bytes + after.memory.replica_bytes // 2
    plain_time, shared_time = simulate_step_time(plain), simulate_step_time(shared)
    assert shared_time.bubble_ratio < plain_time.bubble_ratio / 2
    assert shared_time.breakdown.shared > 0 and plain_time.breakdown.shared == 0
    assert shared_time.step_s == pytest.approx(sum(shared_time.breakdown.as_dict().values()))


def test_sppo_with_one_stage_is_seq1f1b():
    config = GPTConfig.from_name("gpt-1b")
    layout = Layout(sp=2, pp=1, dp=4)
    plain, shared = _evaluate(config, layout, "seq1f1b"), _evaluate(config, layout, "sppo")
    assert plain.stages[0].memory == shared.stages[0].memory
    assert simulate_step_time(plain).step_s == simulate_step_time(shared).step_s


def test_the_walk_reproduces_the_offload_peak_when_nothing_is_shared():
    """On a seq1f1b action list the walk gives max_i (M_{i-1} + A_i) (``offload.policy``); sharing changes it."""
    level2 = [90, 70, 60, 50, 40, 40]
    offloaded = [45, 35, 30, 20, 10, 0]
    for rank in range(3):
        actions = build_schedule("seq1f1b", 3, len(level2))[rank]
        assert activation_peak(actions, rank, level2, offloaded, lambda a: 0) == peak_saved_bytes(level2, offloaded)
    shared = rank_actions(3, len(level2), 0)
    walked = activation_peak(shared, 0, level2, offloaded, lambda a: 1000)
    assert walked >= 1000 + min(level2)  # a shard in flight, never offloaded, on top of a unit of its own


def test_shared_units_follow_the_msp_phases():
    groups = shared_units(4, 8)
    assert groups[0] == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3), 2: (0, 1, 2, 3)}  # Left-SP of stage 0
    assert groups[3] == {5: (0, 1, 2, 3), 6: (0, 1, 2, 3), 7: (0, 1, 2, 3)}  # Right-SP of the last stage


def test_the_solver_searches_the_schedule():
    """Both allowed: whichever wins, the other is explained; one allowed: only that one is planned."""
    request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=SEQ_LEN, nodes=1, profile=UNLIMITED, pp=4)
    both = solve(request)
    (other,) = both.other_schedules
    assert other.startswith({"seq1f1b": "sppo", "sppo": "seq1f1b"}[both.schedule] + ": ")
    only = {name: solve(PlanRequest(**{**request.__dict__, "schedule": (name,)})) for name in ("seq1f1b", "sppo")}
    assert only["seq1f1b"].schedule == "seq1f1b" and not only["seq1f1b"].other_schedules
    assert only["sppo"].schedule == "sppo" and only["sppo"].memory.replica_bytes > 0
    assert only["seq1f1b"].memory.replica_bytes == 0
    assert both.step_time_s == min(plan.step_time_s for plan in only.values())


def test_sppo_does_not_fit_long_sequences_and_says_why():
    """At 1M tokens the replicas' whole-sequence K/V alone exceed the GPU: the text names them."""
    request = PlanRequest(
        config=GPTConfig.from_name("gpt-7b"), seq_len=2**20, nodes=4, profile=UNLIMITED.__class__(
            **(UNLIMITED.to_dict() | {"hbm_bytes": 80 * 2**30, "host_bytes_per_gpu": 2**40})
        ),
    )  # fmt: skip
    plan = solve(request)
    assert plan.schedule == "seq1f1b"
    (other,) = plan.other_schedules
    assert other.startswith("sppo: no layout fits") and "replicas of the other stages" in other
