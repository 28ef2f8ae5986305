"""The heuristic solver (SPPO section 6.1): search (SP, PP, N), keep what fits, pick the fastest.

Heuristics, as in the paper:
* no SP across nodes: sp divides the node size (and the heads, for Ulysses);
* no PP across nodes unless nothing fits otherwise: layouts whose pipeline stays inside nodes are
  preferred whenever one of them fits; the others are searched too and shown as runner-ups;
* mean subsequence length per device between 2K and 16K tokens, which bounds N.
For each (layout, N) the partition is the equal-FLOPs one (``partition.flops``, the paper's choice), or
the equal-length one when the FLOPs partition does not fit: its first subsequences are long, and the
first two are on the device together while the first is copied out. For each FSDP sync mode (how often
weights are gathered and gradients reduce-scattered, ``parallel/fsdp.py``) the offload policy is the
first of none / adaptive / full that fits (``planner.evaluate``), and the fastest mode that fits is kept.
Layouts are ranked by the closed form per sequence, step time / dp (a dp-way layout trains dp sequences
per step); the best few are simulated on the real schedule and the fastest simulated one wins.

The schedule is searched too: "seq1f1b", and "sppo" (Seq1F1B with multiplexed sequence partitioning), whose
helpers stream the other stages' weights and K/V piece by piece (``planner.multiplexed``); each (layout, schedule) is searched on its
own and the fastest that fits wins, whatever its schedule.

What else a run may trade time for memory with (``planner.options``: recompute, K/V spilled to host, model state on
host) is tried cheapest first: per (layout, N), when the first allowed combination (no recompute, model state on
the device, all K/V on the device) fits under some sync mode, it is taken as the others are; otherwise every allowed
combination is evaluated under every sync mode and the fastest that fits (closed form) is kept. "sppo" is planned
with the first allowed recompute mode, model state on the device and no spill.

``longest_sequence`` answers "how long can I go?": a bisection over the length on the predicate "some leanest
configuration fits" (``_fits``), then ``solve`` at the length found.

A request may fix sp, pp, the schedules, the offload policies, the sync modes and the partition policies it
allows (``PlanRequest``); the strategies do, for ``num_subsequences="auto"``. When nothing fits with fp32 dK/dV,
the message says whether the lossy ``--kv-grad-dtype=bf16`` would fit (the search re-run with it).

The words of every verdict (runner-ups and why they lost, the other schedules, why a layout or the whole request
does not fit) are ``planner.explain``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner.costs import CostModel
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
from lightning_sppo.planner.flops import sequence_model_flops
from lightning_sppo.planner.layout import Layout, Placement, StageSpec, candidate_layouts, placement, stage_specs
from lightning_sppo.planner.memory import (
    boundary_bytes,
    host_state_bytes,
    level1_bytes,
    level2_bytes,
    model_state_bytes,
    stage_parameter_counts,
)
from lightning_sppo.planner.multiplexed import SCHEDULE_NAME
from lightning_sppo.planner.options import KV_AUTO, RECOMPUTE_ORDER
from lightning_sppo.planner.plan import NoFeasiblePlan, Plan, PlanRequest
from lightning_sppo.planner.precision import precision_bytes
from lightning_sppo.planner.step_time import StepTime, estimate_step_time, simulate_step_time
from lightning_sppo.planner.units import format_bytes

__all__ = ["BLOCK_TOKENS", "Assessment", "assess_layout", "fits", "granularity", "solve", "subsequence_counts"]

BLOCK_TOKENS = 128
"""Subsequence boundaries fall on multiples of sp * 128: whole attention tiles on every SP rank."""
_GRID_STEPS_PER_DOUBLING = 4
_SIMULATED_LAYOUTS = 6
_SIMULATED_PER_LAYOUT = 2
_RUNNER_UPS = 4


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
    best: tuple[StepTime, Evaluation] | None = None
    """Its fastest simulated candidate, once simulated."""

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
    """The fastest layout and schedule that fit, or ``NoFeasiblePlan`` naming the limit and by how much."""
    profile = request.profile
    limits = Limits(profile.hbm_bytes - profile.reserved_bytes, profile.host_bytes_per_gpu)
    searches = _search_all(request, limits)
    fitting = sorted((s for s in searches if s.feasible), key=lambda s: s.estimate)
    if not fitting:
        raise no_plan(request, searches, limits, _lossy_hint)
    # Layouts whose pipeline stays inside nodes win whenever one fits (SPPO section 6.1).
    pool = [s for s in fitting if not s.pp_cross_node] or fitting
    chosen = pool[:_SIMULATED_LAYOUTS] + fitting[:_SIMULATED_LAYOUTS]
    for schedule in request.schedule:  # every schedule's best few, so the report can say why it lost
        chosen += [s for s in fitting if s.schedule == schedule][:_SIMULATED_LAYOUTS]
    for search in {id(s): s for s in chosen}.values():
        search.best = _simulate_best(search)
    simulated = sorted((s for s in fitting if s.best), key=lambda s: s.per_sequence)
    in_pool = {id(s) for s in pool}
    winner = next(s for s in simulated if id(s) in in_pool)
    losers = [s for s in simulated if s is not winner][:_RUNNER_UPS]
    return _plan(request, winner, losers, searches, simulated)


_LEAN_COUNTS = 1
"""How many of a layout's largest N ``fits`` tries: the shortest subsequences hold the least at once."""


