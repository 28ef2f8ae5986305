"""simulate: the SPPO paper's formula, peak activations, and dependencies in the timeline."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo.schedule import SCHEDULES, Op, build_schedule, lower, simulate
from tests.schedule.conftest import sizes

PLAIN = ["gpipe", "seq1f1b"]  # one stage per rank, no shared units: the textbook formulas hold
costs_fb = st.tuples(st.integers(1, 5), st.integers(1, 5)).map(lambda fb: (fb[0] / 2, fb[1] / 2))


@settings(deadline=None)
@given(name=st.sampled_from(PLAIN), size=sizes(max_m=1), fb=costs_fb)
def test_one_microbatch_matches_sppo_section_3_3(name, size, fb):
    """T = (p-1+N)/N * F(N) with F(N) = N(f+b) one sequence's work per stage; bubble ratio (p-1)/N."""
    (pp, n, _), (f, b) = size, fb
    result = simulate(build_schedule(name, pp, n), {"F": f, "B": b})
    assert result.makespan == pytest.approx((pp - 1 + n) / n * n * (f + b))
    assert result.bubble_ratio == pytest.approx((pp - 1) / n)
    assert result.busy == pytest.approx([n * (f + b)] * pp)


@settings(deadline=None)
@given(name=st.sampled_from(PLAIN), size=sizes(max_pp=6, max_n=8), fb=costs_fb)
def test_uniform_costs_give_p_minus_1_bubbles_over_all_units(name, size, fb):
    """With uniform costs both schedules take (p-1+MN)(f+b): M micro-batches of N units act like MN units."""
    (pp, n, m), (f, b) = size, fb
    result = simulate(build_schedule(name, pp, n, m), {"F": f, "B": b})
    assert result.makespan == pytest.approx((pp - 1 + m * n) * (f + b))
    assert result.bubble_ratio == pytest.approx((pp - 1) / (m * n))


@pytest.mark.parametrize(("m", "gpipe", "seq1f1b"), [(1, [8] * 4, [8] * 4), (2, [16] * 4, [11, 10, 9, 8])])
def test_peak_live_activations_pp4_n8(m, gpipe, seq1f1b):
    assert simulate(build_schedule("gpipe", 4, 8, m), {"F": 1, "B": 2}).peak_live_activations == gpipe
    assert simulate(build_schedule("seq1f1b", 4, 8, m), {"F": 1, "B": 2}).peak_live_activations == seq1f1b


@given(size=sizes())
def test_peak_live_activations_formula(size):
    """gpipe holds all M*N units; seq1f1b holds its warm-up plus the steady phase's forward: N + p-1-k."""
    pp, n, m = size
    gpipe = simulate(build_schedule("gpipe", pp, n, m), {"F": 1, "B": 1}).peak_live_activations
    seq = simulate(build_schedule("seq1f1b", pp, n, m), {"F": 1, "B": 1}).peak_live_activations
    assert gpipe == [m * n] * pp
    assert seq == [min(n + pp - 1 - k, m * n) for k in range(pp)]


def _stage_times(schedule, result):
    """(stage, op, mb, sub) -> (start, end) over every rank that runs a share of it."""
    times = {}
    for rank, actions in enumerate(schedule):
        for action, t0, t1 in zip(actions, result.start[rank], result.end[rank], strict=True):
            key = (action.owner(rank), action.op, action.microbatch, action.subsequence)
            old = times.get(key, (t0, t1))
            times[key] = (min(old[0], t0), max(old[1], t1))
    return times


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULES)), size=sizes(max_pp=6, max_n=8), seed=st.integers(0, 2**16))
def test_timeline_respects_every_dependency(name, size, seed):
    pp, n, m = size
    schedule = build_schedule(name, pp, n, m)
    rng = random.Random(seed)
    table = {(r, a): rng.uniform(0.1, 3.0) for r, actions in enumerate(schedule) for a in actions}
    result = simulate(schedule, lambda rank, action: table[(rank, action)])
    times = _stage_times(schedule, result)

    def start(k, op, mb, sub):
        return times[(k, op, mb, sub)][0]

    def end(k, op, mb, sub):
        return times[(k, op, mb, sub)][1]

    for r in range(pp):
        assert all(e1 <= s2 + 1e-12 for e1, s2 in zip(result.end[r], result.start[r][1:], strict=False))  # no overlap
        for mb in range(m):
            for sub in range(n):
                if r > 0:
                    assert start(r, Op.F, mb, sub) >= end(r - 1, Op.F, mb, sub)
                if r < pp - 1:
                    assert start(r, Op.B, mb, sub) >= end(r + 1, Op.B, mb, sub)
                if sub < n - 1:
                    assert start(r, Op.B, mb, sub) >= end(r, Op.B, mb, sub + 1)
                assert start(r, Op.B, mb, sub) >= end(r, Op.F, mb, sub)
    for rank, actions in enumerate(schedule):  # a shared action starts at once on its whole group
        for position, action in enumerate(actions):
            if action.multiplexed:
                assert result.start[rank][position] == start(action.stage, action.op, *action.unit)
    assert result.makespan == max(max(row) for row in result.end)


def test_lowered_schedule_times_like_compute_only_when_communication_is_free():
    schedule = build_schedule("seq1f1b", 4, 4, 2)
    compute, lowered = simulate(schedule, {"F": 1, "B": 2}), simulate(lower(schedule), {"F": 1, "B": 2})
    assert lowered.makespan == compute.makespan and lowered.busy == compute.busy
    assert lowered.peak_live_activations == compute.peak_live_activations


def test_communication_costs_count_when_given():
    schedule = lower(build_schedule("gpipe", 2, 1))
    result = simulate(schedule, {"F": 1, "B": 2, "SEND_F": 0.5, "SEND_B": 0.25})
    # F0 (1) + SEND_F (0.5) on rank 0, then F (1), B (2) on rank 1, SEND_B (0.25), then B (2) on rank 0
    assert result.makespan == pytest.approx(6.75)
    assert result.start[0] == pytest.approx([0, 1, 4.75, 4.75])


@pytest.mark.parametrize(
    ("costs", "error", "message"),
    [
        ({"F": 1.0}, ValueError, r"lacks \['B'\]"),
        ({"F": 1.0, "B": 1.0, "W": 1.0}, ValueError, r"unknown ops \['W'\]"),
        ({"F": -1.0, "B": 1.0}, ValueError, r"costs gave -1\.0 for rank 0, action F0\.0; .* >= 0"),
        (lambda rank, action: float("nan"), ValueError, r"costs gave nan"),
        (3.0, TypeError, r"costs must be a mapping"),
    ],
)
def test_bad_costs_are_rejected(costs, error, message):
    with pytest.raises(error, match=message):
        simulate(build_schedule("gpipe", 1, 1), costs)


def test_op_keys_work_like_strings():
    schedule = build_schedule("seq1f1b", 2, 2, 2)
    assert simulate(schedule, {Op.F: 1, Op.B: 2}) == simulate(schedule, {"F": 1, "B": 2})
