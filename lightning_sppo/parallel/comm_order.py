"""Replay every rank's communication calls under NCCL's ordering rules: does the step finish, do messages match?

Gloo buffers sends, honours tags and blocks the host in ``wait()``; NCCL does none of that. A call order that
completes on gloo can hang on NCCL, and no CPU test sees it unless something replays the order under NCCL's
rules. This module does, on per-rank traces: lists of ``Call`` and ``Wait`` in the order each rank issued
them, recorded on gloo by ``comm_trace.record_communication`` or written by hand. The model is the strictest
reading of NCCL and ProcessGroupNCCL:

1. every rank has one in-order queue per process group (``Comm``). NCCL may give point-to-point traffic a
   communicator of its own per peer pair; one queue per group is stricter, so whatever completes here
   completes there too;
2. the k-th send from a to b on a group matches the k-th receive from a at b; tags are ignored;
3. a send completes only together with its receive: nothing is buffered;
4. a batch (``batch_isend_irecv``) is one queue entry: its messages progress together, and the entry
   completes when all of them have;
5. a collective completes when every member of the group has it at the head of its queue;
6. once a rank has waited on a call's Work, every call it issues afterwards starts only after that call
   completed: ``wait()`` makes the compute stream wait on it, and every later NCCL call first waits on the
   compute stream. Nothing else orders a rank's calls: under NCCL the host does not block in ``wait()``.

``replay`` raises ``CommunicationMismatch`` when matched messages differ in shape or dtype, or the k-th
collectives of a group's members differ in kind, root, dtype or size; and ``CommunicationHang`` when some
calls can never complete, with each stuck rank's head call per group and what it waits for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Call",
    "Comm",
    "CommunicationError",
    "CommunicationHang",
    "CommunicationMismatch",
    "Message",
    "Trace",
    "Wait",
    "replay",
]


@dataclass(frozen=True)
class Comm:
    """A process group as every member sees it: its global ranks and its name (``ProcessGroup.group_name``,
    the same on every member; it tells apart groups with the same ranks). ``desc`` only labels reports."""

    ranks: tuple[int, ...]
    name: str = ""
    desc: str = ""

    def __str__(self) -> str:
        return f"{self.desc or 'group'}{list(self.ranks)}"


@dataclass(frozen=True)
class Message:
    """One side of a point-to-point transfer: a send to ``peer``, or a receive from it (global ranks)."""

    send: bool
    peer: int
    shape: tuple[int, ...] = (1,)
    dtype: str = "float32"

    def __str__(self) -> str:
        what = f"send to {self.peer}" if self.send else f"recv from {self.peer}"
        return f"{what} {list(self.shape)} {self.dtype}".rstrip()


@dataclass(frozen=True)
class Call:
    """One entry of a rank's queue on ``comm``: a send or receive, a batch of them, or a collective.

    ``kind`` is the function called (``isend``, ``batch_isend_irecv``) or, for a collective, NCCL's primitive
    (``all_gather`` for ``all_gather_into_tensor`` too). ``agree``: what every member's call of one collective
    must share, as ``(name, value)`` pairs (root, dtype, elements contributed). ``site``: the caller.
    """

    kind: str
    comm: Comm
    messages: tuple[Message, ...] = ()
    agree: tuple[tuple[str, object], ...] = ()
    site: str = ""

    @classmethod
    def send(cls, comm: Comm, peer: int, shape: tuple[int, ...] = (1,), dtype: str = "float32") -> Call:
        return cls("isend", comm, (Message(True, peer, shape, dtype),))

    @classmethod
    def recv(cls, comm: Comm, peer: int, shape: tuple[int, ...] = (1,), dtype: str = "float32") -> Call:
        return cls("irecv", comm, (Message(False, peer, shape, dtype),))

    @classmethod
    def batch(cls, comm: Comm, *messages: Message) -> Call:
        return cls("batch_isend_irecv", comm, messages)

    @classmethod
    def collective(cls, kind: str, comm: Comm, **agree: object) -> Call:
        return cls(kind, comm, agree=tuple(sorted(agree.items())))

    def __str__(self) -> str:
        if self.messages:
            what = str(self.messages[0]) if len(self.messages) == 1 else f"batch[{', '.join(map(str, self.messages))}]"
        else:
            what = " ".join([self.kind] + [f"{name}={value}" for name, value in self.agree])
        return f"{what} on {self.comm}" + (f" at {self.site}" if self.site else "")


@dataclass(frozen=True)
class Wait:
    """The rank waited on the Work of its call at position ``call`` of its trace."""

    call: int


Trace = list[Call | Wait]
"""One rank's calls and waits, in the order it issued them."""


class CommunicationError(RuntimeError):
    """The traces cannot run under NCCL's rules."""


class CommunicationMismatch(CommunicationError):
    """Matched messages or collectives disagree on what they carry."""


class CommunicationHang(CommunicationError):
    """Some calls never complete: every rank that still has calls waits on something that never comes."""