def fits(request: PlanRequest) -> bool:
    """Whether some plan fits the request: a search of its leanest configurations that stops at the first fit.

    Per layout, the largest N (the least activation and temporary bytes at once) under each allowed partition,
    recompute mode, model state place, sync mode and offload policy, with the request's K/V spill; seq1f1b only
    when allowed ("sppo" holds at least what seq1f1b holds on a layout). ``solve`` evaluates every one of these
    too, so when this says yes, ``solve`` finds a plan (``longest_sequence`` relies on it).
    """
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
    partitions: _Partitions, schedule: str,
) -> bool:  # fmt: skip
    """Whether the layout's leanest configurations fit (``fits``): the leanest allowed recompute, sync mode and
    partition, at its largest N, under each model state place and offload policy, with the request's K/V spill."""
    lean = replace(
        request,
        recompute=request.recompute[-1:],  # the fewest bytes kept
        fsdp_sync=("regather",) if "regather" in request.fsdp_sync else request.fsdp_sync,  # the fewest gathered
        partition=("length",) if "length" in request.partition else request.partition,  # the shortest longest
    )
    if _fixed_bytes(lean, layout, schedule, stages) > limits.gpu_bytes or _beyond_capacity(
        lean, layout, stages, limits
    ):
        return False
    grain = granularity(request, layout.sp)
    counts = subsequence_counts(
        request.seq_len, layout.sp, grain, request.min_tokens_per_device, request.max_tokens_per_device
    )
    combinations = _combinations(lean, schedule)
    for n in reversed(counts[-_LEAN_COUNTS:]):
        for policy in lean.partition:
            lengths = partitions(policy, n, grain)
            evaluations = _evaluate_syncs(lean, limits, layout, lengths, policy, schedule, where, stages, combinations)
            if any(e.feasible for e in evaluations):
                return True
    return False


def _beyond_capacity(request: PlanRequest, layout: Layout, stages: Sequence[StageSpec], limits: Limits) -> bool:
    """Whether some stage must keep more than its device and host limits together, wherever things go: its model
    state, its K/V and dK/dV, the level 2 its blocks keep of the whole sequence under the leanest allowed recompute,
    and its messages (a bound no N, offload, spill or sync mode can get under)."""
    recompute = request.recompute[-1]
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
        if least > limits.gpu_bytes + limits.host_bytes:
            return True
    return False


_SPPO_COUNTS = 3
"""How many of seq1f1b's fastest N per layout "sppo" is evaluated at."""


