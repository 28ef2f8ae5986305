"""Multiplexed sequence partitioning (SPPO section 6.2): each stage's Left-SP, Steady and Right-SP phases.

In stage i's forward, the subsequences next to the pipeline's warm-up and cool-down bubbles are split
again and computed with the help of the ranks that would otherwise idle. Which subsequences, and which
ranks help, is data; this module computes it (the runtime schedule that uses it is separate).

Table 3 of the paper (PP = 4, N = 8) is the ground truth. Definition 6.1 as printed is off by one
against it (its Left and Steady ranges share id PP-1-i, its Steady and Right ranges share N-i); the
table is consistent with, for stage i:

    Left-SP    ids 0 .. PP-2-i           ranks i .. PP-1  (the stages after i, idle in warm-up)
    Steady     ids PP-1-i .. N-1-i       plain pipeline parallelism on stage i alone
    Right-SP   ids N-i .. N-1            ranks 0 .. i     (the stages before i, idle in cool-down)

A phase with no subsequences has no ranks (the table's empty sets for the last stage's Left-SP and the
first stage's Right-SP). N must be at least PP: with fewer subsequences than stages, some stage's
warm-up and cool-down would claim the same subsequence and it would have no steady phase at all, so the
phases no longer partition 0..N-1; ``msp_phases`` raises instead of returning overlapping sets.
"""

from __future__ import annotations

__all__ = ["MSPPhase", "left_ranks", "msp_phases", "multiplexed_groups", "right_ranks", "sharing_groups"]

MSPPhase = dict[str, set[int]]
"""Keys ``left``, ``steady``, ``right`` (subsequence ids) and ``left_ranks``, ``right_ranks`` (stage indices)."""


def msp_phases(pp: int, num_subsequences: int) -> list[MSPPhase]:
    """One dict per stage: its phases' subsequence ids and the ranks that share its Left/Right-SP work."""
    _check(pp, num_subsequences)
    return [_stage_phases(i, pp, num_subsequences) for i in range(pp)]


def left_ranks(stage: int, pp: int) -> tuple[int, ...]:
    """The ranks that share stage ``stage``'s Left-SP units: it and the stages after it."""
    return tuple(range(stage, pp))


def right_ranks(stage: int) -> tuple[int, ...]:
    """The ranks that share stage ``stage``'s Right-SP units: the stages before it, and it."""
    return tuple(range(0, stage + 1))


def sharing_groups(pp: int) -> list[tuple[int, tuple[int, ...]]]:
    """``(stage, ranks)`` for every group that may share a stage's units: per stage, Left-SP then Right-SP,
    groups of one left out. One global order, the same on every rank."""
    pairs = [(stage, ranks) for stage in range(pp) for ranks in (left_ranks(stage, pp), right_ranks(stage))]
    return [(stage, ranks) for stage, ranks in pairs if len(ranks) > 1]


def multiplexed_groups(
    pp: int, num_subsequences: int, num_microbatches: int = 1
) -> dict[tuple[int, int, int], tuple[int, ...]]:
    """``(stage, microbatch, subsequence) -> ranks`` for every unit the "sppo" schedule multiplexes.

    Per micro-batch, the Left-SP and Right-SP units of ``msp_phases`` with their ranks ("sppo" runs
    the micro-batches one after another, each with its own warm-up and cool-down). The same ranks run
    a unit's forward and its backward: each keeps the activations of its shard. With fewer
    subsequences than stages a stage's Left and Right ranges may meet; a unit in both is Left-SP.
    """
    groups: dict[tuple[int, int, int], tuple[int, ...]] = {}
    for mb in range(num_microbatches):
        for stage in range(pp):
            for sub in range(max(num_subsequences - stage, 0), num_subsequences):
                groups[(stage, mb, sub)] = right_ranks(stage)
            for sub in range(min(pp - 1 - stage, num_subsequences)):
                groups[(stage, mb, sub)] = left_ranks(stage, pp)
    return {unit: ranks for unit, ranks in groups.items() if len(ranks) > 1}


def _stage_phases(i: int, pp: int, n: int) -> MSPPhase:
    left = set(range(0, pp - 1 - i))
    steady = set(range(pp - 1 - i, n - i))
    right = set(range(n - i, n))
    return {
        "left": left,
        "steady": steady,
        "right": right,
        "left_ranks": set(left_ranks(i, pp)) if left else set(),
        "right_ranks": set(right_ranks(i)) if right else set(),
    }


def _check(pp: int, num_subsequences: int) -> None:
    for name, value in (("pp", pp), ("num_subsequences", num_subsequences)):
        # bool is an int subclass; pp=True is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"msp_phases needs {name} to be an integer >= 1, got {name}={value!r}.")
    if num_subsequences < pp:
        raise ValueError(
            f"msp_phases needs num_subsequences >= pp, got num_subsequences={num_subsequences} < pp={pp}: with"
            " fewer subsequences than stages a stage's warm-up and cool-down would share subsequences and it"
            f" would have no steady phase. Use num_subsequences>={pp}."
        )
