"""Candidate layouts and where their ranks land (the runtime's (pp, dp, sp) mesh, consecutive ranks per node)."""

from __future__ import annotations

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.planner import Layout, candidate_layouts, subsequence_counts
from lightning_sppo.planner.layout import placement


def test_candidates_keep_sp_inside_nodes_and_dividing_heads():
    config = GPTConfig.from_name("gpt-13b")  # 40 heads: sp in {1, 2, 4, 5, 8, ...}
    layouts = candidate_layouts(config, world_size=64, gpus_per_node=8)
    assert {layout.sp for layout in layouts} == {1, 2, 4, 8}  # 5 does not divide the node, 16 crosses it
    assert all(layout.world_size == 64 and layout.pp <= config.n_layer for layout in layouts)
    assert Layout(8, 8, 1) in layouts


@pytest.mark.parametrize(
    ("layout", "sp_cross", "boundaries", "fsdp_cross"),
    [
        (Layout(sp=8, pp=4, dp=1), False, (True, True, True), False),  # one stage per node
        (Layout(sp=2, pp=4, dp=1), False, (False, False, False), False),  # the whole pipeline in one node
        (Layout(sp=2, pp=2, dp=4), False, (True,), False),  # pp outermost: stage 1 is on the next node
        (Layout(sp=1, pp=1, dp=16), False, (), True),
        (Layout(sp=4, pp=8, dp=1), False, (False, True, False, True, False, True, False), False),
    ],
)
def test_placement(layout, sp_cross, boundaries, fsdp_cross):
    where = placement(layout, gpus_per_node=8)
    assert where.sp_cross_node == sp_cross
    assert where.boundary_cross_node == boundaries
    assert where.fsdp_cross_node == fsdp_cross
    assert where.pp_cross_node == any(boundaries)


def test_subsequence_counts_keep_2k_to_16k_tokens_per_device():
    counts = subsequence_counts(2**20, sp=8, granularity=1024)
    assert counts[0] == 8 and counts[-1] == 64  # 1M / 8 ranks: 16K .. 2K tokens each
    assert counts == sorted(set(counts)) and len(counts) == 13  # four steps per doubling
    assert subsequence_counts(4096, sp=4, granularity=512) == [1]  # 1K per device: one subsequence