def _search_all(request: PlanRequest, limits: Limits) -> list[_Search]:
    """One search per candidate layout and allowed schedule.

    "sppo" holds at least what seq1f1b holds on a layout (the stage's own state and units, plus streamed pieces and
    the shares of shared units), and its evaluations cost far more (a schedule per N, every stage walked on its own):
    it is evaluated only at the few N where seq1f1b is fastest on that layout (``_SPPO_COUNTS``), or once, for the
    message, where seq1f1b fits at no N.
    """
    partitions = _Partitions(request.seq_len, request.config, request.document_length)
    searches = []
    for layout in _layouts(request):
        schedules = _schedules(request, layout)
        plain = _search(request, limits, layout, partitions) if SCHEDULE_NAME in schedules else None
        for schedule in schedules:
            if schedule != SCHEDULE_NAME:
                searches.append(plain or _search(request, limits, layout, partitions, schedule))
                continue
            fastest = sorted(plain.feasible, key=lambda pair: pair[0])[:_SPPO_COUNTS]
            fitting = {evaluation.num_subsequences for _, evaluation in fastest}
            searches.append(_search(request, limits, layout, partitions, schedule, only=fitting))
    return searches


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
    return CostModel(request.config, dtypes, request.profile, request.document_length, recompute, model_state)


def _combinations(request: PlanRequest, schedule: str) -> list[tuple[str, str]]:
    """(recompute, model_state) pairs to evaluate, the request's first choices first; "sppo" (far costlier to evaluate)
    only with the request's first recompute mode and model state on the device."""
    if schedule == SCHEDULE_NAME:
        return [(request.recompute[0], "device")]
    return [(recompute, state) for state in request.model_state for recompute in request.recompute]


