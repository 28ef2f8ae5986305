"""The solver (SPPO section 6.1): search (SP, PP, N), keep what fits, pick the fastest the cost model scores.

What it searches:
* every (sp, pp) the runtime accepts: sp divides the heads (Ulysses) and fills part of a node or whole nodes (the
  paper's own GPT-65B layout runs SP=16 over two nodes); no preference for SP or PP inside a node: the cost model
  charges every link a message crosses, and the fastest wins wherever it runs;
* N on a grid of round values (``subsequence_counts``: every N of the paper's Table 4 is on it) from 16K tokens per
  device down to the cost model's shortest worthwhile subsequence (``shortest_tokens``: where a layer pass's fixed
  cost, launches plus the read of its weights from HBM, reaches a quarter of its matmuls; SPPO Figure 7), or 2K
  tokens per device where that is shorter; ``--num-subsequences`` pins N.

How it stays fast: best first. Every (layout, N) has a lower bound, the closed form over its passes alone at the
fastest costs allowed (``_bound``, cheap: no memory planning). Pairs are evaluated in ascending order of their bound
and the search stops when the next bound cannot beat the few fastest estimates found (``_threshold``: within 5% of
the fastest, and among the six fastest layouts). A layout's N enter lazily, past its lowest bound one by one. A
layout whose N fit only by trading time for memory learns what that costs (estimate over bound, ``_Frontier``) and
its other N are weighed with it. A layout that cannot fit at all is found before any evaluation where the bytes
say so (``_beyond_lean``), or by one evaluation of its leanest configuration when its first N does not fit.
What the search leaves out is counted (``Plan.pruned``).

For each (layout, N) the partition is the equal-FLOPs one (``partition.flops``, the paper's choice), or
the equal-length one when the FLOPs partition does not fit: its first subsequences are long, and the
first two are on the device together while the first is copied out. For each FSDP sync mode (how often
weights are gathered and gradients reduce-scattered, ``parallel/fsdp.py``) the offload policy is the
first of none / adaptive / full that fits (``planner.evaluate``), and the fastest mode that fits is kept.
Layouts are ranked by the closed form per sequence, step time / dp (a dp-way layout trains dp sequences
per step); the best few are simulated on the real schedule and the fastest simulated one wins.

The schedule is searched too: "seq1f1b", and "sppo" (Seq1F1B with multiplexed sequence partitioning), whose
helpers stream the other stages' weights and K/V piece by piece (``planner.multiplexed``); the fastest simulated
plan wins, whatever its schedule. Beside seq1f1b, "sppo" (whose evaluations cost far more) is tried at the few N
where seq1f1b is fastest on each layout; alone (``--schedule sppo``) it searches its own grid. Its closed form
leaves out what its simulation charges, so only seq1f1b's estimates set the threshold where there are any, and from
its best simulated N the search walks its grid while the simulated step falls (``_walk_sppo``).

What else a run may trade time for memory with (``planner.options``: recompute, K/V spilled to host, model state on
host) is tried cheapest first: per (layout, N), when the first allowed combination (no recompute, model state on
the device, all K/V on the device) fits under some sync mode, it is taken as the others are; otherwise every allowed
combination is evaluated under every sync mode and the fastest that fits (closed form) is kept; "sppo" as seq1f1b.

``longest_sequence`` answers "how long can I go?": a bisection over the length on the predicate "some leanest
configuration fits" (``fits``), then ``solve`` at the length found.

A request may fix sp, pp, N, the schedules, the offload policies, the sync modes and the partition policies it
allows (``PlanRequest``); the strategies do, for ``num_subsequences="auto"``. When nothing fits with fp32 dK/dV,
the message says whether the lossy ``--kv-grad-dtype=bf16`` would fit (the search re-run with it).

The words of every verdict (runner-ups and why they lost, the other schedules, why a layout or the whole request
does not fit) are ``planner.explain``'s.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner.advice import ac_advice, score_ac
from lightning_sppo.planner.costs import CostModel, resolve_attention
from lightning_sppo.planner.evaluate import Evaluation, Limits, evaluate, fixed_memory, stage_times, with_fsdp
from lightning_sppo.planner.explain import (
    lossy_fits,
    lossy_no_fit,
    lossy_short,
    no_plan,
    other_schedule,
    rejection,
    runner_up,
    tokens_per_gpu_per_s,
)
from lightning_sppo.planner.flops import block_matmul_params, sequence_model_flops
from lightning_sppo.planner.layer_plan import (
    best_layer_order,
    layer_order_fits,
    layer_order_misses,
    layer_order_plan,
    layer_order_refusal,
    layer_order_summary,
)
from lightning_sppo.planner.layout import Layout, Placement, StageSpec, candidate_layouts, placement, stage_specs
from lightning_sppo.planner.memory import (
    boundary_bytes,
    host_state_bytes,
    level1_bytes,
    level2_bytes,
    model_state_bytes,
    stage_parameter_counts,
)
from lightning_sppo.planner.multiplexed import SCHEDULE_NAME, shared_units
from lightning_sppo.planner.options import KV_AUTO, RECOMPUTE_ORDER
from lightning_sppo.planner.plan import NoFeasiblePlan, Plan, PlanRequest
from lightning_sppo.planner.precision import precision_bytes
from lightning_sppo.planner.step_time import StepTime, estimate_step_time, simulate_step_time
from lightning_sppo.planner.units import format_bytes

__all__ = ["BLOCK_TOKENS", "Assessment", "assess_layout", "fits", "granularity", "solve", "subsequence_counts"]

BLOCK_TOKENS = 128
"""Subsequence boundaries fall on multiples of sp * 128: whole attention tiles on every SP rank."""
_SIMULATED_LAYOUTS = 6
_SIMULATED_PER_LAYOUT = 2
_RUNNER_UPS = 4
_REPORTED = 0.25
"""How much slower than the fastest plan "sppo"'s fastest layout may be and still have its N walked for the report."""
_CONTENDING = 0.05
"""How much slower than the fastest estimate a candidate may be and still be searched and simulated: the simulated
seq1f1b step is within 0.5% of its closed form (the closed form takes the busiest stage for every stage), so one
estimated 5% slower cannot win the simulation."""


@dataclass(eq=False)
class _Search:
    """Everything tried for one layout under one schedule (what ``explain.Searched`` reads)."""

    layout: Layout
    pp_cross_node: bool
    schedule: str = "seq1f1b"
    feasible: list[tuple[float, Evaluation]] = field(default_factory=list)
    """(closed-form seconds per sequence, evaluation) of every N that fits."""
    closest: Evaluation | None = None
    """The failing evaluation that came closest to fitting."""
    skipped: str | None = None
    """Why the layout was not searched at all."""
    fixed_overflow: int = 0
    """Bytes over the device limit before any activation, when that is why it was skipped."""
    most_subsequences: int | None = None
    """The largest N the layout takes, when the request pins a larger one (why it was skipped)."""
    best: tuple[StepTime, Evaluation] | None = None
    """Its fastest simulated candidate, once simulated."""
    pruned: float | None = None
    """The lowest bound (seconds per sequence) of the N left out because they could not beat the fastest found."""

    @property
    def estimate(self) -> float:
        return min(t for t, _ in self.feasible)

    @property
    def per_sequence(self) -> float:
        """Simulated seconds per sequence of ``best``: a dp-way layout trains dp sequences per step."""
        return self.best[0].step_s / self.layout.dp

    @property
    def overflow(self) -> tuple[float, float]:
        """How far ``closest`` is over the limits (``_overflow``)."""
        return _overflow(self.closest)


