"""Offload ratios alpha_i for one planned stage: the offloader's own rule, fed with predicted costs.

The rule lives in ``lightning_sppo.offload.policy`` (SPPO section 5.2): alpha_i A_i = M_threshold with
M_threshold / BW_D2H = the next subsequence's forward time, alpha non-increasing, alpha_{N-1} = 0. The
planner only predicts A_i and the forward times and reads back the device peak max_i (M_{i-1} + A_i)
and the host bytes; it never re-derives the rule.

Time the copies cost, as the offloader schedules them: D2H of i runs during forward i+1, and the compute
stream waits for it at the end of that forward; H2D of i runs during backward i+1 and is waited for
before backward i. Whatever a copy takes beyond the compute it hides behind is charged to that action.
Under "adaptive" the forward copies fit by construction; "full" may expose time where copies are long.

Under the "sppo" schedule a stage's shared units (computed with helpers) never reach the offloader: ``shared``
names them; they keep alpha = 0, and the rule runs over the others by their subsequence index, as the offloader
does (a unit whose predecessor was shared starts from alpha_{i-1} = 1).
"""

from __future__ import annotations

import itertools
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
    """Seconds before backward i waits for its H2D beyond backward i+1 (and, for the last, its round trip)."""


def plan_offload(
    policy: str,
    level2: Sequence[int],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    costs: CostModel,
    shared: frozenset[int] = frozenset(),
) -> OffloadPlan:
    """alpha, device peak, host bytes and exposed copy time of one stage under ``policy``.

    ``shared``: subsequences the stage computes with helpers ("sppo"); they are not offloaded, and the device
    peak is then over the other units only (the "sppo" planner walks the schedule for the whole peak).
    """
    d2h_bytes_per_s = costs.profile.d2h_gbps * 1e9
    rule_costs = OffloadCosts(d2h_bytes_per_s=d2h_bytes_per_s, forward_s=tuple(forward_s))
    alpha = _alphas(policy, level2, rule_costs, shared)
    offloaded = [round(a * b) for a, b in zip(alpha, level2, strict=True)]
    alone = [i for i in range(len(level2)) if i not in shared]
    forward_wait = [0.0] * len(level2)
    backward_wait = [0.0] * len(level2)
    for i, j in itertools.pairwise(alone):  # the next unit the stage runs alone hides the copy
        forward_wait[j] = max(0.0, costs.d2h(offloaded[i]) - forward_s[j])
        backward_wait[i] = max(0.0, costs.h2d(offloaded[i]) - backward_s[j])
    if alone:  # the last one's backward follows at once: nothing hides its round trip
        backward_wait[alone[-1]] = costs.d2h(offloaded[alone[-1]]) + costs.h2d(offloaded[alone[-1]])
    return OffloadPlan(
        policy=policy,
        alpha=tuple(alpha),
        device_peak=peak_saved_bytes([level2[i] for i in alone], [offloaded[i] for i in alone]),
        host_bytes=sum(offloaded),
        forward_wait=tuple(forward_wait),
        backward_wait=tuple(backward_wait),
    )


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
