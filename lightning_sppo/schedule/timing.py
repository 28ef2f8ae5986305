"""Simulator: time a schedule with per-action costs; report makespan, bubbles and peak activations.

It times the same lists the runtime executes (compute-only or lowered), so the numbers describe
what runs. An action starts when its rank is free and its cross-rank dependency has finished:
F on stage k after F of the same unit on k-1, B on k after B on k+1, a RECV after its SEND.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lightning_sppo.schedule.actions import COMPUTE_OPS, RECV_OPS, SEND_OPS, Action, Op
from lightning_sppo.schedule.dependencies import Message, message, upstream_compute
from lightning_sppo.schedule.execute import ScheduleDeadlock
from lightning_sppo.schedule.formatting import format_schedule

__all__ = ["Costs", "SimulationResult", "simulate"]

Costs = Callable[[int, Action], float] | Mapping[str, float]
"""``(rank, action) -> seconds``, or uniform costs by op: ``{"F": f, "B": b}`` (other ops default to 0)."""


@dataclass(frozen=True)
class SimulationResult:
    """Timing of one schedule. ``start``/``end`` are indexed like the schedule: ``[rank][position]``."""

    makespan: float
    """Time at which the last action ends (all ranks start at 0)."""
    bubble_ratio: float
    """(makespan - mean busy) / mean busy; (p-1)/N for the plain schedules (SPPO paper, section 3.3)."""
    busy: list[float]
    """Per rank, the summed cost of its actions."""
    peak_live_activations: list[float]
    """Per rank, the most units whose F is done and B is not yet done: activations held at once (a shard of
    a multiplexed unit counts as its share)."""
    start: list[list[float]]
    """``start[rank][position]``: when that action begins; with ``end``, a timeline to plot."""
    end: list[list[float]]


def simulate(schedule: Sequence[Sequence[Action]], costs: Costs) -> SimulationResult:
    """Time ``schedule`` (compute-only or lowered); raise ``ScheduleDeadlock`` if it cannot finish."""
    cost = _cost_function(costs)
    start, end, busy = _timeline(schedule, cost)
    makespan = max((t for row in end for t in row), default=0.0)
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    return SimulationResult(
        makespan=makespan,
        bubble_ratio=(makespan - mean_busy) / mean_busy if mean_busy > 0 else 0.0,
        busy=busy,
        peak_live_activations=[_peak_live(actions) for actions in schedule],
        start=start,
        end=end,
    )


_Computed = dict[tuple[int, Action], float]
"""(rank, compute action) -> its end time."""
_Sent = dict[Message, list[float]]
"""message -> end times of its SENDs not yet received, oldest first."""


def _timeline(
    schedule: Sequence[Sequence[Action]], cost: Callable[[int, Action], float]
) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Start and end of every action, and busy time per rank.

    List scheduling in rounds: each rank advances while its next action's dependency is done. A
    multiplexed action starts on all ranks of its group at once, when every one of them has reached it,
    and ends on all of them with its slowest shard.
    """
    pp = len(schedule)
    busy = [0.0] * pp
    start: list[list[float]] = [[] for _ in range(pp)]
    end: list[list[float]] = [[] for _ in range(pp)]
    computed: _Computed = {}
    sent: _Sent = {}

    def run(rank: int, action: Action, t0: float, t_end: float | None = None) -> float:
        duration = cost(rank, action)
        t_end = t0 + duration if t_end is None else t_end
        start[rank].append(t0)
        end[rank].append(t_end)
        busy[rank] += duration
        return t_end

    def free(rank: int) -> float:
        return end[rank][-1] if end[rank] else 0.0

    while any(len(end[rank]) < len(actions) for rank, actions in enumerate(schedule)):
        progressed = False
        for rank, actions in enumerate(schedule):
            while len(end[rank]) < len(actions):
                action = actions[len(end[rank])]
                ready = _ready_time(rank, action, pp, computed, sent)
                if ready is None:
                    break
                if action.multiplexed:
                    if not all(_next(schedule, end, member) == action for member in action.group):
                        break  # wait for the rest of the group
                    # Collectives inside the action keep the group in step: all finish with the slowest.
                    t0 = max([ready] + [free(member) for member in action.group])
                    t_end = t0 + max(cost(member, action) for member in action.group)
                    for member in action.group:
                        run(member, action, t0, t_end)
                else:
                    t_end = run(rank, action, max(ready, free(rank)))
                _record(rank, action, pp, t_end, computed, sent)
                progressed = True
        if not progressed:
            raise ScheduleDeadlock(_stuck_report(schedule, [len(row) for row in end], pp))
    return start, end, busy