def _kv_device_tokens(request: PlanRequest, schedule: str):
    """The request's K/V spill, or None (all on the device) under "sppo"."""
    return None if schedule == SCHEDULE_NAME else request.kv_device_tokens


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
    profile = request.profile
    limits = Limits(profile.hbm_bytes - profile.reserved_bytes, profile.host_bytes_per_gpu)
    lengths = _Partitions(request.seq_len, request.config, request.document_length)(
        partition, num_subsequences, granularity(request, sp)
    )
    evaluations = [
        e
        for schedule in request.schedule
        for e in _evaluate_syncs(request, limits, layout, lengths, partition, schedule)
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
    seq_len: int, sp: int, granularity: int, min_tokens: int = 2048, max_tokens: int = 16384
) -> list[int]:
    """Values of N whose mean per-device length S / (N sp) lies in [min_tokens, max_tokens].

    A geometric grid (four steps per doubling) between the bounds; just N = 1 when the whole sequence
    gives each device fewer than ``min_tokens`` tokens.
    """
    most = max(1, seq_len // granularity)
    low = min(most, max(1, math.ceil(seq_len / (max_tokens * sp))))
    high = min(most, max(low, seq_len // (min_tokens * sp)))
    steps = math.ceil(_GRID_STEPS_PER_DOUBLING * math.log2(high / low)) if high > low else 0
    grid = {round(low * (high / low) ** (k / steps)) for k in range(steps + 1)} if steps else {low}
    return sorted(grid)


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


def _search(
    request: PlanRequest, limits: Limits, layout: Layout, partitions: _Partitions, schedule: str = "seq1f1b",
    only: set[int] | None = None,
) -> _Search:  # fmt: skip
    """The layout's feasible N (each with its fastest sync mode and first fitting offload), or its closest miss;
    ``only``: the N to try (an empty set: the largest N alone, for the message)."""
    config, sp = request.config, layout.sp
    where = placement(layout, request.profile.gpus_per_node)
    search = _Search(layout, where.pp_cross_node, schedule)
    if request.seq_len % sp:
        search.skipped = f"--seq-len={request.seq_len} is not divisible by sp={sp} (each SP rank takes 1/sp)"
        return search
    if schedule == SCHEDULE_NAME and (
        request.kv_device_tokens not in (None, KV_AUTO) or "device" not in request.model_state
    ):
        search.skipped = "schedule=sppo is planned with model state on the device and all K/V on the device"
        return search
    stages = stage_specs(config, layout.pp)
    grain = granularity(request, sp)
    counts = subsequence_counts(
        request.seq_len, sp, grain, request.min_tokens_per_device, request.max_tokens_per_device
    )
    fixed = _fixed_bytes(request, layout, schedule, stages)
    if fixed > limits.gpu_bytes and schedule == SCHEDULE_NAME and layout.pp > 1:
        # Its schedule is long to build at large pp and N, and no N would fit: the fixed bytes are the answer.
        search.fixed_overflow = fixed - limits.gpu_bytes
        search.skipped = (
            f"schedule=sppo needs {format_bytes(fixed)} per GPU before any activation"
            f" (+{format_bytes(search.fixed_overflow)}): model state and K/V + {request.kv_grad_dtype} dK/dV"
        )
        return search
    lean = only is not None or _lean_fit(request, limits, layout, stages, where, partitions, schedule)
    if fixed > limits.gpu_bytes or not lean:
        counts = counts[-1:]  # no N fits (not even the leanest); one evaluation gives the numbers for the message
    elif only is not None:
        counts = [n for n in counts if n in only] or counts[-1:]
    plain = _combinations(request, schedule)[:1]
    fastest = cost_model(request, layout, _fastest_recompute(request), "device")
    for n in counts:
        if _beaten(search, fastest, layout, where, stages, partitions(request.partition[0], n, grain), schedule):
            continue
        for combinations, kv in ((plain, _plain_kv(request, schedule)), (None, "request")):  # cheapest first
            fits = _search_n(
                request, limits, layout, partitions, grain, n, schedule, where, stages, search, combinations, kv
            )
            if fits:
                search.feasible.append(fits)
                break
    return search


_KEPT_PER_LAYOUT = max(_SPPO_COUNTS, _SIMULATED_PER_LAYOUT)
"""A layout's fastest N that matter: the few simulated, and those "sppo" is evaluated at."""


def _fastest_recompute(request: PlanRequest) -> str:
    return min(request.recompute, key=RECOMPUTE_ORDER.index)


def _beaten(
    search: _Search, costs: CostModel, layout: Layout, where: Placement, stages: Sequence[StageSpec],
    lengths: Sequence[int], schedule: str,
) -> bool:  # fmt: skip
    """Whether N (cut into ``lengths``) cannot be among the layout's fastest few that fit already: its passes alone,
    with the least recompute, are no faster (the total work of a stage does not depend on where the cuts fall)."""
    if len(search.feasible) < _KEPT_PER_LAYOUT or (schedule == SCHEDULE_NAME and layout.pp > 1):
        return False
    kept = sorted(t for t, _ in search.feasible)[_KEPT_PER_LAYOUT - 1]
    bound = _lower_bound(costs, layout, stages, lengths, stage_times(costs, layout, where, stages, lengths), schedule)
    return bound / layout.dp >= kept


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
    the passes alone, plus the CPU optimizer step; 0 under "sppo" (its shared units are not in the passes)."""
    if schedule == SCHEDULE_NAME and layout.pp > 1:
        return 0.0
    busy = max(sum(t.total for t in forward) + sum(t.total for t in backward) for forward, backward in timed.values())
    params = max(stage_parameter_counts(costs.config, s).total for s in stages)
    n = len(lengths)
    return (layout.pp - 1 + n) / n * busy + costs.optimizer_seconds(params, layout.dp * layout.sp)


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
    gpu = max(0.0, evaluation.gpu_overflow / evaluation.limits.gpu_bytes)
    host = max(0.0, evaluation.host_overflow / evaluation.limits.host_bytes)
    return max(gpu, host), gpu + host


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
        tokens_per_gpu_per_s=tokens_per_gpu_per_s(request, step, layout),
        mfu=mfu,
        bubble_ratio=step.bubble_ratio,
        time=step.breakdown,
        pp_cross_node=winner.pp_cross_node,
        runner_ups=[runner_up(request, loser, winner) for loser in losers],
        rejected=[f"{s.layout} ({s.schedule}): {rejection(s, request)}" for s in searches if not s.feasible],
        other_schedules=[
            other_schedule(request, schedule, winner, searches, simulated)
            for schedule in request.schedule
            if schedule != winner.schedule
        ],
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
