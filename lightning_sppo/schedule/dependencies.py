"""Who waits on whom across ranks; shared by the dry run and the simulator."""

from __future__ import annotations

from typing import NamedTuple

from lightning_sppo.schedule.actions import PAYLOAD, PEER_OFFSET, SEND_OPS, Action, Op

__all__ = ["Message", "message", "upstream_compute"]


class Message(NamedTuple):
    """What a SEND issues and its RECV waits for: the result of ``payload`` on unit (mb, sub)."""

    src: int
    dst: int
    payload: Op
    microbatch: int
    subsequence: int


def message(rank: int, action: Action, pp: int) -> Message:
    """The message a SEND on ``rank`` issues, or the one a RECV on ``rank`` waits for."""
    peer = rank + PEER_OFFSET[action.op] if action.peer is None else action.peer
    if not 0 <= peer < pp or peer == rank:
        raise ValueError(f"rank {rank}: action {action} has peer={peer}; it must be another rank in [0, pp={pp}).")
    src, dst = (rank, peer) if action.op in SEND_OPS else (peer, rank)
    return Message(src, dst, PAYLOAD[action.op], action.microbatch, action.subsequence)


def upstream_compute(rank: int, action: Action, pp: int) -> tuple[int, Action] | None:
    """The compute op on a neighbour stage that a compute op consumes: F on k-1, or B on k+1 (k the stage
    whose weights the action uses); None at the ends. Returned as (stage, plain action)."""
    stage = action.owner(rank)
    if action.op == Op.F and stage > 0:
        return stage - 1, Action(Op.F, action.microbatch, action.subsequence)
    if action.op == Op.B and stage < pp - 1:
        return stage + 1, Action(Op.B, action.microbatch, action.subsequence)
    return None