_Id = tuple[int, int]  # (rank, position in its trace)


def replay(traces: Sequence[Sequence[Call | Wait]]) -> None:
    """Run every rank's trace under NCCL's rules (module docstring); raise if they mismatch or hang."""
    _check(traces)
    partners, collectives, problems, lined = _match(traces)
    if problems:
        raise CommunicationMismatch("Communication mismatch under NCCL's matching rules:\n  " + "\n  ".join(problems))
    run = _Run(traces, partners, collectives, lined)
    run.until_stuck()
    if run.unfinished:
        raise CommunicationHang(run.report())


# -- structure ----------------------------------------------------------------------------------------


def _check(traces: Sequence[Sequence[Call | Wait]]) -> None:
    """Waits name an earlier call; a rank calls only groups it belongs to; a group's name means one rank set."""
    members: dict[str, tuple[int, ...]] = {}
    for rank, trace in enumerate(traces):
        for position, event in enumerate(trace):
            if isinstance(event, Wait):
                if not (0 <= event.call < position and isinstance(trace[event.call], Call)):
                    raise ValueError(f"rank {rank}, position {position}: {event} does not name an earlier call.")
                continue
            comm = event.comm
            if rank not in comm.ranks:
                raise ValueError(f"rank {rank}, position {position}: {event} is on a group without rank {rank}.")
            if members.setdefault(comm.name, comm.ranks) != comm.ranks and comm.name:
                raise ValueError(f"Group name {comm.name!r} stands for ranks {members[comm.name]} and {comm.ranks}.")
            for message in event.messages:
                if message.peer not in comm.ranks or message.peer == rank:
                    raise ValueError(f"rank {rank}, position {position}: {event} has no valid peer on {comm}.")


def _match(traces: Sequence[Sequence[Call | Wait]]) -> tuple[dict, dict, list[str], dict]:
    """Pair every message with its counterpart (k-th send a->b with k-th receive at b from a, per group) and
    line up every group's k-th collective across its members. Returns the message pairs, each collective's
    calls (one per member), what disagrees, and each (group, rank)'s collectives in order."""
    sends: dict[tuple[Comm, int, int], list[tuple[_Id, int]]] = defaultdict(list)
    recvs: dict[tuple[Comm, int, int], list[tuple[_Id, int]]] = defaultdict(list)
    lined: dict[tuple[Comm, int], list[_Id]] = defaultdict(list)
    for rank, trace in enumerate(traces):
        for position, call in enumerate(trace):
            if isinstance(call, Wait):
                continue
            if not call.messages:
                lined[(call.comm, rank)].append((rank, position))
            for index, message in enumerate(call.messages):
                if message.send:
                    sends[(call.comm, rank, message.peer)].append(((rank, position), index))
                else:
                    recvs[(call.comm, message.peer, rank)].append(((rank, position), index))
    partners: dict[tuple[_Id, int], tuple[_Id, int]] = {}
    problems: list[str] = []
    for key in sorted(sends.keys() & recvs.keys(), key=str):
        for send, recv in zip(sends[key], recvs[key], strict=False):
            partners[send], partners[recv] = recv, send
            a, b = _message(traces, send), _message(traces, recv)
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                problems.append(
                    f"rank {send[0][0]} sends {list(a.shape)} {a.dtype} (call {send[0][1]}) to rank {recv[0][0]},"
                    f" which receives {list(b.shape)} {b.dtype} (call {recv[0][1]}) on {key[0]}"
                )
    collectives: dict[_Id, list[_Id]] = {}
    for comm in sorted({comm for comm, _ in lined}, key=lambda comm: (comm.name, comm.ranks)):
        queues = [lined.get((comm, member), []) for member in comm.ranks]
        for k in range(min(len(queue) for queue in queues)):
            group = [queue[k] for queue in queues]
            for member in group:
                collectives[member] = group
            first, *others = (_call(traces, member) for member in group)
            for member, other in zip(group[1:], others, strict=True):
                if (other.kind, other.agree) != (first.kind, first.agree):
                    problems.append(
                        f"collective {k} on {comm}: rank {group[0][0]} calls {first} (call {group[0][1]}),"
                        f" rank {member[0]} calls {other} (call {member[1]})"
                    )
    return partners, collectives, problems, lined


def _call(traces, at: _Id) -> Call:
    return traces[at[0]][at[1]]


def _message(traces, at: tuple[_Id, int]) -> Message:
    return _call(traces, at[0]).messages[at[1]]


# -- execution ----------------------------------------------------------------------------------------


