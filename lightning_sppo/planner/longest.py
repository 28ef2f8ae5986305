"""``sppo-plan --max-seq-len``: the longest sequence a model trains on given hardware, and the plan there.

Whether some plan fits (``solver.fits``: the leanest configurations of every layout, stopping at the first fit) is
the predicate; it is monotone in the length as far as the memory model goes (every term grows with S), so the
longest length is found by doubling from ``start`` until it fails, then bisecting between the last fit and the
first miss down to ``granularity`` tokens. ``solve`` then plans the length found, for the fastest plan that fits
there (not necessarily the leanest). The answer is a multiple of ``granularity``; that length plus ``granularity``
does not fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from lightning_sppo.planner.plan import NoFeasiblePlan, Plan, PlanRequest
from lightning_sppo.planner.solver import fits, solve

__all__ = ["DEFAULT_GRANULARITY", "Longest", "longest_sequence"]

DEFAULT_GRANULARITY = 1024
"""Tokens the answer is rounded down to: a multiple of sp * 128 for every sp up to 8."""
_START = 64 * 1024


@dataclass(frozen=True)
class Longest:
    """The longest length that fits, its plan, and how it was found."""

    seq_len: int
    plan: Plan
    granularity: int
    probes: list[tuple[int, bool]]
    """Every length tried and whether it fit, in order."""
    seconds: float
    """Wall time of the search and the final plan."""
    limit: int | None
    """The longest length the model allows (an explicit block size), when it stopped the search."""


def longest_sequence(
    request: PlanRequest, granularity: int = DEFAULT_GRANULARITY, start: int = _START, limit: int | None = None
) -> Longest:
    """The longest multiple of ``granularity`` that fits ``request`` (its ``seq_len`` is ignored), and its plan.

    ``limit``: the longest length to consider (the model's fixed block size); None raises the block size with the
    length, as ``sppo-plan`` does past a preset's context. Raises ``NoFeasiblePlan`` when not even ``granularity``
    tokens fit.
    """
    if granularity < 1 or start < granularity:
        raise ValueError(f"granularity must be >= 1 and start >= granularity, got {granularity} and {start}.")
    began = time.perf_counter()
    probes: list[tuple[int, bool]] = []

    def fit(length: int) -> bool:
        ok = fits(_at(request, length))
        probes.append((length, ok))
        return ok

    low, high = 0, start - start % granularity
    while (limit is None or high <= limit) and fit(high):
        low, high = high, 2 * high
    if limit is not None and high > limit:
        high = limit - limit % granularity + granularity  # the first length past the limit
    if low == 0:
        low, high = _below(fit, granularity, high)
    while high - low > granularity:
        middle = (low + high) // 2
        middle -= middle % granularity
        low, high = (middle, high) if fit(middle) else (low, middle)
    if low == 0:
        plan = solve(_at(request, granularity))  # raises the reason nothing fits
        raise NoFeasiblePlan(f"not even {granularity} tokens fit, yet {plan}", "gpu", 0)  # pragma: no cover
    plan = solve(_at(request, low))
    capped = limit if limit is not None and low + granularity > limit else None
    return Longest(low, plan, granularity, probes, time.perf_counter() - began, capped)


def _below(fit, granularity: int, high: int) -> tuple[int, int]:
    """(a length that fits or 0, a length that does not) when ``high`` does not fit: halve down to ``granularity``."""
    while high > granularity:
        half = high // 2 - (high // 2) % granularity
        if fit(half):
            return half, high
        high = half
    return 0, high


def _at(request: PlanRequest, length: int) -> PlanRequest:
    """The request at ``length`` tokens, its model's block size raised to the length when shorter."""
    config = request.config
    if config.block_size < length:
        config = replace(config, block_size=length)
    return replace(request, config=config, seq_len=length)
