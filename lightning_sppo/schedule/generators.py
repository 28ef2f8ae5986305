"""Schedule generators: per pipeline rank, the ordered compute actions (F and B only).

Rank k holds stage k. A unit is one (microbatch, subsequence); forwards of a micro-batch run in
subsequence order (causal attention reads the K/V of earlier subsequences) and its backwards run
last-first (the K/V gradient cache of subsequence s is complete only after subsequences s+1..N-1
ran backward). Across micro-batches both directions are FIFO.

Communication is added later by ``lower``; timing comes from ``simulate``.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_sppo.schedule.actions import Action, Op
from lightning_sppo.schedule.msp import multiplexed_groups
from lightning_sppo.schedule.multiplexed import PLACEMENT_COSTS, multiplex
from lightning_sppo.schedule.timing import simulate

__all__ = [
    "SCHEDULES",
    "ScheduleGenerator",
    "build_schedule",
    "forward_only",
    "gpipe",
    "seq1f1b",
    "seq1f1b_warmup",
    "sppo",
]

ScheduleGenerator = Callable[[int, int, int], list[list[Action]]]
"""(pp, num_subsequences, num_microbatches) -> one list of compute actions per rank."""


def gpipe(pp: int, num_subsequences: int, num_microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards: the simplest schedule, and the activation-memory upper bound."""
    order = _forwards(num_subsequences, num_microbatches) + _backwards(num_subsequences, num_microbatches)
    return [list(order) for _ in range(pp)]


def seq1f1b_warmup(rank: int, pp: int, num_subsequences: int, num_microbatches: int) -> int:
    """Forwards rank ``rank`` runs before its first backward (Seq1F1B, section 3.2, Eq. 4).

    ``w_i = P - i - 2 + k`` with k subsequences: the last stage forwards k-1 subsequences, so its
    next forward completes the first micro-batch and the steady phase can open with that
    micro-batch's last subsequence; each earlier stage runs one forward more. Like 1F1B's
    ``min(P - i - 1, M)`` it is capped at the number of units (then the rank runs GPipe-like).
    Eq. 4's other branch (``w_i = M`` if M <= P, copied from Eq. 1) is read as that cap: taken
    literally it would turn every M <= P run into GPipe and give up the schedule's memory saving.
    """
    return min(pp - rank - 2 + num_subsequences, num_subsequences * num_microbatches)


def seq1f1b(pp: int, num_subsequences: int, num_microbatches: int) -> list[list[Action]]:
    """Sequence-level 1F1B (Seq1F1B): warm-up forwards, then one forward per backward, then cool-down."""
    return [_seq1f1b_rank(rank, pp, num_subsequences, num_microbatches) for rank in range(pp)]


def _seq1f1b_rank(rank: int, pp: int, n: int, m: int) -> list[Action]:
    forwards, backwards = _forwards(n, m), _backwards(n, m)
    done = seq1f1b_warmup(rank, pp, n, m)
    order = forwards[:done]
    for backward in backwards:
        # One forward per backward (steady phase; none left in cool-down). The paper's queue pops
        # the tail of the earliest micro-batch, which could be an earlier subsequence than N-1 if
        # that micro-batch were only partly forwarded; the K/V gradient cache forbids that, so
        # forward on until this backward's own forward has run. With Eq. 4's warm-up this adds
        # nothing (j-th backward: done = N + P-1-i + j >= (j // N + 1) N), it guards other warm-ups.
        needed = min(max(done + 1, _index(backward, n) + 1), len(forwards))
        order += forwards[done:needed]
        done = needed
        order.append(backward)
    return order


def sppo(pp: int, num_subsequences: int, num_microbatches: int) -> list[list[Action]]:
    """Seq1F1B with multiplexed sequence partitioning (SPPO section 6.2): the units next to the bubbles
    (``multiplexed_groups``) are shared with the ranks that would idle there.

    With one micro-batch that leaves almost no bubble. Micro-batches then run one after another (each a
    one-micro-batch Seq1F1B, consecutive ones overlapping where ranks are free): a shared unit's forward
    and backward must both fall in bubbles, which Seq1F1B's interleaving of micro-batches prevents. When
    that loses to plain Seq1F1B at uniform costs (F = 1, B = 2; many micro-batches on few stages), the
    plain Seq1F1B order is used.
    """
    one = seq1f1b(pp, num_subsequences, 1)
    base = [[a._replace(microbatch=mb) for mb in range(num_microbatches) for a in actions] for actions in one]
    schedule = multiplex(base, multiplexed_groups(pp, num_subsequences, num_microbatches))
    if num_microbatches == 1:
        return schedule
    plain = seq1f1b(pp, num_subsequences, num_microbatches)
    faster = simulate(schedule, PLACEMENT_COSTS).makespan < simulate(plain, PLACEMENT_COSTS).makespan
    return schedule if faster else plain


def forward_only(pp: int, num_subsequences: int, num_microbatches: int) -> list[list[Action]]:
    """Evaluation: every rank runs the forwards alone, micro-batches FIFO and subsequences in order.

    Whatever schedule trains (the "sppo" one included), evaluation uses this one: without backwards there
    is no bubble to fill, and a stage streams one subsequence to the next as soon as it is computed.
    """
    for setting, value in (("pp", pp), ("num_subsequences", num_subsequences), ("num_microbatches", num_microbatches)):
        _check_count(setting, value)
    return [_forwards(num_subsequences, num_microbatches) for _ in range(pp)]


def _forwards(n: int, m: int) -> list[Action]:
    """Forward order: micro-batches FIFO, subsequences first to last."""
    return [Action(Op.F, mb, sub) for mb in range(m) for sub in range(n)]


def _backwards(n: int, m: int) -> list[Action]:
    """Backward order: micro-batches FIFO, subsequences last to first."""
    return [Action(Op.B, mb, sub) for mb in range(m) for sub in reversed(range(n))]


def _index(action: Action, n: int) -> int:
    """Position of the action's unit in forward order."""
    return action.microbatch * n + action.subsequence


SCHEDULES: dict[str, ScheduleGenerator] = {"gpipe": gpipe, "seq1f1b": seq1f1b, "sppo": sppo}
"""Name -> generator."""


def build_schedule(name: str, pp: int, num_subsequences: int, num_microbatches: int = 1) -> list[list[Action]]:
    """The compute-only schedule ``name`` for ``pp`` ranks (one stage each), N subsequences, M micro-batches."""
    generator = SCHEDULES.get(name)
    if generator is None:
        raise ValueError(f"Unknown schedule name={name!r}; valid names: {', '.join(sorted(SCHEDULES))}.")
    _check_count("pp", pp)
    _check_count("num_subsequences", num_subsequences)
    _check_count("num_microbatches", num_microbatches)
    return generator(pp, num_subsequences, num_microbatches)


def _check_count(setting: str, value: object) -> None:
    # bool is an int subclass; pp=True is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{setting} must be an integer >= 1, got {setting}={value!r}.")
