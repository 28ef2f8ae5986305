"""Offload ratios alpha_i for one planned stage: the offloader's own rule, fed with predicted costs.

The rule lives in ``lightning_sppo.offload.policy`` (SPPO section 5.2): alpha_i A_i = M_threshold with
M_threshold / BW_D2H = the next subsequence's forward time, alpha non-increasing, alpha_{N-1} = 0. The
planner only predicts A_i and the forward times and reads back the device peak max_i (M_{i-1} + A_i)
and the host bytes; it never re-derives the rule.

Time the copies cost, as the offloader schedules them (``offload/offloader.py``), on its one copy stream where both
directions queue behind each other (``_copy_waits`` replays it): the D2H of i starts when forward i is done and runs
during forward i+1, at whose end the compute stream waits for it; the last subsequence's D2H runs during its own
backward (its device copy is kept: no round trip), and the step waits for it at that backward's end; the H2D of i-1
is queued when backward i starts (behind whatever the stream still has), and backward i-1 waits for it. Each copy
costs its bytes at the link's rate plus ``HardwareProfile.copy_unit_s`` per saved tensor it moves. Under "adaptive"
the forward copies fit by construction; "full" exposes time where copies are long.

Under the "sppo" schedule a stage's shared units (computed with helpers) never reach the offloader: ``shared``
names them; they keep alpha = 0, and the rule runs over the others by their subsequence index, as the offloader
does (a unit whose predecessor was shared starts from alpha_{i-1} = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_sppo.offload.policy import OffloadCosts, adaptive_alpha, alphas, peak_saved_bytes
from lightning_sppo.planner.costs import CostModel

__all__ = ["OffloadPlan", "plan_offload"]


@dataclass(frozen=True)
class OffloadPlan:
    """One stage's offload decision and what it costs."""

    policy: str
    alpha: tuple[float, ...]
    device_peak: int
    """Peak level-2 bytes on the device, max_i (M_{i-1} + A_i)."""
    host_bytes: int
    """Pinned host bytes: every offloaded share stays there until its backward."""
    forward_wait: tuple[float, ...]
    """Seconds forward i waits for the D2H of i-1 beyond its own compute."""
    backward_wait: tuple[float, ...]
    """Seconds before backward i waits for its H2D beyond backward i+1 (and, for the last, its own D2H)."""
    first_backward_peak: int = 0
    """Level-2 bytes on the device during the step's first backward (the last subsequence's): before any gradient."""
    backward_peak: int = 0
    """The most level-2 bytes on the device during a later backward, when the step's gradients exist: the parts of
    earlier subsequences not offloaded, this one's, and the previous one's fetched back (``backward_residency``)."""


def plan_offload(
    policy: str,
    level2: Sequence[int],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    costs: CostModel,
    shared: frozenset[int] = frozenset(),
    units: Sequence[int] | None = None,
) -> OffloadPlan:
    """alpha, device peak, host bytes and exposed copy time of one stage under ``policy``.

    ``shared``: subsequences the stage computes with helpers ("sppo"); they are not offloaded, and the device
    peak is then over the other units only (the "sppo" planner walks the schedule for the whole peak). ``units``:
    saved tensors of each subsequence (each copy's fixed cost; None: not charged).
    """
    d2h_bytes_per_s = costs.profile.d2h_gbps * 1e9
    rule_costs = OffloadCosts(d2h_bytes_per_s=d2h_bytes_per_s, forward_s=tuple(forward_s))
    alpha = _alphas(policy, level2, rule_costs, shared)
    offloaded = [round(a * b) for a, b in zip(alpha, level2, strict=True)]
    alone = [i for i in range(len(level2)) if i not in shared]
    forward_wait, backward_wait = _copy_waits(
        alone, offloaded, forward_s, backward_s, costs, units or [0] * len(level2), level2
    )
    first, later = backward_residency([level2[i] for i in alone], [offloaded[i] for i in alone])
    return OffloadPlan(
        first_backward_peak=first,
        backward_peak=later,
        policy=policy,
        alpha=tuple(alpha),
        device_peak=peak_saved_bytes([level2[i] for i in alone], [offloaded[i] for i in alone]),
        host_bytes=sum(offloaded),
        forward_wait=tuple(forward_wait),
        backward_wait=tuple(backward_wait),
    )


def backward_residency(level2: Sequence[int], offloaded: Sequence[int]) -> tuple[int, int]:
    """(level 2 on the device in the first backward, the most in a later one). During backward i the device holds the
    kept parts of 0..i-1, all of i (kept, or fetched back), and the offloaded part of i-1 being fetched; later
    subsequences' are freed."""
    kept = [a - o for a, o in zip(level2, offloaded, strict=True)]
    resident, before = [], 0
    for i, a in enumerate(level2):
        resident.append(before + a + (offloaded[i - 1] if i else 0))
        before += kept[i]
    if not resident:
        return 0, 0
    return resident[-1], max(resident[:-1], default=0)


def _copy_waits(
    order: Sequence[int],
    offloaded: Sequence[int],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    costs: CostModel,
    units: Sequence[int],
    level2: Sequence[int],
) -> tuple[list[float], list[float]]:
    """Seconds each forward and backward waits for copies: the offloader's protocol replayed on one timeline, with one
    copy stream for both directions (module docstring). ``order``: the subsequences this stage runs alone."""
    n = len(forward_s)
    forward_wait, backward_wait = [0.0] * n, [0.0] * n
    if not order or not any(offloaded[i] for i in order):
        return forward_wait, backward_wait

    def copy(nbytes: int, index: int, rate: float) -> float:
        share = nbytes / level2[index] if level2[index] else 0.0
        return nbytes / rate + share * units[index] * costs.profile.copy_unit_s if nbytes else 0.0

    d2h, h2d = costs.profile.d2h_gbps * 1e9, costs.profile.h2d_gbps * 1e9
    now, stream, done = 0.0, 0.0, {}
    for previous, i in zip([None, *order[:-1]], order, strict=True):
        now += forward_s[i]
        stream = max(stream, now) + copy(offloaded[i], i, d2h)  # D2H of i, after its forward
        done[i] = stream
        if previous is not None and offloaded[previous]:  # the end of forward i waits for the D2H of i - 1
            forward_wait[i] = max(0.0, done[previous] - now)
            now += forward_wait[i]
    fetched = {}
    for k, i in enumerate(reversed(order)):
        before = order[len(order) - k - 2] if k + 1 < len(order) else None
        if i in fetched:  # prefetched during the backward after it
            backward_wait[i] = max(0.0, fetched[i] - now)
            now += backward_wait[i]
        if before is not None and offloaded[before]:  # fetched now, behind what the stream still has
            stream = max(stream, now) + copy(offloaded[before], before, h2d)
            fetched[before] = stream
        now += backward_s[i]
        if k == 0 and offloaded[i]:  # the last subsequence's own D2H, waited for at the end of its backward
            backward_wait[i] += max(0.0, done[i] - now)
            now = max(now, done[i])
    return forward_wait, backward_wait


def _alphas(policy: str, level2: Sequence[int], costs: OffloadCosts, shared: frozenset[int]) -> list[float]:
    """The offloader's rule (``Offloader._alpha``) over the units it sees; shared units keep everything."""
    if not shared:
        return alphas(policy, list(level2), costs)
    n, out = len(level2), []
    for i, a in enumerate(level2):
        if i in shared or policy == "none":
            out.append(0.0)
        elif policy == "full":
            out.append(1.0)
        else:
            previous = out[i - 1] if i and i - 1 not in shared else 1.0
            out.append(adaptive_alpha(i, n, a, previous, costs))
    return out
