"""Pipeline actions: what one rank does at one step of a schedule.

A schedule is data (DESIGN.md, "Schedules are data"): per rank, an ordered list of ``Action``.
Generators emit the compute ops ``F`` and ``B``; the lowering pass adds the point-to-point
communication ops around them. Actions print compactly (``F0.3``, ``SEND_F0.3@1``) and parse back,
so tests and error messages can use strings.

A *multiplexed* compute action (multiplexed sequence partitioning, SPPO section 6.2) names the stage
whose weights it uses and the group of ranks that compute it together, each a shard of the subsequence:
``F0.1[2:2,3]`` is stage 2's forward of unit (0, 1), computed by ranks 2 and 3. It appears, identical,
in the list of every rank of its group.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple

__all__ = ["COMPUTE_OPS", "PAYLOAD", "PEER_OFFSET", "RECV_OPS", "SEND_OPS", "Action", "Op"]


class Op(str, Enum):
    """What an action does. Members compare equal to their strings: ``Op.F == "F"``."""

    F = "F"  # forward of one subsequence through the rank's stage
    B = "B"  # backward of one subsequence (input and weight gradients)
    SEND_F = "SEND_F"  # send the activation of (mb, sub) to the next stage (non-blocking)
    RECV_F = "RECV_F"  # receive that activation from the previous stage (blocks)
    SEND_B = "SEND_B"  # send the input gradient of (mb, sub) to the previous stage (non-blocking)
    RECV_B = "RECV_B"  # receive the output gradient from the next stage (blocks)

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_OPS

    @property
    def is_send(self) -> bool:
        return self in SEND_OPS

    @property
    def is_recv(self) -> bool:
        return self in RECV_OPS

    @property
    def payload(self) -> Op:
        """The compute op whose result a communication op carries (``F`` for ``SEND_F``); itself for compute."""
        return PAYLOAD[self]


# Lookup tables rather than ``Op(x)`` calls: the dry run and simulator consult them per action,
# and since members hash and compare like their strings, a plain "F" finds the same entry.
COMPUTE_OPS = frozenset({Op.F, Op.B})
SEND_OPS = frozenset({Op.SEND_F, Op.SEND_B})
RECV_OPS = frozenset({Op.RECV_F, Op.RECV_B})
PAYLOAD = {Op.F: Op.F, Op.SEND_F: Op.F, Op.RECV_F: Op.F, Op.B: Op.B, Op.SEND_B: Op.B, Op.RECV_B: Op.B}
PEER_OFFSET = {Op.SEND_F: 1, Op.RECV_F: -1, Op.SEND_B: -1, Op.RECV_B: 1}
"""Where a communication op's peer sits in a linear pipeline: activations flow to k+1, gradients to k-1."""

# Longest names first so that "SEND_F" is never read as an "F" prefix.
_PATTERN = re.compile(
    r"(?P<op>{ops})(?P<mb>\d+)\.(?P<sub>\d+)(?:\[(?P<stage>\d+):(?P<group>\d+(?:,\d+)*)\])?(?:@(?P<peer>\d+))?".format(
        ops="|".join(sorted((op.value for op in Op), key=len, reverse=True))
    )
)


class Action(NamedTuple):
    """One step of one rank: ``op`` applied to subsequence ``subsequence`` of micro-batch ``microbatch``.

    ``peer`` is the rank on the other side of a SEND/RECV; ``None`` for compute ops (and means "the
    neighbour in the pipeline" for a hand-written communication op). ``stage`` and ``group`` are set
    on multiplexed compute actions only: the stage whose weights are used, and the ranks (ascending,
    the stage's own rank among them) that compute the unit together.
    """

    op: Op
    microbatch: int
    subsequence: int
    peer: int | None = None
    stage: int | None = None
    group: tuple[int, ...] | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        shared = "" if self.group is None else f"[{self.stage}:{','.join(map(str, self.group))}]"
        return f"{self.op!s}{self.microbatch}.{self.subsequence}{shared}{peer}"

    __repr__ = __str__  # lists of actions print as schedules: [F0.0, F0.1, B0.1]

    @property
    def unit(self) -> tuple[int, int]:
        """``(microbatch, subsequence)``: the piece of data the action works on."""
        return self.microbatch, self.subsequence

    @property
    def multiplexed(self) -> bool:
        """Computed by a group of ranks, each taking a shard of the subsequence."""
        return self.group is not None

    @property
    def share(self) -> float:
        """The part of the unit's work this action does: 1, or one over its group's size."""
        return 1.0 / len(self.group) if self.group is not None else 1.0

    def owner(self, rank: int) -> int:
        """The stage whose weights (and K/V cache) the action uses when run on ``rank``."""
        return rank if self.stage is None else self.stage

    def plain(self) -> Action:
        """The action without peer, stage and group: what identifies its result."""
        return Action(self.op, self.microbatch, self.subsequence)

    @classmethod
    def from_str(cls, text: str) -> Action:
        """Parse ``str(action)`` back, e.g. ``"F0.3"`` or ``"RECV_B1.0@2"``."""
        match = _PATTERN.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"action={text!r} is not of the form <op><microbatch>.<subsequence>[[stage:group]][@peer] with op"
                f" in {[op.value for op in Op]}, e.g. 'F0.3', 'SEND_F0.3@1' or 'F0.1[2:2,3]'."
            )
        peer, stage, group = match["peer"], match["stage"], match["group"]
        return cls(
            Op(match["op"]),
            int(match["mb"]),
            int(match["sub"]),
            None if peer is None else int(peer),
            None if stage is None else int(stage),
            None if group is None else tuple(int(r) for r in group.split(",")),
        )
