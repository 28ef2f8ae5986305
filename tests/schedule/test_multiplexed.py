"""The "sppo" schedule: multiplexed units where Table 3 puts them, valid, deadlock-free, and faster."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo.schedule import (
    Action,
    ScheduleDeadlock,
    build_schedule,
    dry_run,
    lower,
    msp_phases,
    simulate,
    validate_schedule,
)
from lightning_sppo.schedule.msp import multiplexed_groups
from tests.schedule.conftest import parse

costs_fb = st.tuples(st.integers(1, 6), st.integers(1, 6)).map(lambda fb: {"F": fb[0] / 2, "B": fb[1] / 2})


def _shared(schedule):
    """(stage, op, mb, sub) -> the ranks whose lists hold that shared action."""
    holders = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.multiplexed:
                holders.setdefault((a.stage, str(a.op), *a.unit), []).append(rank)
    return holders


def test_shared_units_follow_table_3():
    """pp=4, N=8: stage i shares its Left-SP ids with the ranks of its Left SP range, its Right-SP ids with
    its Right SP range, in forward and in backward; Steady units stay on the stage alone."""
    holders = _shared(build_schedule("sppo", 4, 8))
    expected = {}
    for stage, phase in enumerate(msp_phases(4, 8)):
        for side in ("left", "right"):
            for sub in phase[side]:
                for op in "FB":
                    expected[(stage, op, 0, sub)] = sorted(phase[f"{side}_ranks"])
    assert {key: sorted(ranks) for key, ranks in holders.items()} == expected


def test_action_strings_round_trip():
    action = Action.from_str("B1.3[2:0,1,2]")
    assert (action.stage, action.group, action.unit) == (2, (0, 1, 2), (1, 3))
    assert str(action) == "B1.3[2:0,1,2]" and action.owner(0) == 2 and action.plain() == Action.from_str("B1.3")
    assert Action.from_str("F0.1").owner(3) == 3


@settings(max_examples=80, deadline=None)
@given(pp=st.integers(2, 8), n=st.integers(1, 16), m=st.integers(1, 4), costs=costs_fb)
def test_uniform_costs_make_sppo_strictly_faster_than_seq1f1b(pp, n, m, costs):
    sppo = simulate(build_schedule("sppo", pp, n, m), costs)
    seq1f1b = simulate(build_schedule("seq1f1b", pp, n, m), costs)
    assert sppo.makespan < seq1f1b.makespan - 1e-9
    assert sum(sppo.busy) == pytest.approx(sum(seq1f1b.busy))  # work moves between ranks, none is dropped


@given(pp=st.integers(2, 6), n=st.integers(1, 12), m=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_sppo_is_valid_and_deadlock_free(pp, n, m):
    schedule = build_schedule("sppo", pp, n, m)
    validate_schedule(schedule, pp, n, m)
    validate_schedule(lower(schedule), pp, n, m)
    dry_run(lower(schedule))
    total = sum(a.share for actions in schedule for a in actions)
    assert total == pytest.approx(2 * pp * n * m)  # every unit's F and B exactly once, shards summing to one


def test_one_microbatch_bubble_shrinks_like_the_paper_says():
    """pp=4, N=8 with F=1, B=2: Seq1F1B idles (p-1)/N = 0.375 of the work; sharing the edges removes most of it."""
    seq1f1b = simulate(build_schedule("seq1f1b", 4, 8), {"F": 1, "B": 2})
    sppo = simulate(build_schedule("sppo", 4, 8), {"F": 1, "B": 2})
    assert seq1f1b.bubble_ratio == pytest.approx(0.375)
    assert sppo.bubble_ratio < 0.1


def test_pp1_has_nothing_to_share():
    assert build_schedule("sppo", 1, 4, 2) == build_schedule("seq1f1b", 1, 4, 2)
    assert multiplexed_groups(1, 4, 2) == {}


def test_lowering_talks_to_neighbours_on_the_owning_rank_only():
    lowered = lower(build_schedule("sppo", 2, 2))
    assert [str(a) for a in lowered[0]] == [
        "F0.0[0:0,1]", "SEND_F0.0@1", "F0.1", "SEND_F0.1@1", "F0.1[1:0,1]",
        "B0.1[1:0,1]", "RECV_B0.1@1", "B0.1", "RECV_B0.0@1", "B0.0[0:0,1]",
    ]  # fmt: skip
    assert [str(a) for a in lowered[1]] == [
        "F0.0[0:0,1]", "RECV_F0.0@0", "F0.0", "RECV_F0.1@0", "F0.1[1:0,1]",
        "B0.1[1:0,1]", "SEND_B0.1@0", "B0.0", "SEND_B0.0@0", "B0.0[0:0,1]",
    ]  # fmt: skip


def test_a_shared_action_missing_on_a_group_rank_is_refused():
    schedule = parse("F0.0[0:0,1] B0.0[0:0,1]", "F0.0 B0.0 B0.0[0:0,1]")
    with pytest.raises(ValueError, match=r"F0\.0\[0:0,1\] must appear exactly once on each rank of its group"):
        dry_run(lower(schedule))


def test_shared_actions_in_crossed_order_deadlock():
    """Negative control: two groups meeting in opposite orders on two ranks can never both start."""
    schedule = parse(
        "F0.0[0:0,1] F0.1[0:0,1] B0.1[0:0,1] B0.0[0:0,1]",
        "F0.1[0:0,1] F0.0[0:0,1] F0.0 F0.1 B0.1 B0.0 B0.1[0:0,1] B0.0[0:0,1]",
    )
    with pytest.raises(ScheduleDeadlock, match="waits on F0.1"):
        dry_run(lower(schedule))
