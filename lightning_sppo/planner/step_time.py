"""Step time of a candidate: a closed form to rank many, the schedule simulator to report the few.

Closed form (SPPO section 3.3): with p stages and N subsequences, T = (p - 1 + N) / N * F(N), where F(N)
is the busiest stage's forward and backward time over all N subsequences. The simulator times the very
action lists the runtime executes (``build_schedule(schedule, pp, N)``, one micro-batch) with every
action's predicted cost, so uneven stages, the head on the last stage, exposed copies and exposed FSDP
traffic (``planner.costs``; part of the actions that carry it) show up.

Under "sppo" the closed form's (p - 1 + N) / N is the schedule's own stretch at uniform costs
(``planner.multiplexed.uniform_stretch``), plus what the busiest stage's shared units cost beyond their share of
its work (their weight and K/V streams and all-to-alls, ``planner.multiplexed.shared_seconds``). In the simulator
each member of a shared unit is charged its own share (its tokens' matmuls, its heads' attention, the group's
traffic), the action lasting as long as its slowest member; the stage's own rank also pays the unit's P2P send.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sppo.planner.evaluate import Evaluation, StagePlan
from lightning_sppo.planner.multiplexed import SCHEDULE_NAME, rank_actions, uniform_stretch
from lightning_sppo.schedule import Action, Op, build_schedule, simulate

__all__ = ["StepTime", "TimeBreakdown", "estimate_step_time", "simulate_step_time"]


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
    shared: float = 0.0
    """"sppo": what shared units spend beyond their compute: streamed weights and K/V, the group's all-to-alls."""
    spill: float = 0.0
    """Copies of K/V spilled to host that the attention does not hide."""
    optimizer: float = 0.0
    """AdamW on the CPU when model state lives on host, after the last backward."""

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class StepTime:
    step_s: float
    bubble_ratio: float
    """(makespan - mean busy) / mean busy, as the simulator defines it; (p - 1) / N when stages are even."""
    breakdown: TimeBreakdown


def estimate_step_time(evaluation: Evaluation) -> float:
    """T = (p - 1 + N) / N * F(N) for the busiest stage (under "sppo": its own stretch, and the step sync)."""
    p, n = evaluation.layout.pp, evaluation.num_subsequences
    busiest = max(evaluation.stages, key=_busy)
    if _multiplexed(evaluation):
        extra = max(_shared_overhead(stage) for stage in evaluation.stages)
        return uniform_stretch(p, n) * _busy(busiest) + extra + evaluation.optimizer_s
    return (p - 1 + n) / n * _busy(busiest) + evaluation.optimizer_s


def _shared_overhead(stage: StagePlan) -> float:
    """Seconds a stage's shared units take beyond an even share of its own passes (slowest member each)."""
    slowest: dict[int, tuple[float, int]] = {}
    for (sub, _), times in (stage.shared or {}).items():
        total, members = slowest.get(sub, (0.0, 0))
        slowest[sub] = (max(total, times.forward + times.backward), members + 1)
    return sum(
        max(0.0, total - (stage.forward_s[sub] + stage.backward_s[sub]) / members)
        for sub, (total, members) in slowest.items()
    )


def simulate_step_time(evaluation: Evaluation) -> StepTime:
    """Simulate the evaluation's schedule with per-action costs from the evaluation."""
    if _multiplexed(evaluation):
        return _simulate_multiplexed(evaluation)
    n = evaluation.num_subsequences
    forward = [stage.forward_s for stage in evaluation.stages]
    backward = [stage.backward_s for stage in evaluation.stages]

    def cost(rank: int, action: Action) -> float:
        return (forward if action.op == Op.F else backward)[rank][action.subsequence]

    result = simulate(build_schedule(evaluation.schedule, evaluation.layout.pp, n, 1), cost)
    busiest = max(evaluation.stages, key=_busy)
    step = result.makespan + evaluation.optimizer_s
    return StepTime(step, result.bubble_ratio, _breakdown(busiest, result.makespan, evaluation.optimizer_s))


def _multiplexed(evaluation: Evaluation) -> bool:
    return evaluation.schedule == SCHEDULE_NAME and evaluation.layout.pp > 1


def _simulate_multiplexed(evaluation: Evaluation) -> StepTime:
    """The "sppo" action lists, each action's cost split into the ``TimeBreakdown`` parts."""
    pp, n = evaluation.layout.pp, evaluation.num_subsequences
    schedule = [list(rank_actions(pp, n, rank)) for rank in range(pp)]
    result = simulate(schedule, lambda rank, action: sum(_parts(evaluation, rank, action).values()))
    step = result.makespan
    busiest = max(range(pp), key=lambda rank: result.busy[rank])
    parts = {name: 0.0 for name in ("compute", "all_to_all", "p2p", "offload_wait", "sync", "shared")}
    for action in schedule[busiest]:
        for name, seconds in _parts(evaluation, busiest, action).items():
            parts[name] += seconds
    breakdown = TimeBreakdown(idle=max(0.0, step - sum(parts.values())), optimizer=evaluation.optimizer_s, **parts)
    return StepTime(step + evaluation.optimizer_s, result.bubble_ratio, breakdown)


def _parts(evaluation: Evaluation, rank: int, action: Action) -> dict[str, float]:
    """One action's seconds on ``rank`` by kind; a shard pays its share of the owner stage's work."""
    owner = evaluation.stages[action.owner(rank)]
    forward = action.op == Op.F
    times = (owner.forward if forward else owner.backward)[action.subsequence]
    if not action.multiplexed:
        waits = owner.offload.forward_wait if forward else owner.offload.backward_wait
        return {
            "compute": times.compute, "all_to_all": times.all_to_all, "p2p": times.p2p,
            "offload_wait": waits[action.subsequence], "sync": times.fsdp, "shared": 0.0,
        }  # fmt: skip
    share = owner.shared[(action.subsequence, rank)]
    total, compute = (share.forward, share.forward_compute) if forward else (share.backward, share.backward_compute)
    mine = rank == action.stage  # the stage's own rank sends the unit on
    return {
        "compute": compute, "all_to_all": 0.0, "p2p": times.p2p * mine, "offload_wait": 0.0, "sync": 0.0,
        "shared": total - compute,
    }  # fmt: skip


def _busy(stage: StagePlan) -> float:
    return sum(stage.forward_s) + sum(stage.backward_s)


def _breakdown(stage: StagePlan, makespan: float, optimizer: float) -> TimeBreakdown:
    passes = [*stage.forward, *stage.backward]
    waits = sum(stage.offload.forward_wait) + sum(stage.offload.backward_wait)
    return TimeBreakdown(
        compute=sum(t.compute for t in passes),
        all_to_all=sum(t.all_to_all for t in passes),
        p2p=sum(t.p2p for t in passes),
        offload_wait=waits,
        idle=max(0.0, makespan - _busy(stage)),
        sync=sum(t.fsdp for t in passes),
        spill=sum(t.spill for t in passes),
        optimizer=optimizer,
    )