def solve(request: PlanRequest) -> Plan:
    """The fastest layout and schedule that fit, or ``NoFeasiblePlan`` naming the limit and by how much. The layer order
    (``--order``, ``planner.layer_plan``) competes at every layout of one stage: the faster per sequence that fits
    wins."""
    refusal = layer_order_refusal(request)
    if refusal is not None and "subsequence" not in request.order:
        raise NoFeasiblePlan(f"--order layer cannot plan this request: {refusal}; allow --order subsequence.", "gpu", 0)
    if refusal is not None:
        return _solve_subsequence(request)
    layered = best_layer_order(request, _layer_costs(request), _grain(request))
    if "subsequence" not in request.order:
        if layered is None:
            raise NoFeasiblePlan(layer_order_misses(request), "gpu", 0)
        ac = score_ac(request) if request.compare_ac else None
        return layer_order_plan(request, layered, _grain(request), ac, [])
    try:
        plan = _solve_subsequence(request)
    except NoFeasiblePlan:
        if layered is None:
            raise
        ac = score_ac(request) if request.compare_ac else None
        return layer_order_plan(request, layered, _grain(request), ac, ["order=subsequence: no layout fits"])
    if layered is None or layered.per_sequence_s >= plan.seconds_per_sequence:
        lost = "order=layer: fits no configuration" if layered is None else layer_order_summary(request, layered)
        return replace(plan, other_schedules=[*plan.other_schedules, lost])
    lost = (
        f"order=subsequence: best sp={plan.sp} pp={plan.pp} dp={plan.dp} N={plan.num_subsequences},"
        f" {plan.tokens_per_gpu_per_s:.0f} tokens/GPU/s ({plan.schedule})"
    )
    return layer_order_plan(request, layered, _grain(request), plan.plain_ac, [lost])


def _layer_costs(request: PlanRequest):
    """The layer order's cost models: the run's on each layout (``cost_model``)."""
    return lambda layout, recompute, state: cost_model(request, layout, recompute, state)


def _grain(request: PlanRequest):
    return lambda sp: granularity(request, sp)


def _solve_subsequence(request: PlanRequest) -> Plan:
    """The fastest layout and schedule of the subsequence order that fit (``solve``)."""
    profile = request.profile
    limits = Limits(profile.hbm_bytes - profile.reserved_bytes, profile.host_bytes_per_gpu)
    partitions = _Partitions(request.seq_len, request.config, request.document_length)
    searches = _search_all(request, limits, partitions)
    fitting = sorted((s for s in searches if s.feasible), key=lambda s: s.estimate)
    if not fitting:
        raise no_plan(request, searches, limits, _lossy_hint)
    chosen = fitting[:_SIMULATED_LAYOUTS]
    for schedule in request.schedule:  # every schedule's best few, so the report can say why it lost
        chosen += [s for s in fitting if s.schedule == schedule][:_SIMULATED_LAYOUTS]
    for search in {id(s): s for s in chosen}.values():
        search.best = _simulate_best(search)
    _walk_sppo(request, limits, [s for s in fitting if s.best], partitions)
    simulated = sorted((s for s in fitting if s.best), key=lambda s: s.per_sequence)
    winner = simulated[0]  # the fastest wherever its pipeline runs: the cost model charges every link it crosses
    losers = simulated[1 : 1 + _RUNNER_UPS]
    return _plan(request, winner, losers, searches, simulated)


def fits(request: PlanRequest) -> bool:
    """Whether some plan fits the request: a search of its leanest configurations that stops at the first fit.

    Per layout, the largest N (the least activation and temporary bytes at once; where that misses, the smallest
    too: the least on host, ``_evaluate_lean``) under each allowed partition,
    recompute mode, model state place, sync mode and offload policy, with the request's K/V spill; seq1f1b only
    when allowed ("sppo" holds at least what seq1f1b holds on a layout). ``solve`` evaluates every one of these
    too, so when this says yes, ``solve`` finds a plan (``longest_sequence`` relies on it).
    """
    if layer_order_refusal(request) is None:
        layered = layer_order_fits(request, _layer_costs(request), _grain(request))
        if layered or "subsequence" not in request.order:
            return layered
    profile = request.profile
    limits = Limits(profile.hbm_bytes - profile.reserved_bytes, profile.host_bytes_per_gpu)
    schedule = "seq1f1b" if "seq1f1b" in request.schedule else SCHEDULE_NAME
    partitions = _Partitions(request.seq_len, request.config, request.document_length)
    for layout in _layouts(request):
        if request.seq_len % layout.sp:
            continue
        stages = stage_specs(request.config, layout.pp)
        where = placement(layout, profile.gpus_per_node)
        if _lean_fit(request, limits, layout, stages, where, partitions, schedule):
            return True
    return False


def _lean_fit(
    request: PlanRequest, limits: Limits, layout: Layout, stages: Sequence[StageSpec], where: Placement,
    partitions: _Partitions, schedule: str, search: _Search | None = None,
) -> bool:  # fmt: skip
    """Whether the layout's leanest configurations fit (``fits``): the leanest allowed recompute, sync mode and
    partition, at its largest N, under each model state place and offload policy, with the request's K/V spill.
    When none fits, the closest of them becomes ``search.closest`` (what the report says of the layout)."""
    if _beyond_lean(request, layout, schedule, stages, limits):
        return False
    return _evaluate_lean(request, limits, layout, stages, where, partitions, schedule, search)


def _evaluate_lean(
    request: PlanRequest, limits: Limits, layout: Layout, stages: Sequence[StageSpec], where: Placement,
    partitions: _Partitions, schedule: str, search: _Search | None = None,
) -> bool:  # fmt: skip
    """Evaluate the layout's leanest configurations (``_lean_fit``); whether one fits. Misses update
    ``search.closest``. At its largest N (the least on the device at once), and where that misses at its smallest:
    a host holding spilled K/V (chunks per subsequence) or offloaded activations holds more the more subsequences
    there are, so where the host binds fewer subsequences fit where more do not."""
    lean = _leanest(request)
    grain = granularity(request, layout.sp)
    combinations = _combinations(lean, schedule)
    counts = [n for n in _counts(request, layout) if _shareable_at(lean, layout, schedule, n, grain, partitions)]
    for n in dict.fromkeys(counts[-1:] + counts[:1]):  # the fewest device bytes, then the fewest host bytes
        for policy in lean.partition:
            lengths = partitions(policy, n, grain)
            if not _shareable(layout, schedule, lengths):
                continue
            evaluations = _evaluate_syncs(lean, limits, layout, lengths, policy, schedule, where, stages, combinations)
            if any(e.feasible for e in evaluations):
                return True
            if search is not None:
                search.closest = min([*evaluations, *filter(None, [search.closest])], key=_overflow)
    return False


