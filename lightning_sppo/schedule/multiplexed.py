"""Multiplexed sequence partitioning (SPPO section 6.2) applied to a schedule: the "sppo" schedule.

``multiplex`` starts from a schedule's per-rank order (Seq1F1B's, for "sppo"). The units next to the warm-up and cool-down bubbles (see
``multiplexed_groups``) become multiplexed actions: the owning stage and the ranks that would idle
there compute them together, each a shard of the subsequence with the owner's weights. Where each
helper runs its shards is found by list scheduling all ranks on one clock with uniform costs
(F = 1, B = 2, a shard costing its share): every action starts as early as its inputs and its ranks
allow. Because every rank's list is read off one feasible timeline, the members of a group always
meet at their shared actions in the same order, so the lists cannot deadlock (``dry_run`` checks).
"""

from __future__ import annotations

from lightning_sppo.schedule.actions import Action, Op
from lightning_sppo.schedule.dependencies import upstream_compute

__all__ = ["PLACEMENT_COSTS", "multiplex"]

PLACEMENT_COSTS = {"F": 1.0, "B": 2.0}
"""The uniform costs helpers are placed with (and "sppo" is compared with Seq1F1B at)."""


def multiplex(schedule: list[list[Action]], groups: dict[tuple[int, int, int], tuple[int, ...]]) -> list[list[Action]]:
    """``schedule`` (compute-only, rank k = stage k) with the units in ``groups`` shared by their ranks.

    ``groups`` maps ``(stage, microbatch, subsequence)`` to the ranks that compute that unit together.
    """
    queues = [[_multiplex(rank, action, groups) for action in actions] for rank, actions in enumerate(schedule)]
    return _place(queues)


def _multiplex(rank: int, action: Action, groups: dict[tuple[int, int, int], tuple[int, ...]]) -> Action:
    group = groups.get((rank, *action.unit))
    return action if group is None else action._replace(stage=rank, group=group)


def _place(queues: list[list[Action]]) -> list[list[Action]]:
    """Each stage keeps its own order; helpers join a shared action when its owner reaches it.

    Greedy on one clock: repeatedly start, among every stage's next action whose input is ready, the
    one that can start first, on all of its ranks at once. Ties go the way the data flows (forwards:
    lower stage first; backwards: higher stage first), so a stage's run of shared units is not cut
    by the next stage's: the helpers finish one stage's warm-up before starting the next's.
    """
    pp = len(queues)
    free = [0.0] * pp
    position = [0] * pp
    finished: dict[tuple[int, Action], float] = {}  # (stage, plain compute action) -> end
    lists: list[list[Action]] = [[] for _ in range(pp)]
    while any(position[stage] < len(queue) for stage, queue in enumerate(queues)):
        best: tuple[float, int, int] | None = None
        for stage, queue in enumerate(queues):
            if position[stage] == len(queue):
                continue
            action = queue[position[stage]]
            upstream = upstream_compute(stage, action, pp)  # the neighbour stage's result it consumes
            ready = 0.0 if upstream is None else finished.get(upstream)
            if ready is None:
                continue
            start = max([ready] + [free[rank] for rank in action.group or (stage,)])
            candidate = (start, stage if action.op == Op.F else -stage, stage)
            if best is None or candidate < best:
                best = candidate
        if best is None:  # cannot happen for Seq1F1B orders; guards hand-made queues
            raise RuntimeError(f"multiplexed schedule placement is stuck at positions {position}")
        start, _, stage = best
        action = queues[stage][position[stage]]
        ranks = action.group or (stage,)
        end = start + PLACEMENT_COSTS[action.op] * action.share
        for rank in ranks:
            lists[rank].append(action)
            free[rank] = end
        finished[(stage, action.plain())] = end
        position[stage] += 1
    return lists
