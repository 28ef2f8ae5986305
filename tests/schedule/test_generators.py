"""Schedule generators: exact small cases, the paper's warm-up rule, and the guarantees for every size."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo.schedule import (
    SCHEDULES,
    Op,
    build_schedule,
    dry_run,
    forward_only,
    lower,
    seq1f1b_warmup,
    validate_schedule,
)
from tests.schedule.conftest import parse, sizes


def test_gpipe_runs_all_forwards_then_backwards_last_subsequence_first():
    expected = "F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 B1.1 B1.0"
    assert build_schedule("gpipe", pp=2, num_subsequences=2, num_microbatches=2) == parse(expected, expected)


def test_forward_only_lowers_to_a_stream_of_forwards_by_hand():
    """Evaluation: forwards in order on every rank, each handed to the next stage right after it runs."""
    assert lower(forward_only(pp=2, num_subsequences=2, num_microbatches=1)) == parse(
        "F0.0 SEND_F0.0@1 F0.1 SEND_F0.1@1",
        "RECV_F0.0@0 F0.0 RECV_F0.1@0 F0.1",
    )


@settings(max_examples=30, deadline=None)
@given(sizes())
def test_forward_only_runs_every_forward_once_without_deadlock(size):
    pp, n, m = size
    lowered = lower(forward_only(pp, n, m))
    dry_run(lowered)
    for actions in lowered:
        assert not any(a.op in (Op.B, Op.SEND_B, Op.RECV_B) for a in actions)
        assert [a.unit for a in actions if a.op == Op.F] == [(mb, sub) for mb in range(m) for sub in range(n)]


def test_seq1f1b_small_case_by_hand():
    # Warm-up (Eq. 4): rank 0 runs P-0-2+k = 2 forwards, rank 1 runs 1; then one F per B.
    assert build_schedule("seq1f1b", pp=2, num_subsequences=2, num_microbatches=2) == parse(
        "F0.0 F0.1 F1.0 B0.1 F1.1 B0.0 B1.1 B1.0",
        "F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 B1.0",
    )


@pytest.mark.parametrize(("pp", "n", "m"), [(4, 8, 2), (4, 4, 8), (8, 3, 4), (3, 16, 4)])
def test_seq1f1b_warmup_follows_eq4(pp, n, m):
    schedule = build_schedule("seq1f1b", pp, n, m)
    for rank, actions in enumerate(schedule):
        warmup = seq1f1b_warmup(rank, pp, n, m)
        assert warmup == min(pp - rank - 2 + n, n * m)
        first_backward = next(i for i, a in enumerate(actions) if a.op == Op.B)
        # The steady phase opens with one more forward, then the last subsequence of micro-batch 0.
        assert first_backward == min(warmup + 1, n * m)
        assert str(actions[first_backward]) == f"B0.{n - 1}"
    # "each stage performs one more forward pass than the subsequent stage" (while uncapped)
    uncapped = [seq1f1b_warmup(r, pp, n, m) for r in range(pp) if pp - r - 2 + n <= n * m]
    assert all(a - b == 1 for a, b in zip(uncapped, uncapped[1:], strict=False))


def test_seq1f1b_with_one_subsequence_is_1f1b():
    pp, m = 4, 6
    assert [seq1f1b_warmup(r, pp, 1, m) for r in range(pp)] == [3, 2, 1, 0]  # P - i - 1
    assert [str(a) for a in build_schedule("seq1f1b", pp, 1, m)[pp - 1][:4]] == ["F0.0", "B0.0", "F1.0", "B1.0"]


@given(sizes(max_m=1))
def test_seq1f1b_with_one_microbatch_is_gpipe(size):
    # LIFO backward needs the last subsequence's forward first, so nothing can interleave.
    assert build_schedule("seq1f1b", *size) == build_schedule("gpipe", *size)


@pytest.mark.parametrize("pp", range(1, 9))
def test_seq1f1b_is_valid_and_deadlock_free_for_every_size(pp):
    """The guarantee the runtime relies on: pp 1..8, N 1..16, M 1..4, every combination."""
    for n in range(1, 17):
        for m in range(1, 5):
            schedule = build_schedule("seq1f1b", pp, n, m)
            validate_schedule(schedule, pp, n, m)
            dry_run(lower(schedule))


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULES)), size=sizes())
def test_every_action_exactly_once_per_rank(name, size):
    pp, n, m = size
    schedule = build_schedule(name, pp, n, m)
    expected = Counter(f"{op}{mb}.{sub}" for op in "FB" for mb in range(m) for sub in range(n))
    assert len(schedule) == pp
    for rank, actions in enumerate(schedule):  # its own stage's units, some shared with helpers ("sppo")
        assert Counter(str(a.plain()) for a in actions if a.owner(rank) == rank) == expected
    validate_schedule(schedule, pp, n, m)
    dry_run(lower(schedule))


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"name='1f1b'.*gpipe, seq1f1b, sppo"):
        build_schedule("1f1b", 2, 2)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        (dict(pp=0, num_subsequences=2), "pp"),
        (dict(pp=2, num_subsequences=-1), "num_subsequences"),
        (dict(pp=2, num_subsequences=2, num_microbatches=1.5), "num_microbatches"),
        (dict(pp=True, num_subsequences=2), "pp"),
        (dict(pp="2", num_subsequences=2), "pp"),
    ],
)
def test_bad_sizes_name_the_argument(kwargs, setting):
    with pytest.raises(ValueError, match=rf"{setting} must be an integer >= 1, got {setting}="):
        build_schedule("seq1f1b", **kwargs)


def test_registry_accepts_new_schedules(monkeypatch):
    def reversed_gpipe(pp, n, m):
        return [list(reversed(actions)) for actions in SCHEDULES["gpipe"](pp, n, m)]

    monkeypatch.setitem(SCHEDULES, "reversed", reversed_gpipe)
    assert build_schedule("reversed", 1, 1) == parse("B0.0 F0.0")


@given(sizes())
def test_seq1f1b_has_the_1f1b_shape(size):
    """Warm-up forwards, then strict F/B pairs, then cool-down backwards: Eq. 4's warm-up never needs
    an extra forward to make the LIFO backward available."""
    pp, n, m = size
    for rank, actions in enumerate(build_schedule("seq1f1b", pp, n, m)):
        w = seq1f1b_warmup(rank, pp, n, m)
        assert "".join(str(a.op) for a in actions) == "F" * w + "FB" * (n * m - w) + "B" * w