def _leanest(request: PlanRequest) -> PlanRequest:
    """The request narrowed to what holds the least at once."""
    return replace(
        request,
        recompute=request.recompute[-1:],  # the fewest bytes kept
        fsdp_sync=("regather",) if "regather" in request.fsdp_sync else request.fsdp_sync,  # the fewest gathered
        partition=("length",) if "length" in request.partition else request.partition,  # the shortest longest
    )


def _beyond_lean(
    request: PlanRequest, layout: Layout, schedule: str, stages: Sequence[StageSpec], limits: Limits
) -> bool:
    """Whether even the leanest configuration is over the limits before any evaluation: its fixed device bytes, or
    what some stage must keep on the device and host together (``_beyond_capacity``)."""
    lean = _leanest(request)
    return _fixed_bytes(lean, layout, schedule, stages) > limits.gpu_bytes or _beyond_capacity(
        lean, layout, stages, limits
    )


def _beyond_capacity(request: PlanRequest, layout: Layout, stages: Sequence[StageSpec], limits: Limits) -> bool:
    """Whether some stage must keep more than its device and host limits together, wherever things go
    (``_least_kept``): a bound no N, offload, spill or sync mode can get under."""
    return _least_kept(request, layout, stages) > limits.gpu_bytes + limits.host_bytes


def _least_kept(request: PlanRequest, layout: Layout, stages: Sequence[StageSpec]) -> int:
    """The most any stage must keep on its device and host together, wherever things go: its model state, its K/V
    and dK/dV, the level 2 its blocks keep of the whole sequence under the leanest allowed recompute, and its
    messages."""
    recompute = request.recompute[-1]
    most = 0
    for stage in stages:
        least = math.inf
        for state in request.model_state:
            costs = cost_model(request, layout, recompute, state)
            params = stage_parameter_counts(request.config, stage)
            shards = layout.dp * layout.sp
            held = min(
                sum(model_state_bytes(params, costs.dtypes, shards, sync, state == "host"))
                for sync in _syncs(request, layout, state)
            )
            held += host_state_bytes(params, shards) if state == "host" else 0
            level1 = sum(
                level1_bytes(request.config, costs.dtypes, stage, request.seq_len, layout.sp, request.batch_size)
            )
            level2 = sum(
                level2_bytes(
                    request.config, costs.dtypes, stage, [request.seq_len], layout.sp, request.batch_size, recompute
                )
            )
            boundary = boundary_bytes(
                request.config, costs.dtypes, stage, request.seq_len, layout.sp, request.batch_size
            )
            least = min(least, held + level1 + level2 + boundary)
        most = max(most, least)
    return most


_SPPO_COUNTS = 3
"""How many of seq1f1b's fastest N per layout "sppo" is evaluated at."""


@dataclass(eq=False)
class _Frontier:
    """One search's N still to try, in ascending order; each gets its lower bound (``_bound``) when it is drawn."""

    search: _Search
    stages: Sequence[StageSpec]
    where: Placement
    grain: int
    counts: list[int]
    costs: CostModel
    """The fastest costs the request allows on the layout (least recompute, model state on the device)."""
    next: int = 0
    last_bound: float = math.inf
    lean: bool = False
    """Whether its leanest configurations are known to fit (``_lean_fit``), checked when its first N does not fit."""
    overhead: float = 1.0
    """The least estimate / bound ratio of its N that fit: what memory made it trade (recompute, copies, spill, host
    state) costs alike at neighbouring N, so an N whose bound times this cannot win is not evaluated."""


def _search_all(request: PlanRequest, limits: Limits, partitions: _Partitions) -> list[_Search]:
    """One search per candidate layout and allowed schedule, best first across all of them (``_best_first``).

    "sppo" holds at least what seq1f1b holds on a layout (the stage's own state and units, plus streamed pieces and
    the shares of shared units), and its evaluations cost far more (a schedule per N, every stage walked on its own):
    when seq1f1b is allowed too, "sppo" is evaluated only at the few N where seq1f1b is fastest on that layout
    (``_SPPO_COUNTS``): not at all where seq1f1b fits at no N or was left out by its bound. Its fastest layout, and
    any that contend, walk on from there (``_walk_sppo``).
    """
    searches, first, later = [], [], []
    for layout in _layouts(request):
        where = placement(layout, request.profile.gpus_per_node)
        for schedule in _schedules(request, layout):
            search = _Search(layout, where.pp_cross_node, schedule)
            searches.append(search)
            if schedule == SCHEDULE_NAME and "seq1f1b" in request.schedule:
                later.append(search)
            else:
                first.append(_open(request, limits, search, partitions))
    _best_first(request, limits, searches, [f for f in first if f and f.lean is not None], partitions)
    plain = {s.layout: s for s in searches if s.schedule == "seq1f1b"}
    learned = {f.search.layout: f.overhead for f in first if f and f.search.schedule == "seq1f1b"}
    second = []
    for search in later:
        other = plain[search.layout]
        if other.pruned is not None and not other.feasible:
            search.pruned = other.pruned  # no N of seq1f1b's to try it at
            continue
        fastest = sorted(other.feasible, key=lambda pair: pair[0])[:_SPPO_COUNTS]
        frontier = _open(request, limits, search, partitions, {e.num_subsequences for _, e in fastest})
        if frontier and search.layout in learned:  # "sppo" holds more than seq1f1b: its trades cost no less
            frontier.overhead = learned[search.layout]
        second.append(frontier)
    _best_first(request, limits, searches, [f for f in second if f and f.lean is not None], partitions)
    _say_why(request, limits, searches, [f for f in first + second if f and f.lean is None], partitions)
    return searches


def _walk_sppo(request: PlanRequest, limits: Limits, simulated: Sequence[_Search], partitions: _Partitions) -> None:
    """The closed form of "sppo" leaves out what its simulation charges, so the N it ranks first (alone), or seq1f1b's
    fastest N (beside it: many, to shrink the bubble "sppo" fills anyway), need not be its fastest. For each layout
    within ``_CONTENDING`` of the fastest plan (alone: its fastest layout at least), walk the grid from its best N,
    either way, while the simulated step keeps falling; beside seq1f1b, search its grid first (``_search_grid``).
    Its fastest layout is walked too where it is within ``_REPORTED`` of the fastest plan (what the report says of it);
    one further behind is not: walking a long pipeline's grid costs more than the report gains."""
    if SCHEDULE_NAME not in request.schedule or not simulated:
        return
    fastest = min(s.per_sequence for s in simulated)
    ours = sorted((s for s in simulated if s.schedule == SCHEDULE_NAME), key=lambda s: s.per_sequence)
    for search in ours:
        contends = search.per_sequence <= (1 + _CONTENDING) * fastest
        if contends or (search is ours[0] and search.per_sequence <= (1 + _REPORTED) * fastest):
            frontier = _open(request, limits, search, partitions)
            if frontier is None:
                continue
            if contends and "seq1f1b" in request.schedule:
                _search_grid(request, limits, frontier, partitions)
            # Neighbouring N keep the memory modes of the best one: its recompute mode and model state place only.
            best = search.best[1]
            narrowed = replace(request, recompute=(best.recompute,), model_state=(best.model_state,))
            _walk(narrowed, limits, frontier, partitions)


