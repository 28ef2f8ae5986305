"""Step time of a candidate: a closed form to rank many, the schedule simulator to report the few.

Closed form (SPPO section 3.3): with p stages and N subsequences, T = (p - 1 + N) / N * F(N), where F(N)
is the busiest stage's forward and backward time over all N subsequences. The simulator times the very
action lists the runtime executes (``build_schedule("seq1f1b", pp, N)``, one micro-batch) with every
action's predicted cost, so uneven stages, the head on the last stage, exposed copies and exposed FSDP
traffic (``planner.costs``; part of the actions that carry it) show up.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sppo.planner.evaluate import Evaluation, StagePlan
from lightning_sppo.schedule import Action, Op, build_schedule, simulate

__all__ = ["SCHEDULE", "StepTime", "TimeBreakdown", "estimate_step_time", "simulate_step_time"]

SCHEDULE = "seq1f1b"


@dataclass(frozen=True)
class TimeBreakdown:
    """Where the busiest stage's step goes (seconds); the parts sum to the step time."""

    compute: float
    all_to_all: float
    p2p: float
    offload_wait: float
    idle: float
    """Pipeline bubbles: the step's makespan minus the busiest stage's own work."""
    sync: float
    """FSDP all-gather and reduce-scatter that the passes could not hide."""

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class StepTime:
    step_s: float
    bubble_ratio: float
    """(makespan - mean busy) / mean busy, as the simulator defines it; (p - 1) / N when stages are even."""
    breakdown: TimeBreakdown


def estimate_step_time(evaluation: Evaluation) -> float:
    """T = (p - 1 + N) / N * F(N) for the busiest stage."""
    p, n = evaluation.layout.pp, evaluation.num_subsequences
    busiest = max(evaluation.stages, key=_busy)
    return (p - 1 + n) / n * _busy(busiest)


def simulate_step_time(evaluation: Evaluation) -> StepTime:
    """Simulate the seq1f1b schedule with per-action costs from the evaluation."""
    n = evaluation.num_subsequences
    forward = [stage.forward_s for stage in evaluation.stages]
    backward = [stage.backward_s for stage in evaluation.stages]

    def cost(rank: int, action: Action) -> float:
        return (forward if action.op == Op.F else backward)[rank][action.subsequence]

    result = simulate(build_schedule(SCHEDULE, evaluation.layout.pp, n, 1), cost)
    busiest = max(evaluation.stages, key=_busy)
    return StepTime(result.makespan, result.bubble_ratio, _breakdown(busiest, result.makespan))


def _busy(stage: StagePlan) -> float:
    return sum(stage.forward_s) + sum(stage.backward_s)


def _breakdown(stage: StagePlan, makespan: float) -> TimeBreakdown:
    passes = [*stage.forward, *stage.backward]
    waits = sum(stage.offload.forward_wait) + sum(stage.offload.backward_wait)
    return TimeBreakdown(
        compute=sum(t.compute for t in passes),
        all_to_all=sum(t.all_to_all for t in passes),
        p2p=sum(t.p2p for t in passes),
        offload_wait=waits,
        idle=max(0.0, makespan - _busy(stage)),
        sync=sum(t.fsdp for t in passes),
    )
