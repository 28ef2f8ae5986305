"""Candidate layouts and where their ranks land (the runtime's (pp, dp, sp) mesh, consecutive ranks per node)."""

from __future__ import annotations

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.planner import Layout, candidate_layouts, subsequence_counts
from lightning_sppo.planner.layout import placement


def test_candidates_keep_sp_groups_on_whole_nodes_and_dividing_heads():
    config = GPTConfig.from_name("gpt-13b")  # 40 heads: sp in {1, 2, 4, 5, 8, 10, 20, 40}
    layouts = candidate_layouts(config, world_size=64, gpus_per_node=8)
    assert {layout.sp for layout in layouts} == {1, 2, 4, 8}  # 5 straddles a node, 16 does not divide the heads
    assert all(layout.world_size == 64 and layout.pp <= config.n_layer for layout in layouts)
    assert Layout(8, 8, 1) in layouts
    # GPT-65B (64 heads), the SPPO paper's SP=16: a group of two whole nodes is a candidate, 12 is not.
    big = candidate_layouts(GPTConfig.from_name("gpt-65b"), world_size=128, gpus_per_node=8)
    assert {layout.sp for layout in big} == {1, 2, 4, 8, 16, 32, 64}
    assert Layout(16, 8, 1) in big and placement(Layout(16, 8, 1), 8).sp_cross_node


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


def test_subsequence_counts_are_round_values_between_the_bounds():
    counts = subsequence_counts(2**20, sp=8, granularity=1024, min_tokens=512)
    assert counts[0] == 8 and counts[-1] == 256  # 1M / 8 ranks: 16K .. 512 tokens each
    assert counts == sorted(set(counts)) and 100 not in counts  # four round values per doubling
    assert {32, 48, 64, 80, 96, 128, 160} <= set(counts)  # every N of the SPPO paper's Table 4
    assert subsequence_counts(2**20, sp=8, granularity=1024)[-1] == 1024  # default: down to one granule each
    assert subsequence_counts(4096, sp=4, granularity=512, min_tokens=2048) == [1]  # 1K per device: one
    assert subsequence_counts(9 * 2**14, sp=1, granularity=128, min_tokens=2**12) == [9, 10, 12, 14, 16, 20, 24, 28, 32]