def _search_grid(request: PlanRequest, limits: Limits, frontier: _Frontier, partitions: _Partitions) -> None:
    """Beside seq1f1b, "sppo" was tried at seq1f1b's fastest N only; where it contends, search its own grid as it is
    searched alone (best first on its estimates, its best few simulated), so ``auto`` is no slower than either
    schedule alone."""
    search, counts = frontier.search, frontier.counts
    tried = {e.num_subsequences for _, e in search.feasible}
    frontier.counts = [n for n in counts if n not in tried]
    if not frontier.counts:
        frontier.counts = counts
        return
    alone = _Search(search.layout, search.pp_cross_node, search.schedule, list(search.feasible))
    frontier.search = alone
    _best_first(request, limits, [alone], [frontier], partitions)
    frontier.search, frontier.counts = search, counts
    search.feasible = alone.feasible
    best = _simulate_best(alone)
    if best[0].step_s < search.best[0].step_s:
        search.best = best


def _walk(request: PlanRequest, limits: Limits, frontier: _Frontier, partitions: _Partitions) -> None:
    """Move the search's best to the neighbouring N of its grid while that is faster simulated (one way only, once
    a step that way was faster)."""
    search, counts = frontier.search, frontier.counts
    start = counts.index(search.best[1].num_subsequences)
    for direction in (-1, 1):
        i, moved = start + direction, False
        while 0 <= i < len(counts):
            candidate = _simulated_at(request, limits, frontier, partitions, counts[i])
            if candidate is None or candidate[0].step_s >= search.best[0].step_s:
                break
            search.best, moved, i = candidate, True, i + direction
        if moved:
            return


def _simulated_at(
    request: PlanRequest, limits: Limits, frontier: _Frontier, partitions: _Partitions, n: int
) -> tuple[StepTime, Evaluation] | None:
    """The search's fastest fit at N (evaluated now unless it was before), simulated; None when N does not fit."""
    search = frontier.search
    known = [e for _, e in search.feasible if e.num_subsequences == n]
    if not known:
        before = len(search.feasible)
        _try(request, limits, frontier, partitions, n)
        known = [e for _, e in search.feasible[before:]]
    return (simulate_step_time(known[0]), known[0]) if known else None


def _say_why(
    request: PlanRequest, limits: Limits, searches: Sequence[_Search], frontiers: Sequence[_Frontier],
    partitions: _Partitions,
) -> None:  # fmt: skip
    """What the report says of layouts that fit at no N, found from their bytes (``_open``): the bytes that rule
    them out. Where nothing fits, the one of each kind closest by its bytes, per schedule, is evaluated too (the
    message names the closest layout's limits): over the device before any activation, at its smallest N; over the
    device and host together (``_beyond_capacity``), its leanest configurations. Evaluating every such layout would
    take minutes at tens of millions of tokens."""
    lean = _leanest(request)
    capacity = [f for f in frontiers if not f.search.fixed_overflow]
    kept = {id(f): _least_kept(lean, f.search.layout, f.stages) for f in capacity}
    if not any(s.feasible for s in searches):
        for schedule in request.schedule:
            over = [f for f in frontiers if f.search.schedule == schedule and f.search.fixed_overflow]
            if over:
                closest = min(over, key=lambda f: f.search.fixed_overflow)
                _try(request, limits, closest, partitions, closest.counts[0])
            beyond = [f for f in capacity if f.search.schedule == schedule]
            if beyond:
                closest = min(beyond, key=lambda f: kept[id(f)])
                search = closest.search
                _evaluate_lean(
                    request, limits, search.layout, closest.stages, closest.where, partitions, schedule, search
                )
    for frontier in capacity:
        frontier.search.skipped = (
            "fits at no N: the least its fullest stage must keep on the device and host together"
            f" ({format_bytes(kept[id(frontier)])}) is over their {format_bytes(limits.gpu_bytes + limits.host_bytes)}"
        )


def _best_first(
    request: PlanRequest, limits: Limits, searches: Sequence[_Search], frontiers: Sequence[_Frontier],
    partitions: _Partitions,
) -> None:  # fmt: skip
    """Evaluate every (layout, schedule, N) in ascending order of its lower bound (``_bound``) until the next bound
    cannot beat the ``_SIMULATED_LAYOUTS`` fastest searches found (``_threshold``); what is left is ``pruned``.

    A layout's N enter lazily, in ascending order: up to the one past its lowest bound at once, then each when the
    one before it is evaluated. The bound is convex in N (the bubble falls as 1/N, the fixed costs per subsequence
    grow with N), so past its minimum no later N has a lower bound than one already drawn.
    """
    heap: list[tuple[float, int, int, _Frontier]] = []
    order = itertools.count()
    for frontier in frontiers:
        _advance(request, frontier, partitions, heap, order)
    left = []
    while heap:
        bound, _, n, frontier = heapq.heappop(heap)
        threshold = _threshold(searches)
        if bound >= threshold:
            left += [(bound, frontier)] + [(b, f) for b, _, _, f in heap]
            break
        _advance(request, frontier, partitions, heap, order)
        expected = bound * frontier.overhead
        if expected >= threshold:
            left.append((expected, frontier))
        elif not _beaten(frontier.search, expected):
            _try(request, limits, frontier, partitions, n, bound)
            if not frontier.search.feasible and not _lean(request, limits, frontier, partitions):
                _drop(frontier, heap)
    for bound, frontier in left:  # left out: what the report says of them
        search = frontier.search
        search.pruned = min(bound, math.inf if search.pruned is None else search.pruned)


def _advance(
    request: PlanRequest, frontier: _Frontier, partitions: _Partitions, heap: list, order: Iterator[int]
) -> None:
    """Draw the frontier's next N, and the ones after it while their bounds still fall."""
    while frontier.next < len(frontier.counts):
        n = frontier.counts[frontier.next]
        frontier.next += 1
        bound = _bound(frontier, partitions(request.partition[0], n, frontier.grain))
        heapq.heappush(heap, (bound, next(order), n, frontier))
        previous, frontier.last_bound = frontier.last_bound, bound
        if bound >= previous:
            return


def _lean(request: PlanRequest, limits: Limits, frontier: _Frontier, partitions: _Partitions) -> bool:
    """Whether the frontier's layout fits at some N at all (``_lean_fit``, once: its evaluations are the costliest)."""
    if not frontier.lean:
        search = frontier.search
        where, stages = frontier.where, frontier.stages
        frontier.lean = _lean_fit(request, limits, search.layout, stages, where, partitions, search.schedule, search)
        if not frontier.lean and search.closest is None:  # over the limits before any activation: N changes nothing
            _try(request, limits, frontier, partitions, frontier.counts[0])
    return frontier.lean


def _drop(frontier: _Frontier, heap: list) -> None:
    """Take the frontier's N out of the search: none of them fits."""
    heap[:] = [item for item in heap if item[3] is not frontier]
    heapq.heapify(heap)
    frontier.next = len(frontier.counts)


