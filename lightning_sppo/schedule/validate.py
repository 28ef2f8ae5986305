"""Per-rank checks of a schedule: what one stage can verify from its own list.

Cross-stage order (F on stage k after F on k-1, B on k after B on k+1) needs all ranks at once and
is the dry run's job (``dry_run``).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_sppo.schedule.actions import COMPUTE_OPS, Action, Op
from lightning_sppo.schedule.formatting import format_schedule

__all__ = ["validate_schedule"]


def validate_schedule(
    schedule: Sequence[Sequence[Action]], pp: int, num_subsequences: int, num_microbatches: int
) -> None:
    """Raise ``ValueError`` naming rank, position, action and rule at the first violation.

    Every rank must run F and B of every (microbatch, subsequence) of its stage exactly once; F(m, s)
    after F(m, s-1) (causal attention reads earlier K/V); B(m, s) after F(m, s) and after B(m, s+1)
    (the K/V gradient cache is complete only once all later subsequences ran backward). A helper's
    shard of another stage's unit must name a group holding both, and come at most once, its B after
    its F. Communication ops are skipped, so lowered lists validate too.
    """
    if len(schedule) != pp:
        raise ValueError(f"The schedule has {len(schedule)} rank lists, expected one per rank: pp={pp}.")
    for rank, actions in enumerate(schedule):
        problem = _first_problem(rank, actions, num_subsequences, num_microbatches)
        if problem is not None:
            raise ValueError(f"Invalid schedule: rank {rank}, {problem}\n{format_schedule(schedule)}")


def _first_problem(rank: int, actions: Sequence[Action], n: int, m: int) -> str | None:
    """The first broken rule in one rank's list, as text; None when the list is valid."""
    seen: dict[tuple[Op, int, int], int] = {}  # this rank's stage
    helped: dict[Action, int] = {}  # shards of other stages' units
    for position, action in enumerate(actions):
        op = action.op
        if op not in COMPUTE_OPS:
            continue
        where = f"position {position}, action {action}"
        if action.multiplexed and (rank not in action.group or action.stage not in action.group):
            return f"{where}: its group {list(action.group)} must hold this rank and the stage {action.stage}"
        if action.owner(rank) != rank:
            rule = _broken_helper_rule(action, helped)
            if rule is not None:
                return f"{where}: {rule}"
            helped[action] = position
            continue
        rule = _broken_rule(op, action, seen, n, m)
        if rule is not None:
            return f"{where}: {rule}"
        seen[(op, *action.unit)] = position
    missing = [
        str(Action(op, mb, sub))
        for op in (Op.F, Op.B)
        for mb in range(m)
        for sub in range(n)
        if (op, mb, sub) not in seen
    ]
    if missing:
        return f"end of list: missing {', '.join(missing)} (every F and B of each (microbatch, subsequence) must appear once)"
    return None


def _broken_rule(op: Op, action: Action, seen: dict[tuple[Op, int, int], int], n: int, m: int) -> str | None:
    mb, sub = action.unit
    if not (0 <= mb < m and 0 <= sub < n):
        return f"out of range: needs 0 <= microbatch < num_microbatches={m} and 0 <= subsequence < num_subsequences={n}"
    if (op, mb, sub) in seen:
        return f"duplicate of position {seen[(op, mb, sub)]} (each action runs exactly once per rank)"
    if op == Op.F and sub > 0 and (Op.F, mb, sub - 1) not in seen:
        return f"F before {Action(Op.F, mb, sub - 1)}: a micro-batch's forwards run in subsequence order"
    if op == Op.B and (Op.F, mb, sub) not in seen:
        return f"B before its own forward {Action(Op.F, mb, sub)} on this rank"
    if op == Op.B and sub < n - 1 and (Op.B, mb, sub + 1) not in seen:
        return (
            f"B before {Action(Op.B, mb, sub + 1)}: a micro-batch's backwards run last-first"
            " (the K/V gradient cache is complete only after later subsequences ran backward)"
        )
    return None


def _broken_helper_rule(action: Action, helped: dict[Action, int]) -> str | None:
    if action in helped:
        return f"duplicate of position {helped[action]} (each action runs exactly once per rank)"
    forward = action._replace(op=Op.F)
    if action.op == Op.B and forward not in helped:
        return f"B before its own forward {forward} on this rank (the shard's activations live here)"
    return None
