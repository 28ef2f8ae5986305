"""dry_run: symbolic execution of lowered schedules, with deadlocks and mismatches as negative controls."""

import pytest

from lightning_sppo.schedule import ScheduleDeadlock, build_schedule, dry_run, lower, simulate, validate_schedule
from tests.schedule.conftest import parse

# Valid on each rank, but rank 0 waits for B0.0 before it forwards micro-batch 1, while rank 1
# forwards micro-batch 1 before it runs B0.0: each waits on the other.
CROSSED = parse("F0.0 B0.0 F1.0 B1.0", "F0.0 F1.0 B0.0 B1.0")


def test_lowered_schedules_run_through():
    assert dry_run(lower(build_schedule("seq1f1b", pp=4, num_subsequences=4, num_microbatches=3))) is None


def test_crossed_ranks_deadlock_and_every_stuck_rank_is_named():
    validate_schedule(CROSSED, pp=2, num_subsequences=1, num_microbatches=2)  # per-rank rules can't see it
    with pytest.raises(ScheduleDeadlock) as error:
        dry_run(lower(CROSSED))
    message = str(error.value)
    assert "rank 0 at position 2 waits on RECV_B0.0@1: rank 1 has not issued SEND_B0.0@0" in message
    assert "rank 1 at position 2 waits on RECV_F1.0@0: rank 0 has not issued SEND_F1.0@1" in message
    assert "rank 1 | " in message
    assert isinstance(error.value, RuntimeError)


def test_simulator_also_reports_the_deadlock():
    with pytest.raises(ScheduleDeadlock, match=r"rank 0 at position 1: B0\.0 waits on B0\.0 on rank 1"):
        simulate(CROSSED, {"F": 1.0, "B": 1.0})


def test_deadlock_on_a_recv_that_comes_too_early():
    # rank 1 receives micro-batch 1 before micro-batch 0, and rank 0 sends 1 only after 0's backward.
    lowered = parse(
        "F0.0 SEND_F0.0@1 RECV_B0.0@1 B0.0 F1.0 SEND_F1.0@1 RECV_B1.0@1 B1.0",
        "RECV_F1.0@0 F1.0 RECV_F0.0@0 F0.0 B0.0 SEND_B0.0@0 B1.0 SEND_B1.0@0",
    )
    with pytest.raises(ScheduleDeadlock, match=r"rank 1 at position 0 waits on RECV_F1\.0@0"):
        dry_run(lowered)


def test_send_without_recv_is_reported():
    lowered = lower(build_schedule("gpipe", pp=2, num_subsequences=2))
    lowered[1].remove(parse("RECV_F0.1@0")[0][0])
    lowered[1].remove(parse("F0.1")[0][0])  # keep the rank's inputs consistent; only the RECV is missing
    with pytest.raises(
        ValueError, match=r"F0\.1 from rank 0 to rank 1: 1 SEND \[rank 0 position 3 \(SEND_F0\.1@1\)\] vs 0 RECV"
    ):
        dry_run(lowered)


def test_recv_without_send_is_reported():
    lowered = parse("F0.0 RECV_B0.0@1 B0.0", "RECV_F0.0@0 F0.0 B0.0 SEND_B0.0@0")
    with pytest.raises(ValueError, match=r"F0\.0 from rank 0 to rank 1: 0 SEND \[none\] vs 1 RECV"):
        dry_run(lowered)


def test_compute_only_lists_are_rejected_with_a_hint():
    with pytest.raises(ValueError, match=r"rank 0, position 1, action B0\.0: needs RECV_B0\.0 earlier.*lower\(\)"):
        dry_run(build_schedule("gpipe", pp=2, num_subsequences=1))


def test_send_before_its_compute_is_rejected():
    lowered = parse("SEND_F0.0@1 F0.0 RECV_B0.0@1 B0.0", "RECV_F0.0@0 F0.0 B0.0 SEND_B0.0@0")
    with pytest.raises(ValueError, match=r"rank 0, position 0, action SEND_F0\.0@1: needs F0\.0 earlier"):
        dry_run(lowered)


def test_peer_outside_the_pipeline_is_rejected():
    with pytest.raises(ValueError, match=r"SEND_F0\.0@5 has peer=5"):
        dry_run(parse("F0.0 SEND_F0.0@5", "RECV_F0.0@0 F0.0"))


def test_hand_written_comms_default_to_the_neighbour():
    dry_run(parse("F0.0 SEND_F0.0 RECV_B0.0 B0.0", "RECV_F0.0 F0.0 B0.0 SEND_B0.0"))