def _threshold(searches: Sequence[_Search]) -> float:
    """The estimate a search must beat to matter: within ``_CONTENDING`` of the fastest found, and among the
    ``_SIMULATED_LAYOUTS`` fastest (inf until one fits). Seq1f1b's estimates set it where there are any: "sppo"'s
    closed form leaves out what its simulation charges (streams waited for across ranks), so it may be far lower."""
    closed = [s for s in searches if s.feasible and (s.schedule != SCHEDULE_NAME or s.layout.pp == 1)]
    estimates = sorted(s.estimate for s in closed or [s for s in searches if s.feasible])
    if not estimates:
        return math.inf
    kth = estimates[_SIMULATED_LAYOUTS - 1] if len(estimates) >= _SIMULATED_LAYOUTS else math.inf
    return min(kth, (1 + _CONTENDING) * estimates[0])


def _open(
    request: PlanRequest, limits: Limits, search: _Search, partitions: _Partitions, only: set[int] | None = None
) -> _Frontier | None:
    """The search's N to try, or None when there is nothing to search: the layout is skipped (``search.skipped``
    says why), or its fixed bytes are over the device at every N (one evaluation says by how much). ``only``: the N
    to try ("sppo" beside seq1f1b; an empty set: seq1f1b fits at no N there)."""
    layout, schedule = search.layout, search.schedule
    config, sp = request.config, layout.sp
    if request.seq_len % sp:
        search.skipped = f"--seq-len={request.seq_len} is not divisible by sp={sp} (each SP rank takes 1/sp)"
        return None
    grain = granularity(request, sp)
    counts = _counts(request, layout)
    if not counts:
        search.most_subsequences = request.seq_len // grain
        search.skipped = (
            f"--num-subsequences={request.num_subsequences} leaves fewer than {grain} tokens per subsequence at"
            f" sp={sp} (whole {BLOCK_TOKENS}-token tiles on every SP rank); use --num-subsequences<="
            f"{request.seq_len // grain}"
        )
        return None
    counts = [n for n in counts if _shareable_at(request, layout, schedule, n, grain, partitions)]
    if not counts:
        search.skipped = (
            f"schedule=sppo shares each subsequence among up to pp={layout.pp} ranks, at least one token each per SP"
            f" rank: --seq-len={request.seq_len} at sp={sp} is too short for every N"
            + (f" (--num-subsequences={request.num_subsequences})" if request.num_subsequences is not None else "")
        )
        return None
    stages = stage_specs(config, layout.pp)
    where = placement(layout, request.profile.gpus_per_node)
    fixed = _fixed_bytes(request, layout, schedule, stages)
    if fixed > limits.gpu_bytes:  # no N fits: the fixed bytes say why
        search.fixed_overflow = fixed - limits.gpu_bytes
        search.skipped = (
            f"{'schedule=sppo ' if schedule == SCHEDULE_NAME else ''}needs {format_bytes(fixed)} per GPU before any"
            f" activation (+{format_bytes(search.fixed_overflow)}): model state and K/V + {request.kv_grad_dtype} dK/dV"
        )
        if schedule == SCHEDULE_NAME and layout.pp > 1:  # its schedule is long to build at large pp and N
            return None
    costs = cost_model(request, layout, _fastest_recompute(request))
    frontier = _Frontier(search, stages, where, grain, counts, costs)
    if only == set():
        search.skipped = f"seq1f1b fits at no N on {layout}, and schedule=sppo holds at least what seq1f1b holds"
        return None
    if fixed > limits.gpu_bytes or _beyond_lean(request, layout, schedule, stages, limits):
        frontier.lean = None  # fits at no N: evaluated for the message only if nothing fits (``_say_why``)
        return frontier
    if only is not None:
        frontier.counts, frontier.lean = [n for n in counts if n in only], True
    return frontier


def _counts(request: PlanRequest, layout: Layout) -> list[int]:
    """The N to search on ``layout``: the pinned one (none when it cuts finer than the layout's granules), else the
    grid from the request's longest subsequence per device to the cost model's shortest (``shortest_tokens``), or 2K
    tokens per device where that is shorter."""
    grain = granularity(request, layout.sp)
    if request.num_subsequences is not None:
        return [request.num_subsequences] if request.num_subsequences <= request.seq_len // grain else []
    shortest = request.min_tokens_per_device or min(_PAPER_SHORTEST, shortest_tokens(cost_model(request, layout)))
    return subsequence_counts(request.seq_len, layout.sp, grain, shortest, request.max_tokens_per_device)


_PAPER_SHORTEST = 2048
"""The search goes down to 2K tokens per device at least (SPPO section 6.1's range) where the cost model's shortest is
longer (small models, whose fixed costs outweigh their matmuls): shorter subsequences still hold less memory."""


FIXED_SHARE = 0.25
"""The search's shortest subsequence: where a layer pass's fixed cost reaches this share of its matmul time."""


def shortest_tokens(costs: CostModel) -> int:
    """Tokens per device below which the search does not cut (``FIXED_SHARE``; SPPO Figure 7).

    At the N that minimises (p - 1 + N) / N * (W + N c) (W: a stage's work, c: its fixed cost per subsequence) the
    fixed costs N c are W (p - 1) / N, the same share of the work as the bubble (p - 1) / N: cutting so short that
    the fixed costs exceed a quarter of the matmuls pays only where the bubble would exceed a quarter of the step.
    """
    matmul_per_token = 2.0 * block_matmul_params(costs.config) / costs.profile.flops_per_s
    return max(BLOCK_TOKENS, math.ceil(costs.layer_fixed_s / (FIXED_SHARE * matmul_per_token)))


