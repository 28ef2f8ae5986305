"""Multiplexed sequence partitioning phases: Table 3 of the SPPO paper, and properties for other sizes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_sppo.schedule import msp_phases

# Table 3 of the SPPO paper (PP = 4 stages, N = 8 subsequences), transcribed column by column:
#   Component          Stage 0        Stage 1        Stage 2        Stage 3
#   Left Seq. IDs      {0,1,2}        {0,1}          {0}            {}
#   Steady Seq. IDs    {3,4,5,6,7}    {2,3,4,5,6}    {1,2,3,4,5}    {0,1,2,3,4}
#   Right Seq. IDs     {}             {7}            {6,7}          {5,6,7}
#   Left SP Range      {0,1,2,3}      {1,2,3}        {2,3}          {}
#   Right SP Range     {}             {0,1}          {0,1,2}        {0,1,2,3}
TABLE_3 = [
    {"left": {0, 1, 2}, "steady": {3, 4, 5, 6, 7}, "right": set(), "left_ranks": {0, 1, 2, 3}, "right_ranks": set()},
    {"left": {0, 1}, "steady": {2, 3, 4, 5, 6}, "right": {7}, "left_ranks": {1, 2, 3}, "right_ranks": {0, 1}},
    {"left": {0}, "steady": {1, 2, 3, 4, 5}, "right": {6, 7}, "left_ranks": {2, 3}, "right_ranks": {0, 1, 2}},
    {"left": set(), "steady": {0, 1, 2, 3, 4}, "right": {5, 6, 7}, "left_ranks": set(), "right_ranks": {0, 1, 2, 3}},
]


def test_reproduces_table_3():
    assert msp_phases(4, 8) == TABLE_3


sizes = st.integers(1, 12).flatmap(lambda pp: st.tuples(st.just(pp), st.integers(pp, 40)))


@given(sizes)
def test_phases_partition_the_subsequences(size):
    pp, n = size
    for phases in msp_phases(pp, n):
        parts = [phases["left"], phases["steady"], phases["right"]]
        assert set().union(*parts) == set(range(n))
        assert sum(len(part) for part in parts) == n  # disjoint


@given(sizes)
def test_phase_sizes_and_order(size):
    """Stage i borrows PP-1-i subsequences in warm-up and i in cool-down; the steady phase keeps N-PP+1."""
    pp, n = size
    for i, phases in enumerate(msp_phases(pp, n)):
        assert len(phases["left"]) == pp - 1 - i
        assert len(phases["right"]) == i
        assert len(phases["steady"]) == n - pp + 1
        ordered = [*sorted(phases["left"]), *sorted(phases["steady"]), *sorted(phases["right"])]
        assert ordered == list(range(n))  # contiguous: left ids first, right ids last


@given(sizes)
def test_rank_sets(size):
    """Left-SP is shared with the later stages i..PP-1, Right-SP with the earlier ones 0..i; empty phase, no ranks."""
    pp, n = size
    for i, phases in enumerate(msp_phases(pp, n)):
        assert phases["left_ranks"] == (set(range(i, pp)) if phases["left"] else set())
        assert phases["right_ranks"] == (set(range(i + 1)) if phases["right"] else set())
        assert all(0 <= rank < pp for rank in phases["left_ranks"] | phases["right_ranks"])


def test_one_stage_is_all_steady():
    assert msp_phases(1, 3) == [{"left": set(), "steady": {0, 1, 2}, "right": set(), "left_ranks": set(),
                                 "right_ranks": set()}]  # fmt: skip


def test_fewer_subsequences_than_stages_is_an_error():
    with pytest.raises(ValueError, match=r"num_subsequences >= pp.*num_subsequences=3 < pp=4.*num_subsequences>=4"):
        msp_phases(4, 3)


@pytest.mark.parametrize(
    ("pp", "n", "name"), [(0, 8, "pp"), (4, 0, "num_subsequences"), (True, 8, "pp"), (4, 8.0, "num_subsequences")]
)
def test_bad_sizes_name_the_argument(pp, n, name):
    with pytest.raises(ValueError, match=rf"{name} to be an integer >= 1"):
        msp_phases(pp, n)