def _next(schedule: Sequence[Sequence[Action]], end: list[list[float]], rank: int) -> Action | None:
    position = len(end[rank])
    return schedule[rank][position] if position < len(schedule[rank]) else None


def _ready_time(rank: int, action: Action, pp: int, computed: _Computed, sent: _Sent) -> float | None:
    """When the action's cross-rank dependency finished; None if it has not yet."""
    if action.op in RECV_OPS:
        ends = sent.get(message(rank, action, pp))
        return ends[0] if ends else None
    upstream = upstream_compute(rank, action, pp)
    return 0.0 if upstream is None else computed.get(upstream)


def _record(rank: int, action: Action, pp: int, t_end: float, computed: _Computed, sent: _Sent) -> None:
    if action.op in COMPUTE_OPS:
        computed[(action.owner(rank), action.plain())] = t_end
    elif action.op in SEND_OPS:
        sent.setdefault(message(rank, action, pp), []).append(t_end)
    elif action.op in RECV_OPS:
        sent[message(rank, action, pp)].pop(0)  # each SEND feeds one RECV


def _stuck_report(schedule: Sequence[Sequence[Action]], positions: list[int], pp: int) -> str:
    stuck = [
        f"  rank {rank} at position {positions[rank]}: {actions[positions[rank]]} waits on"
        f" {_dependency(rank, actions[positions[rank]], pp)}"
        for rank, actions in enumerate(schedule)
        if positions[rank] < len(actions)
    ]
    return "Simulation stuck: no rank can progress.\n" + "\n".join(stuck) + "\n" + format_schedule(schedule)


def _dependency(rank: int, action: Action, pp: int) -> str:
    if action.multiplexed:
        return f"its input, or the other ranks of group {list(action.group)} reaching it"
    if action.op in RECV_OPS:
        return f"its SEND from rank {message(rank, action, pp).src}"
    peer, upstream = upstream_compute(rank, action, pp)  # only compute ops with an upstream can wait
    return f"{upstream} on rank {peer}"


def _peak_live(actions: Sequence[Action]) -> float:
    live, peak = 0.0, 0.0
    for action in actions:
        live += action.share if action.op == Op.F else -action.share if action.op == Op.B else 0.0
        peak = max(peak, live)
    return peak


def _cost_function(costs: Costs) -> Callable[[int, Action], float]:
    """Normalise ``costs`` to a checked ``(rank, action) -> float``."""
    if isinstance(costs, Mapping):
        raw = _uniform_costs(costs)
    elif callable(costs):
        raw = costs
    else:
        raise TypeError(
            f"costs must be a mapping like {{'F': 1.0, 'B': 2.0}} or a callable (rank, action) -> float, got {costs!r}."
        )

    def checked(rank: int, action: Action) -> float:
        value = float(raw(rank, action))
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"costs gave {value} for rank {rank}, action {action}; costs must be finite and >= 0.")
        return value

    return checked


def _uniform_costs(costs: Mapping[str, float]) -> Callable[[int, Action], float]:
    """Cost by op name (a multiplexed action's shard: its share); communication ops not named cost 0."""
    table = {str(key): float(value) for key, value in costs.items()}
    missing = [op for op in ("F", "B") if op not in table]
    if missing:
        raise ValueError(f"costs={table!r} lacks {missing}; a mapping needs at least 'F' and 'B'.")
    unknown = sorted(set(table) - {op.value for op in Op})
    if unknown:
        raise ValueError(f"costs has unknown ops {unknown}; valid keys: {[op.value for op in Op]}.")
    # A multiplexed action's shard costs its share of the unit.
    return lambda rank, action: table.get(str(action.op), 0.0) * action.share
