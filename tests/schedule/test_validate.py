"""validate_schedule: per-rank rules, with hand-broken schedules as negative controls."""

import pytest

from lightning_sppo.schedule import build_schedule, lower, validate_schedule
from tests.schedule.conftest import parse

VALID = ("F0.0 F0.1 F0.2 B0.2 B0.1 B0.0", "F0.0 F0.1 F0.2 B0.2 B0.1 B0.0")


def test_valid_schedule_passes_compute_only_and_lowered():
    schedule = parse(*VALID)
    validate_schedule(schedule, pp=2, num_subsequences=3, num_microbatches=1)
    validate_schedule(lower(schedule), pp=2, num_subsequences=3, num_microbatches=1)


@pytest.mark.parametrize(
    ("rank1", "message"),
    [
        # swapped backwards: the K/V gradient cache needs last-first
        ("F0.0 F0.1 F0.2 B0.2 B0.0 B0.1", r"rank 1, position 4, action B0\.0: B before B0\.1: .*last-first"),
        # dropped action
        ("F0.0 F0.1 F0.2 B0.2 B0.1", r"rank 1, end of list: missing B0\.0"),
        # duplicated action
        ("F0.0 F0.1 F0.2 B0.2 B0.2 B0.1 B0.0", r"rank 1, position 4, action B0\.2: duplicate of position 3"),
        # forwards out of subsequence order
        ("F0.1 F0.0 F0.2 B0.2 B0.1 B0.0", r"rank 1, position 0, action F0\.1: F before F0\.0"),
        # backward before its own forward
        ("F0.0 F0.1 B0.2 F0.2 B0.1 B0.0", r"rank 1, position 2, action B0\.2: B before its own forward F0\.2"),
        # unit outside the sizes
        ("F0.0 F0.1 F0.2 F1.0 B0.2 B0.1 B0.0", r"rank 1, position 3, action F1\.0: out of range.*num_microbatches=1"),
    ],
    ids=["swapped-backwards", "dropped", "duplicated", "forward-order", "backward-before-forward", "out-of-range"],
)
def test_broken_rank_is_reported_with_rank_position_action_and_rule(rank1, message):
    schedule = parse(VALID[0], rank1)
    with pytest.raises(ValueError, match=message) as error:
        validate_schedule(schedule, pp=2, num_subsequences=3, num_microbatches=1)
    assert "rank 1 | " in str(error.value)  # the grid comes with the message


def test_broken_seq1f1b_is_caught():
    schedule = build_schedule("seq1f1b", pp=4, num_subsequences=4, num_microbatches=2)
    actions = schedule[2]
    i, j = actions.index(parse("B1.3")[0][0]), actions.index(parse("B1.2")[0][0])
    actions[i], actions[j] = actions[j], actions[i]
    with pytest.raises(ValueError, match=rf"rank 2, position {i}, action B1\.2: B before B1\.3"):
        validate_schedule(schedule, 4, 4, 2)


def test_wrong_number_of_ranks():
    with pytest.raises(ValueError, match=r"2 rank lists, expected one per rank: pp=3"):
        validate_schedule(parse(*VALID), pp=3, num_subsequences=3, num_microbatches=1)
