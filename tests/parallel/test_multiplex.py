"""Blocks and K/V groups of a shared unit (the runtime is tested across processes in tests/distributed)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_sppo.parallel.multiplex import block_lengths, group_split, row_ranges, team_tasks


@given(units=st.integers(1, 200), members=st.integers(1, 8), granularity=st.integers(1, 4))
def test_blocks_cover_the_subsequence_evenly(units, members, granularity):
    if units < members:
        with pytest.raises(ValueError, match="cannot be shared by"):
            block_lengths(units * granularity, members, granularity)
        return
    lengths = block_lengths(units * granularity, members, granularity)
    assert sum(lengths) == units * granularity and len(lengths) == members
    assert all(n % granularity == 0 and n > 0 for n in lengths)
    assert max(lengths) - min(lengths) <= granularity


def test_too_short_names_the_settings():
    with pytest.raises(ValueError, match=r"3 tokens cannot be shared by 4 ranks.*num_subsequences.*schedule='seq1f1b'"):
        block_lengths(3, 4, 1)


@given(groups=st.integers(1, 16), members=st.integers(1, 8), data=st.data())
def test_group_split_is_even_with_the_remainder_on_the_owner_first(groups, members, data):
    owner = data.draw(st.integers(0, members - 1))
    split = group_split(groups, members, owner)
    assert sum(split) == groups and len(split) == members
    assert max(split) - min(split) <= 1
    assert split[owner] == max(split)


def _cost(offset: int, a: int, e: int) -> int:
    """Keys attended by the rows [a, e) of a unit at ``offset``, causal: sum of offset + t + 1."""
    return sum(offset + t + 1 for t in range(a, e))


@given(offset=st.integers(0, 5000), length=st.integers(1, 300), members=st.integers(1, 8))
def test_row_ranges_tile_the_rows_at_equal_causal_cost(offset, length, members):
    if members > length:
        with pytest.raises(ValueError, match="query rows cannot be split.*num_subsequences"):
            row_ranges(offset, length, members)
        return
    ranges = row_ranges(offset, length, members)
    assert ranges[0][0] == 0 and ranges[-1][1] == length and all(a < e for a, e in ranges)
    assert all(ranges[k][1] == ranges[k + 1][0] for k in range(members - 1))
    costs = [_cost(offset, a, e) for a, e in ranges]
    row = offset + length  # the dearest row's cost: no cut is off by more than a row or two
    if length >= 4 * members:
        assert max(costs) - min(costs) <= 2 * row, (ranges, costs)


def test_first_unit_rows_are_cut_by_cost_not_count():
    assert row_ranges(0, 100, 2) == [(0, 71), (71, 100)]  # the later rows attend more keys
    assert row_ranges(10_000, 100, 2) == [(0, 50), (50, 100)]  # behind a long prefix nearly even


@given(groups=st.integers(1, 8), members=st.integers(2, 16), data=st.data())
def test_team_tasks_give_every_member_rows_of_one_group(groups, members, data):
    if groups >= members:
        return
    owner = data.draw(st.integers(0, members - 1))
    tasks = team_tasks(groups, members, owner, 64, 40)
    assert tasks[owner][0] == 0 and tasks[owner][2] == 0  # the owner leads the first group's team
    assert all(g1 == g0 + 1 for g0, g1, _, _ in tasks)
    for group in range(groups):  # every team's members tile the rows of its group
        rows = sorted((a, e) for g0, _, a, e in tasks if g0 == group)
        assert members // groups <= len(rows) <= members // groups + 1
        assert rows[0][0] == 0 and rows[-1][1] == 40 and all(rows[k][1] == rows[k + 1][0] for k in range(len(rows) - 1))
