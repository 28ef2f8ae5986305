"""Dry run: execute lowered schedules symbolically with the runtime's semantics, to find deadlocks.

Semantics: compute ops run at once; a SEND is buffered (non-blocking); a RECV blocks until its
SEND has been issued on the peer rank; a multiplexed compute op is collective: it blocks until every
rank of its group has reached it. No timing: that is ``simulate``'s job.

That checks the schedule, not the calls that carry it: buffered sends are gloo's semantics. Under NCCL a
send completes only with its receive, calls on one process group run in order and tags are ignored, so
the order in which the runtime issues its calls, and on which groups, matters as well. The runtime sends
each direction between two stages on a group of its own (``runtime/links.py``), and
``lightning_sppo.parallel.comm_order`` replays the calls a real step made, recorded on gloo, under NCCL's
rules (tests/distributed/test_nccl_order.py).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from lightning_sppo.schedule.actions import PAYLOAD, RECV_OPS, SEND_OPS, Action, Op
from lightning_sppo.schedule.dependencies import Message, message
from lightning_sppo.schedule.formatting import format_schedule

__all__ = ["ScheduleDeadlock", "dry_run"]


class ScheduleDeadlock(RuntimeError):
    """No rank can progress: every unfinished rank waits on something that never comes."""


def dry_run(lowered_schedule: Sequence[Sequence[Action]]) -> None:
    """Run all ranks symbolically; raise if the lists don't fit together.

    ``ValueError`` when a SEND has no matching RECV (or vice versa), or a rank uses data it has
    not received or computed yet (e.g. F before its RECV_F: did you forget ``lower``?);
    ``ScheduleDeadlock`` naming every stuck rank and the RECV it waits on.
    """
    pp = len(lowered_schedule)
    _check_matching(lowered_schedule, pp)
    _check_groups(lowered_schedule)
    for rank, actions in enumerate(lowered_schedule):
        _check_inputs(rank, actions, pp, lowered_schedule)
    _execute(lowered_schedule, pp)


def _execute(schedule: Sequence[Sequence[Action]], pp: int) -> None:
    positions = [0] * pp
    issued: Counter[Message] = Counter()
    while any(positions[rank] < len(actions) for rank, actions in enumerate(schedule)):
        progressed = False
        for rank, actions in enumerate(schedule):
            position = positions[rank]
            while position < len(actions):
                action = actions[position]
                if action.multiplexed:
                    if not all(_at(schedule, positions, m) == action for m in action.group if m != rank):
                        break  # blocked until the whole group is there
                    for member in action.group:
                        if member != rank:
                            positions[member] += 1
                    progressed = True
                elif action.op in RECV_OPS:
                    key = message(rank, action, pp)
                    if issued[key] == 0:
                        break  # blocked until the peer issues the SEND
                    issued[key] -= 1
                elif action.op in SEND_OPS:
                    issued[message(rank, action, pp)] += 1
                position += 1
            progressed |= position > positions[rank]
            positions[rank] = position
        if not progressed:
            raise ScheduleDeadlock(_deadlock_report(schedule, positions, pp))


def _at(schedule: Sequence[Sequence[Action]], positions: list[int], rank: int) -> Action | None:
    return schedule[rank][positions[rank]] if positions[rank] < len(schedule[rank]) else None


def _deadlock_report(schedule: Sequence[Sequence[Action]], positions: list[int], pp: int) -> str:
    lines = ["Schedule deadlocks: no rank can progress."]
    for rank, actions in enumerate(schedule):
        if positions[rank] < len(actions):
            action = actions[positions[rank]]
            if action.multiplexed:
                elsewhere = {m: _state(schedule[m], positions[m]) for m in action.group if m != rank}
                lines.append(f"  rank {rank} at position {positions[rank]} waits on {action}'s group: {elsewhere}")
                continue
            src = message(rank, action, pp).src
            send = Action(Op(str(action.op).replace("RECV", "SEND")), action.microbatch, action.subsequence, rank)
            lines.append(
                f"  rank {rank} at position {positions[rank]} waits on {action}: rank {src} has not issued"
                f" {send} (rank {src} is {_state(schedule[src], positions[src])})"
            )
    return "\n".join(lines) + "\n" + format_schedule(schedule)


def _state(actions: Sequence[Action], position: int) -> str:
    return "finished" if position >= len(actions) else f"stuck at position {position} on {actions[position]}"


def _check_matching(schedule: Sequence[Sequence[Action]], pp: int) -> None:
    """Every SEND needs exactly one RECV of the same message on the peer, and vice versa."""
    sends: dict[Message, list[tuple[int, int]]] = defaultdict(list)
    recvs: dict[Message, list[tuple[int, int]]] = defaultdict(list)
    for rank, actions in enumerate(schedule):
        for position, action in enumerate(actions):
            if action.op in SEND_OPS:
                sends[message(rank, action, pp)].append((rank, position))
            elif action.op in RECV_OPS:
                recvs[message(rank, action, pp)].append((rank, position))
    unmatched = [key for key in sends.keys() | recvs.keys() if len(sends[key]) != len(recvs[key])]
    if unmatched:

        def where(places: list[tuple[int, int]]) -> str:
            return "; ".join(f"rank {r} position {p} ({schedule[r][p]})" for r, p in places) or "none"

        problems = [
            f"  {key.payload}{key.microbatch}.{key.subsequence} from rank {key.src} to rank {key.dst}:"
            f" {len(sends[key])} SEND [{where(sends[key])}] vs {len(recvs[key])} RECV [{where(recvs[key])}]"
            for key in sorted(unmatched)
        ]
        raise ValueError("Unmatched communication (each SEND needs one RECV on its peer):\n" + "\n".join(problems))


def _check_groups(schedule: Sequence[Sequence[Action]]) -> None:
    """Every multiplexed action appears once on each rank of its group, and nowhere else."""
    holders: dict[Action, list[int]] = defaultdict(list)
    for rank, actions in enumerate(schedule):
        for action in actions:
            if action.multiplexed:
                holders[action].append(rank)
    for action, ranks in holders.items():
        if sorted(ranks) != sorted(action.group) or action.stage not in action.group:
            raise ValueError(
                f"Multiplexed action {action} must appear exactly once on each rank of its group"
                f" {list(action.group)} (which includes its stage {action.stage}); found on ranks {ranks}."
            )


def _check_inputs(rank: int, actions: Sequence[Action], pp: int, schedule: Sequence[Sequence[Action]]) -> None:
    """A compute op needs its input received first; a SEND needs its payload computed first. A helper's
    shard of another stage's unit gets its input inside the multiplexed action."""
    done: set[tuple[Op, int, int]] = set()
    for position, action in enumerate(actions):
        if action.owner(rank) != rank:
            continue
        needed = _needed_before(action.op, rank, pp)
        if needed is not None and (needed, action.microbatch, action.subsequence) not in done:
            raise ValueError(
                f"Invalid lowered schedule: rank {rank}, position {position}, action {action}: needs"
                f" {Action(needed, action.microbatch, action.subsequence)} earlier on this rank"
                f" ({_why(action.op)}).\n{format_schedule(schedule)}"
            )
        done.add((action.op, action.microbatch, action.subsequence))


def _needed_before(op: Op, rank: int, pp: int) -> Op | None:
    if op == Op.F and rank > 0:
        return Op.RECV_F
    if op == Op.B and rank < pp - 1:
        return Op.RECV_B
    if op in SEND_OPS:
        return PAYLOAD[op]
    return None


def _why(op: Op) -> str:
    if op in SEND_OPS:
        return "a SEND carries the result of its compute op"
    return "its input comes from a neighbour rank; run lower() on compute-only lists"
