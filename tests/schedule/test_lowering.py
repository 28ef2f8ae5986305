"""lower: communication ops around compute ops that cross a stage boundary."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo.schedule import SCHEDULES, build_schedule, lower
from tests.schedule.conftest import compute_only, parse, sizes


def test_three_stage_lowering_by_hand():
    assert lower(build_schedule("gpipe", pp=3, num_subsequences=1)) == parse(
        "F0.0 SEND_F0.0@1 RECV_B0.0@1 B0.0",
        "RECV_F0.0@0 F0.0 SEND_F0.0@2 RECV_B0.0@2 B0.0 SEND_B0.0@0",
        "RECV_F0.0@1 F0.0 B0.0 SEND_B0.0@1",
    )


def test_single_stage_needs_no_communication():
    schedule = build_schedule("seq1f1b", pp=1, num_subsequences=3, num_microbatches=2)
    assert lower(schedule) == schedule


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULES)), size=sizes(max_pp=6, max_n=8))
def test_lowering_keeps_compute_order_and_pairs_every_send(name, size):
    schedule = build_schedule(name, *size)
    lowered = lower(schedule)
    assert compute_only(lowered) == schedule
    pp = size[0]
    # Per boundary, as many SEND_F on k as RECV_F on k+1, and as many SEND_B on k+1 as RECV_B on k.
    for k in range(pp - 1):
        ops = [[str(a.op) for a in lowered[r]] for r in (k, k + 1)]
        assert ops[0].count("SEND_F") == ops[1].count("RECV_F") == ops[1].count("SEND_B") == ops[0].count("RECV_B")


def test_lowering_rejects_lowered_input():
    with pytest.raises(ValueError, match=r"rank 0, position 1: action SEND_F0\.0@1 is already a communication op"):
        lower(lower(build_schedule("gpipe", pp=2, num_subsequences=1)))
