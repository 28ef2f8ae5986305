"""``benchmarks/msp_bound.py``'s own arithmetic: the schedule-only speed-ups and the traffic floor it reports."""

from __future__ import annotations

import pytest

from benchmarks.msp_bound import schedule_speedup, traffic_floor
from lightning_sppo import GPTConfig
from lightning_sppo.planner.flops import block_matmul_params


def test_uniform_speedup_is_the_simulated_makespans():
    """pp=4, N=8, uniform costs: seq1f1b takes 33 forward-times, sppo 25 (README, schedule_sim)."""
    assert schedule_speedup(4, 8)["speedup"] == pytest.approx(33 / 25)


def test_equal_weights_are_uniform_costs_and_unequal_ones_are_not():
    uniform = schedule_speedup(4, 8)
    equal = schedule_speedup(4, 8, [5.0] * 8)
    assert equal["speedup"] == pytest.approx(uniform["speedup"])
    assert equal["bubble"] == pytest.approx(uniform["bubble"])
    rising = schedule_speedup(4, 8, [float(i + 1) for i in range(8)])
    assert rising["bubble"]["seq1f1b"] > uniform["bubble"]["seq1f1b"]  # later subsequences dearer: stalls


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_traffic_floor_counts_every_other_stage_once_per_direction(pp):
    """Under Definition 6.2 each rank helps every other stage (Left-SP of the earlier, Right-SP of the later)."""
    config = GPTConfig.from_name("tiny")
    floor = traffic_floor(config, pp, 2 * pp, inter_node_gbps=2.0)
    assert floor["stages_helped"] == pp - 1
    expected = (pp - 1) * 3 * 2 * block_matmul_params(config) * config.n_layer / pp
    assert floor["bytes"] == pytest.approx(expected)
    assert floor["seconds"] == pytest.approx(expected / 2e9)
