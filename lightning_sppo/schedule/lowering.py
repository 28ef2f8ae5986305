"""Lowering: add the point-to-point communication ops to a compute-only schedule.

A pass takes action lists and returns new ones, so its output can be read, validated and
dry-run like any schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_sppo.schedule.actions import COMPUTE_OPS, Action, Op

__all__ = ["lower"]


def lower(schedule: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """Insert RECV right before and SEND right after each compute op that crosses a stage boundary.

    Rank k receives F's input from k-1 and B's output gradient from k+1, and sends F's output to
    k+1 and B's input gradient to k-1; the first and last ranks have no neighbour on one side. A
    multiplexed action talks to the neighbours on its stage's rank only: the helpers get their shards
    from it inside the action.
    """
    last = len(schedule) - 1
    return [_lower_rank(rank, actions, last) for rank, actions in enumerate(schedule)]


def _lower_rank(rank: int, actions: Sequence[Action], last: int) -> list[Action]:
    lowered: list[Action] = []
    for position, action in enumerate(actions):
        if action.op not in COMPUTE_OPS:
            raise ValueError(
                f"rank {rank}, position {position}: action {action} is already a communication op;"
                " lower() takes compute-only lists (F and B), e.g. from build_schedule()."
            )
        mb, sub = action.unit
        if action.owner(rank) != rank:  # a helper's shard of another stage's unit
            lowered.append(action)
            continue
        if action.op == Op.F:
            before = Action(Op.RECV_F, mb, sub, rank - 1) if rank > 0 else None
            after = Action(Op.SEND_F, mb, sub, rank + 1) if rank < last else None
        else:
            before = Action(Op.RECV_B, mb, sub, rank + 1) if rank < last else None
            after = Action(Op.SEND_B, mb, sub, rank - 1) if rank > 0 else None
        lowered += [a for a in (before, action, after) if a is not None]
    return lowered