def _shareable(layout: Layout, schedule: str, lengths: Sequence[int]) -> bool:
    """Whether "sppo" can split every shared unit of these subsequences among its members: each member takes a
    contiguous block of at least one token of each SP rank's chunk (``parallel.multiplex.block_lengths``, as the
    runtime splits them). Always true for seq1f1b and for one stage."""
    if schedule != SCHEDULE_NAME or layout.pp == 1:
        return True
    units = shared_units(layout.pp, len(lengths))
    return all(lengths[sub] // layout.sp >= len(ranks) for subs in units.values() for sub, ranks in subs.items())


def _shareable_at(
    request: PlanRequest, layout: Layout, schedule: str, n: int, grain: int, partitions: _Partitions
) -> bool:
    """Whether some allowed partition into N subsequences is ``_shareable``: from the granules alone where they say
    so (every piece but the last is whole granules, the last at least the remainder: no partition is computed),
    else from the partitions."""
    if schedule != SCHEDULE_NAME or layout.pp == 1:
        return True
    seq_len = request.seq_len
    shortest = seq_len if n == 1 else min(grain, seq_len - (-(-seq_len // grain) - 1) * grain)
    if shortest // layout.sp >= layout.pp:  # no unit has more members than there are stages
        return True
    return any(_shareable(layout, schedule, partitions(policy, n, grain)) for policy in request.partition)


def _schedules(request: PlanRequest, layout: Layout) -> tuple[str, ...]:
    """With one stage "sppo" has no one to share with: it is seq1f1b, searched once when both are allowed."""
    if layout.pp == 1 and "seq1f1b" in request.schedule:
        return ("seq1f1b",)
    return request.schedule


def _layouts(request: PlanRequest) -> list[Layout]:
    """Candidate layouts, narrowed to the request's sp and pp when it fixes them."""
    layouts = candidate_layouts(request.config, request.world_size, request.profile.gpus_per_node)
    return [layout for layout in layouts if request.sp in (None, layout.sp) and request.pp in (None, layout.pp)]


def cost_model(request: PlanRequest, layout: Layout, recompute: str = "none", model_state: str = "device") -> CostModel:
    """Costs under the request's precision as the runtime applies it to ``layout`` (sharded when dp * sp > 1, or
    when model state lives on host: FSDP2's CPU offload runs even one rank as an FSDP mesh)."""
    sharded = layout.dp * layout.sp > 1 or model_state == "host"
    dtypes = precision_bytes(request.precision, sharded, request.kv_grad_dtype)
    key = (id(request.config), id(request.profile), dtypes, request.document_length, recompute, model_state,
           request.attention)  # fmt: skip
    cached = _COSTS.get(key)
    if cached is not None and cached.config is request.config and cached.profile is request.profile:
        return cached  # the same costs, and what they memoised (``CostModel._memo``)
    if len(_COSTS) > _COSTS_KEPT:
        _COSTS.clear()
    _COSTS[key] = CostModel(
        request.config, dtypes, request.profile, request.document_length, recompute, model_state, request.attention
    )
    return _COSTS[key]


_COSTS: dict[tuple, CostModel] = {}
"""Cost models by what they are made of (the configuration and profile by identity: a search's request keeps them)."""
_COSTS_KEPT = 64


def _combinations(request: PlanRequest, schedule: str) -> list[tuple[str, str]]:
    """(recompute, model_state) pairs to evaluate, the request's first choices first (every schedule alike)."""
    return [(recompute, state) for state in request.model_state for recompute in request.recompute]


def _kv_device_tokens(request: PlanRequest, schedule: str):
    """The request's K/V spill (every schedule alike)."""
    return request.kv_device_tokens


def granularity(request: PlanRequest, sp: int) -> int:
    """Boundaries on whole attention tiles of every SP rank, and on the request's own granularity."""
    return math.lcm(request.granularity, sp * BLOCK_TOKENS)


@dataclass(frozen=True)
class Assessment:
    """A given layout under the planner's model: whether it fits, and if so how fast it is."""

    feasible: bool
    offload: str
    peak_gpu_bytes: int
    peak_host_bytes: int
    step_time_s: float | None
    tokens_per_gpu_per_s: float | None
    bubble_ratio: float | None
    reason: str
    """Empty when it fits; otherwise the limit and by how much."""
    fsdp_sync: str = "step"
    schedule: str = "seq1f1b"


def assess_layout(
    request: PlanRequest, sp: int, pp: int, num_subsequences: int, partition: str = "flops"
) -> Assessment:
    """Evaluate one (sp, pp, N) the solver did not necessarily consider (e.g. a paper's choice), any placement,
    under the fastest of the request's schedules that fits."""
    layout = Layout(sp, pp, request.world_size // (sp * pp))
    if layout.world_size != request.world_size:
        raise ValueError(f"sp * pp = {sp * pp} must divide the {request.world_size} GPUs of the request.")
    config = request.config
    if config.n_head % sp or config.n_query_groups % sp:
        raise ValueError(
            f"--sp={sp} must divide the model's {config.n_head} heads and {config.n_query_groups} K/V groups"
            " (Ulysses gives each SP rank whole heads)."
        )
    profile = request.profile
    limits = Limits(profile.hbm_bytes - profile.reserved_bytes, profile.host_bytes_per_gpu)
    lengths = _Partitions(request.seq_len, request.config, request.document_length)(
        partition, num_subsequences, granularity(request, sp)
    )
    schedules = [schedule for schedule in request.schedule if _shareable(layout, schedule, lengths)]
    if not schedules:
        raise ValueError(
            f"schedule=sppo cannot share the subsequences {list(lengths)} among up to pp={pp} ranks with at least one"
            f" token each per SP rank (sp={sp}): use fewer subsequences, a longer sequence, or schedule='seq1f1b'."
        )
    evaluations = [
        e for schedule in schedules for e in _evaluate_syncs(request, limits, layout, lengths, partition, schedule)
    ]
    fits = [e for e in evaluations if e.feasible]
    if not fits:
        evaluation = min(evaluations, key=_overflow)
        search = _Search(layout, evaluation.placement.pp_cross_node, evaluation.schedule, closest=evaluation)
        peak_gpu, peak_host = evaluation.peak_gpu_bytes, evaluation.peak_host_bytes
        return Assessment(
            False, evaluation.policy, peak_gpu, peak_host, None, None, None, rejection(search, request),
            evaluation.sync, evaluation.schedule,
        )  # fmt: skip
    step, evaluation = min(((simulate_step_time(e), e) for e in fits), key=lambda pair: pair[0].step_s)
    tokens = request.seq_len * request.batch_size / (step.step_s * pp * sp)
    return Assessment(
        True, evaluation.policy, evaluation.peak_gpu_bytes, evaluation.peak_host_bytes, step.step_s, tokens,
        step.bubble_ratio, "", evaluation.sync, evaluation.schedule,
    )  # fmt: skip


def subsequence_counts(
    seq_len: int, sp: int, granularity: int, min_tokens: int = BLOCK_TOKENS, max_tokens: int = 16384
) -> list[int]:
    """Values of N whose mean per-device length S / (N sp) lies in [min_tokens, max_tokens]: the smallest, then the
    round values above it (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...: four per doubling, every N of the SPPO
    paper's Table 4 among them); just the smallest when the sequence gives each device fewer than ``min_tokens``.
    """
    most = max(1, seq_len // granularity)
    low = min(most, max(1, math.ceil(seq_len / (max_tokens * sp))))
    high = min(most, max(low, seq_len // (min_tokens * sp)))
    return [low, *(n for n in _round_values(high) if n > low)]


def _round_values(high: int) -> list[int]:
    """1, 2, 3, then m 2^k for m in 4..7, up to ``high``."""
    values, scale = [1, 2, 3], 1
    while 4 * scale <= high:
        values += [m * scale for m in range(4, 8)]
        scale *= 2
    return [v for v in values if v <= high]


class _Partitions:
    """Partitions of one sequence, computed once per (policy, N, granularity): layouts with the same sp share them.
    With ``document_length``, "flops" balances the masked count of regular documents (``partition.masked_flops``)."""

    def __init__(self, seq_len: int, config: GPTConfig, document_length: int | None = None) -> None:
        self.seq_len, self.config, self.document_length = seq_len, config, document_length
        self._cache: dict[tuple[str, int, int], tuple[int, ...]] = {}

    def __call__(self, policy: str, n: int, granularity: int) -> tuple[int, ...]:
        key = (policy, n, granularity)
        if key not in self._cache:
            lengths = split_sequence(
                self.seq_len, n, policy, granularity=granularity, config=self.config,
                document_length=self.document_length,
            )  # fmt: skip
            self._cache[key] = tuple(lengths)
        return self._cache[key]


def _try(
    request: PlanRequest, limits: Limits, frontier: _Frontier, partitions: _Partitions, n: int,
    bound: float | None = None,
) -> None:  # fmt: skip
    """Evaluate N on the frontier's layout, the cheapest combination first; keep its fastest fit or its closest miss
    (and, with its ``bound``, what the layout's trades cost over it: ``_Frontier.overhead``)."""
    search, schedule = frontier.search, frontier.search.schedule
    plain = _combinations(request, schedule)[:1]
    for combinations, kv in ((plain, _plain_kv(request, schedule)), (None, "request")):  # cheapest first
        fits = _search_n(
            request, limits, search.layout, partitions, frontier.grain, n, schedule, frontier.where, frontier.stages,
            search, combinations, kv,
        )  # fmt: skip
        if fits:
            search.feasible.append(fits)
            if bound:
                ratio = fits[0] / bound if len(search.feasible) == 1 else min(frontier.overhead, fits[0] / bound)
                frontier.overhead = max(1.0, ratio)
            return


_KEPT_PER_LAYOUT = max(_SPPO_COUNTS, _SIMULATED_PER_LAYOUT)
"""A layout's fastest N that matter: the few simulated, and those "sppo" is evaluated at."""


def _fastest_recompute(request: PlanRequest) -> str:
    return min(request.recompute, key=RECOMPUTE_ORDER.index)


def _beaten(search: _Search, bound: float) -> bool:
    """Whether an N with this bound cannot be among the layout's fastest few that fit already."""
    if len(search.feasible) < _KEPT_PER_LAYOUT:
        return False
    return bound >= sorted(t for t, _ in search.feasible)[_KEPT_PER_LAYOUT - 1]


def _bound(frontier: _Frontier, lengths: Sequence[int]) -> float:
    """Seconds per sequence no evaluation of N (cut into ``lengths``) on the frontier's layout can beat: its passes at
    the fastest costs allowed, before any FSDP traffic (``_lower_bound``)."""
    search, costs = frontier.search, frontier.costs
    timed = stage_times(costs, search.layout, frontier.where, frontier.stages, lengths)
    return _lower_bound(costs, search.layout, frontier.stages, lengths, timed, search.schedule) / search.layout.dp


def _plain_kv(request: PlanRequest, schedule: str):
    """The cheapest K/V placement: all on the device unless the request pins R."""
    kv = _kv_device_tokens(request, schedule)
    return None if kv == KV_AUTO else kv


def _search_n(
    request: PlanRequest, limits: Limits, layout: Layout, partitions: _Partitions, grain: int, n: int, schedule: str,
    where: Placement, stages: Sequence[StageSpec], search: _Search, combinations, kv,
) -> tuple[float, Evaluation] | None:  # fmt: skip
    """The fastest fitting evaluation at N over the partition policies (the first policy that fits), or None; misses
    update ``search.closest``. ``combinations`` and ``kv``: what to evaluate (None: the request's all)."""
    for policy in request.partition:
        lengths = partitions(policy, n, grain)
        if not _shareable(layout, schedule, lengths):
            continue
        evaluations = _evaluate_syncs(
            request, limits, layout, lengths, policy, schedule, where, stages, combinations, kv
        )
        fits = [(estimate_step_time(e) / layout.dp, e) for e in evaluations if e.feasible]
        if fits:
            return min(fits, key=lambda pair: pair[0])
        closest = min(evaluations, key=_overflow)
        if search.closest is None or _overflow(closest) < _overflow(search.closest):
            search.closest = closest
    return None


def _fixed_bytes(request: PlanRequest, layout: Layout, schedule: str, stages: Sequence[StageSpec]) -> int:
    """The device bytes no N or offload can lower on the layout's fullest stage, with the best sync mode, model
    state place and K/V spill."""
    kv = _kv_device_tokens(request, schedule)
    return min(
        max(
            fixed_memory(
                request.config,
                cost_model(request, layout, model_state=state),
                layout,
                s,
                request.seq_len,
                request.batch_size,
                sync,
                schedule,
                stages,
                kv,
                request.kv_chunk_tokens,
            )  # fmt: skip
            for s in stages
        )
        for state in {state for _, state in _combinations(request, schedule)}
        for sync in _syncs(request, layout, state)
    )


def _syncs(request: PlanRequest, layout: Layout, model_state: str = "device") -> tuple[str, ...]:
    """FSDP sync modes to try: only "step" when the stage is not sharded (then there is no FSDP) and its model state
    is on the device (model state on host is a one-rank FSDP mesh)."""
    return request.fsdp_sync if layout.dp * layout.sp > 1 or model_state == "host" else ("step",)


def _evaluate_syncs(
    request: PlanRequest,
    limits: Limits,
    layout: Layout,
    lengths: Sequence[int],
    policy: str,
    schedule: str = "seq1f1b",
    where: Placement | None = None,
    stages: Sequence[StageSpec] | None = None,
    combinations: Sequence[tuple[str, str]] | None = None,
    kv="request",
) -> list[Evaluation]:
    """One evaluation per allowed FSDP sync mode, each with the first offload policy that fits, for the request's
    first (recompute, model state) combination when one of them fits with all K/V on the device; otherwise for
    every allowed combination (the caller keeps the fastest that fits, or the closest miss). ``combinations`` and
    ``kv`` narrow what is evaluated ("request": the request's own K/V setting)."""
    where = where or placement(layout, request.profile.gpus_per_node)
    stages = stages or stage_specs(request.config, layout.pp)
    combinations = combinations or _combinations(request, schedule)
    kv = _kv_device_tokens(request, schedule) if kv == "request" else kv
    times: dict[tuple, dict] = {}  # stage times depend on the recompute mode and the dtypes only
    shared = {}  # "sppo": what shared units take does not depend on the sync mode or recompute either
    candidates = []
    for index, (recompute, state) in enumerate(combinations):
        costs = cost_model(request, layout, recompute, state)
        key = (recompute, costs.dtypes)
        if key not in times:
            times[key] = stage_times(costs, layout, where, stages, lengths)
        for sync in _syncs(request, layout, state):
            timed = with_fsdp(costs, layout, where, times[key], sync)
            candidates.append(
                (index, _lower_bound(costs, layout, stages, lengths, timed, schedule), costs, sync, timed)
            )
    first = [c for c in candidates if c[0] == 0]
    out = [
        _evaluate_one(request, limits, layout, where, stages, lengths, policy, schedule, shared, kv, c) for c in first
    ]
    if _plain_fit(out, kv) or len(first) == len(candidates):
        return out  # the cheapest combination fits: nothing to trade

    # The leanest recompute of each (model state, sync) first: where it does not fit, none that keeps more does
    # (it keeps more per layer of every subsequence than its larger one-layer temporary adds).
    def run(candidate: tuple) -> Evaluation:
        evaluation = _evaluate_one(
            request, limits, layout, where, stages, lengths, policy, schedule, shared, kv, candidate
        )
        out.append(evaluation)
        return evaluation

    def group(candidate: tuple) -> tuple[str, str]:
        return combinations[candidate[0]][1], candidate[3]  # (model state, sync)

    rest = candidates[len(first) :]
    leanest = max((combinations[c[0]][0] for c in rest), key=RECOMPUTE_ORDER.index)
    lean = [c for c in rest if combinations[c[0]][0] == leanest]
    fitting = {group(c) for c in lean if run(c).feasible}
    best = min((estimate_step_time(e) for e in out if e.feasible), default=math.inf)
    for candidate in sorted((c for c in rest if c not in lean and group(c) in fitting), key=lambda c: c[1]):
        if candidate[1] >= best:
            break  # no later candidate can be faster than what fits already
        evaluation = run(candidate)
        if evaluation.feasible:
            best = min(best, estimate_step_time(evaluation))
    return out


def _evaluate_one(
    request: PlanRequest, limits: Limits, layout: Layout, where: Placement, stages: Sequence[StageSpec],
    lengths: Sequence[int], policy: str, schedule: str, shared: dict, kv, candidate: tuple,
) -> Evaluation:  # fmt: skip
    _, _, costs, sync, timed = candidate
    return evaluate(
        costs, layout, where, stages, lengths, limits, batch=request.batch_size, reserved=request.profile.reserved_bytes,
        partition_policy=policy, sync=sync, offloads=request.offload, times=timed, schedule=schedule, shared=shared,
        kv_device_tokens=kv, kv_chunk_tokens=request.kv_chunk_tokens, fsdp_applied=True,
    )  # fmt: skip


def _lower_bound(
    costs: CostModel, layout: Layout, stages: Sequence[StageSpec], lengths: Sequence[int], timed: dict, schedule: str
) -> float:
    """A step time no evaluation of these passes can beat (copies, waits and spills only add): the closed form over
    the passes alone, plus the CPU optimizer step. Under "sppo" the busiest stage's passes alone: its stretch is at
    least 1 and its shared units only add (``estimate_step_time``)."""
    busy = max(sum(t.total for t in forward) + sum(t.total for t in backward) for forward, backward in timed.values())
    params = max(stage_parameter_counts(costs.config, s).total for s in stages)
    n = len(lengths)
    stretch = 1.0 if schedule == SCHEDULE_NAME and layout.pp > 1 else (layout.pp - 1 + n) / n
    return stretch * busy + costs.optimizer_seconds(params, layout.dp * layout.sp)


def _plain_fit(evaluations: Sequence[Evaluation], kv) -> bool:
    """Whether some evaluation fits without a spill the planner chose itself."""
    return any(e.feasible and (e.kv_device_tokens is None or kv != KV_AUTO) for e in evaluations)


def _simulate_best(search: _Search) -> tuple[StepTime, Evaluation]:
    """Simulate the layout's best few N by the closed form; keep the fastest."""
    candidates = sorted(search.feasible, key=lambda pair: pair[0])[:_SIMULATED_PER_LAYOUT]
    results = [(simulate_step_time(evaluation), evaluation) for _, evaluation in candidates]
    return min(results, key=lambda pair: pair[0].step_s)


def _overflow(evaluation: Evaluation) -> tuple[float, float]:
    """How far over the limits, relative to them: the worse of device and host, then both together."""
    gpu = _relative(evaluation.gpu_overflow, evaluation.limits.gpu_bytes)
    host = _relative(evaluation.host_overflow, evaluation.limits.host_bytes)
    return max(gpu, host), gpu + host


def _relative(overflow: int, limit: int) -> float:
    """``overflow`` over ``limit``, 0 when under it; any overflow of a limit of no bytes (``--host-memory`` below a
    byte per GPU) is infinitely far over it."""
    if overflow <= 0:
        return 0.0
    return overflow / limit if limit > 0 else math.inf


# -- the answer ------------------------------------------------------------------------------------


def _plan(
    request: PlanRequest,
    winner: _Search,
    losers: Sequence[_Search],
    searches: Sequence[_Search],
    simulated: Sequence[_Search],
) -> Plan:
    step, evaluation = winner.best
    layout, profile = winner.layout, request.profile
    peak = evaluation.peak_stage
    model_flops = sequence_model_flops(request.config, evaluation.partition, request.document_length)
    model_flops *= request.batch_size
    mfu = model_flops / (step.step_s * layout.pp * layout.sp * profile.peak_bf16_tflops * 1e12)
    tokens = tokens_per_gpu_per_s(request, step, layout)
    ac = score_ac(request) if request.compare_ac else None
    return Plan(
        model=request.config.name,
        seq_len=request.seq_len,
        nodes=request.nodes,
        gpus_per_node=profile.gpus_per_node,
        profile=profile.name,
        precision=request.precision,
        sp=layout.sp,
        pp=layout.pp,
        dp=layout.dp,
        num_subsequences=evaluation.num_subsequences,
        num_microbatches=1,
        schedule=winner.schedule,
        kv_grad_dtype=request.kv_grad_dtype,
        layers_per_stage=[s.stage.layers for s in evaluation.stages],
        partition=list(evaluation.partition),
        partition_policy=evaluation.partition_policy,
        document_length=request.document_length,
        offload=evaluation.policy,
        fsdp_sync=evaluation.sync,
        recompute=evaluation.recompute,
        kv_device_tokens=evaluation.kv_device_tokens,
        kv_chunk_tokens=request.kv_chunk_tokens,
        model_state=evaluation.model_state,
        granularity=granularity(request, layout.sp),
        alpha=list(peak.offload.alpha),
        alpha_stage=peak.stage.index,
        alpha_by_stage=[list(s.offload.alpha) for s in evaluation.stages],
        peak_gpu_bytes=evaluation.peak_gpu_bytes,
        peak_host_bytes=evaluation.peak_host_bytes,
        gpu_bytes=profile.hbm_bytes,
        host_limit_bytes=profile.host_bytes_per_gpu,
        host_bytes_per_node=profile.host_bytes_per_node,
        memory=peak.memory,
        step_time_s=step.step_s,
        tokens_per_gpu_per_s=tokens,
        mfu=mfu,
        bubble_ratio=step.bubble_ratio,
        time=step.breakdown,
        pp_cross_node=winner.pp_cross_node,
        runner_ups=[runner_up(request, loser, winner) for loser in losers],
        rejected=[
            f"{s.layout} ({s.schedule}): {rejection(s, request)}"
            for s in searches
            if not s.feasible and s.pruned is None
        ],
        pruned=sum(1 for s in searches if not s.feasible and s.pruned is not None),
        other_schedules=[
            other_schedule(request, schedule, winner, searches, simulated)
            for schedule in request.schedule
            if schedule != winner.schedule
        ],
        attention_kernel=resolve_attention(request.attention, profile),
        plain_ac=ac,
        advice=ac_advice(ac, tokens) if ac else "",
    )


def _lossy_hint(request: PlanRequest) -> str:
    """Whether the opt-in bf16 dK/dV accumulators would make the request fit, and by how much (``explain`` words it)."""
    if request.kv_grad_dtype == "bf16":
        return ""
    lossy = replace(request, kv_grad_dtype="bf16")
    profile = request.profile
    fixed = [
        _fixed_bytes(lossy, layout, "seq1f1b", stage_specs(lossy.config, layout.pp))
        for layout in _layouts(lossy)
        if request.seq_len % layout.sp == 0
    ]
    short = min(fixed, default=0) - (profile.hbm_bytes - profile.reserved_bytes)
    if short > 0:  # a lower bound of every layout's peak: no need to search
        return lossy_short(short)
    try:
        plan = solve(lossy)
    except NoFeasiblePlan as error:
        return lossy_no_fit(error)
    return lossy_fits(plan)