class _Run:
    """The replay's state: per (rank, group) queue, its head; which calls and messages completed."""

    def __init__(self, traces, partners, collectives, lined) -> None:
        self.traces, self.partners, self.collectives, self.lined = traces, partners, collectives, lined
        self.queues: dict[tuple[int, Comm], list[int]] = defaultdict(list)
        self.waits: list[list[int]] = [[] for _ in traces]  # positions of each rank's waits
        for rank, trace in enumerate(traces):
            for position, event in enumerate(trace):
                if isinstance(event, Wait):
                    self.waits[rank].append(position)
                else:
                    self.queues[(rank, event.comm)].append(position)
        self.heads = dict.fromkeys(self.queues, 0)
        self.passed = [0] * len(traces)  # how many of each rank's waits, in order, have completed
        self.done: set[_Id] = set()
        self.delivered: set[tuple[_Id, int]] = set()

    @property
    def unfinished(self) -> list[_Id]:
        return [
            (rank, queue[i])
            for (rank, _), queue in self.queues.items()
            for i in range(self.heads[(rank, _)], len(queue))
        ]

    def until_stuck(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for key, queue in self.queues.items():
                while self.heads[key] < len(queue) and self._advance((key[0], queue[self.heads[key]])):
                    self.heads[key] += 1
                    progressed = True

    def _advance(self, at: _Id) -> bool:
        """Try to complete the head call ``at``; True once it has completed."""
        if at in self.done:
            return True
        if not self._active(at):
            return False
        call = _call(self.traces, at)
        if not call.messages:
            group = self.collectives.get(at)
            if group is None or not all(self._active(member) for member in group):
                return False
            self.done.update(group)
            return True
        for index in range(len(call.messages)):
            partner = self.partners.get((at, index))
            if (at, index) not in self.delivered and partner is not None and self._active(partner[0]):
                self.delivered |= {(at, index), partner}
                self._complete_if_delivered(partner[0])
        return self._complete_if_delivered(at)

    def _complete_if_delivered(self, at: _Id) -> bool:
        if all((at, index) in self.delivered for index in range(len(_call(self.traces, at).messages))):
            self.done.add(at)
        return at in self.done

    def _active(self, at: _Id) -> bool:
        """At the head of its queue, and every call its rank waited on before issuing it has completed."""
        rank, position = at
        call = _call(self.traces, at)
        queue = self.queues[(rank, call.comm)]
        return queue[self.heads[(rank, call.comm)]] == position and self._released(rank, position)

    def _released(self, rank: int, position: int) -> bool:
        waits = self.waits[rank]
        while self.passed[rank] < len(waits) and (rank, self.traces[rank][waits[self.passed[rank]]].call) in self.done:
            self.passed[rank] += 1
        return self.passed[rank] == len(waits) or waits[self.passed[rank]] > position

    # -- report -----------------------------------------------------------------------------------

    def report(self) -> str:
        unfinished = self.unfinished
        ranks = sorted({rank for rank, _ in unfinished})
        lines = [
            f"Communication hangs under NCCL's ordering rules: {len(unfinished)} calls on ranks {ranks} never"
            " complete. Each stuck rank's head call per group, and what it waits for:"
        ]
        for rank in ranks:
            lines.append(f"rank {rank}:")
            heads = sorted(
                queue[self.heads[key]]
                for key, queue in self.queues.items()
                if key[0] == rank and self.heads[key] < len(queue)
            )
            for position in heads:
                lines.append(f"  call {position}: {_call(self.traces, (rank, position))}")
                lines += [f"    -> {reason}" for reason in self._why((rank, position))]
        return "\n".join(lines)

    def _why(self, at: _Id) -> list[str]:
        rank, position = at
        if not self._released(rank, position):
            waited = self.traces[rank][self.waits[rank][self.passed[rank]]].call
            return [f"issued after rank {rank} waited on its call {waited} ({_call(self.traces, (rank, waited))})"]
        call = _call(self.traces, at)
        if not call.messages:
            group = self.collectives.get(at)
            if group is None:
                k = self.lined[(call.comm, rank)].index(at)
                return [
                    f"rank {m} calls only {len(self.lined.get((call.comm, m), []))} collectives on {call.comm}:"
                    f" this is number {k + 1}"
                    for m in call.comm.ranks
                    if len(self.lined.get((call.comm, m), [])) <= k
                ]
            return [self._where(member, "collective") for member in group if not self._active(member)]
        reasons = []
        for index, message in enumerate(call.messages):
            if (at, index) in self.delivered:
                continue
            partner = self.partners.get((at, index))
            counterpart = "receive" if message.send else "send"
            if partner is None:
                reasons.append(f"rank {message.peer} never posts the matching {counterpart} on {call.comm}")
            else:
                reasons.append(self._where(partner[0], f"matching {counterpart}"))
        return reasons

    def _where(self, at: _Id, what: str) -> str:
        """Why the counterpart ``at`` on another rank is not running yet."""
        rank, position = at
        call = _call(self.traces, at)
        head = self.queues[(rank, call.comm)][self.heads[(rank, call.comm)]]
        if head != position:
            return f"rank {rank}'s {what} (its call {position}) is queued behind its call {head}: {_call(self.traces, (rank, head))}"
        waited = self.traces[rank][self.waits[rank][self.passed[rank]]].call
        return (
            f"rank {rank} issues its {what} (its call {position}) after waiting on its call {waited}:"
            f" {_call(self.traces, (rank, waited))}"
        )
