"""``sppo-plan --max-seq-len``: the longest sequence a model trains on given hardware, and the plan there.

Whether some plan fits (``solver.fits``: the leanest configurations of every layout, stopping at the first fit) is
the predicate; it is monotone in the length as far as the memory model goes (every term grows with S), so the
longest length is found by doubling from ``start`` until it fails, then bisecting between the last fit and the
first miss down to ``granularity`` tokens. ``solve`` then plans the length found, for the fastest plan that fits
there (not necessarily the leanest). The answer is a multiple of ``granularity``; that length plus ``granularity``
does not fit.

With ``max_step_time_s`` (``--max-step-time``) the answer is also the longest whose fastest plan's predicted step
takes at most that long: from the longest that fits, when its step is too slow, a bisection below it on the step time
of ``solve`` (the step grows with the length), started from the length the step's quadratic growth predicts.
"""

from __future__ import annotations

import math
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
    max_step_time_s: float | None = None
    """The step-time limit asked for (``--max-step-time``), if any."""
    memory_seq_len: int | None = None
    """With a step-time limit: the longest length memory alone allows, and its step time."""
    memory_step_time_s: float | None = None


def longest_sequence(
    request: PlanRequest,
    granularity: int = DEFAULT_GRANULARITY,
    start: int = _START,
    limit: int | None = None,
    max_step_time_s: float | None = None,
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
    if max_step_time_s is None or plan.step_time_s <= max_step_time_s:
        return Longest(low, plan, granularity, probes, time.perf_counter() - began, capped, max_step_time_s)
    fitting, slow = low, plan.step_time_s
    low, plan = _within(request, low, plan, granularity, max_step_time_s, probes)
    return Longest(low, plan, granularity, probes, time.perf_counter() - began, None, max_step_time_s, fitting, slow)


def _within(
    request: PlanRequest, high: int, slow: Plan, granularity: int, seconds: float, probes: list[tuple[int, bool]]
) -> tuple[int, Plan]:
    """The longest multiple of ``granularity`` below ``high`` (whose plan ``slow`` takes longer than ``seconds``)
    whose fastest plan takes at most ``seconds`` per step, and that plan; ``NoFeasiblePlan`` when none does."""
    lean = replace(request, compare_ac=False)
    plans: dict[int, Plan] = {}

    def quick(length: int) -> bool:
        plans[length] = solve(_at(lean, length))
        ok = plans[length].step_time_s <= seconds
        probes.append((length, ok))
        return ok

    guess = int(high * math.sqrt(seconds / slow.step_time_s))  # the step grows about as the length squared
    guess = max(granularity, guess - guess % granularity)
    low = 0
    if quick(guess):
        low = guess
        probe = guess
        while low < high:  # grow by a quarter until too slow
            probe = min(high, probe + max(granularity, (probe // 4) - (probe // 4) % granularity))
            if probe >= high or not quick(probe):
                high = probe
                break
            low = probe
    else:
        high = guess
        while high > granularity:
            half = max(granularity, high // 2 - (high // 2) % granularity)
            if quick(half):
                low = half
                break
            high = half
    if low == 0:
        shortest = solve(_at(lean, granularity))
        raise NoFeasiblePlan(
            f"no length trains within --max-step-time={seconds:g} s: the shortest, {granularity} tokens, takes"
            f" {shortest.step_time_s:.3g} s per step; raise --max-step-time", "time", 0,
        )  # fmt: skip
    while high - low > granularity:
        middle = (low + high) // 2
        middle -= middle % granularity
        low, high = (middle, high) if quick(middle) else (low, middle)
    return low, solve(_at(request, low))


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
