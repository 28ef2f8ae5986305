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

A request may fix sp, pp, the offload policies, the sync modes and the partition policies it allows
(``PlanRequest``); the strategies do, for ``num_subsequences="auto"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.parallel.fsdp import FSDP_SYNC_MODES
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner.costs import CostModel
from lightning_sppo.planner.evaluate import OFFLOAD_ORDER, Evaluation, Limits, evaluate, fixed_memory, stage_times
from lightning_sppo.planner.flops import sequence_model_flops
from lightning_sppo.planner.layout import Layout, Placement, StageSpec, candidate_layouts, placement, stage_specs
from lightning_sppo.planner.plan import NoFeasiblePlan, Plan, PlanRequest, RunnerUp
from lightning_sppo.planner.precision import precision_bytes
from lightning_sppo.planner.step_time import SCHEDULE, StepTime, estimate_step_time, simulate_step_time
from lightning_sppo.planner.units import format_bytes, format_tokens

__all__ = ["BLOCK_TOKENS", "Assessment", "assess_layout", "granularity", "solve", "subsequence_counts"]

BLOCK_TOKENS = 128
"""Subsequence boundaries fall on multiples of sp * 128: whole attention tiles on every SP rank."""
_GRID_STEPS_PER_DOUBLING = 4
_SIMULATED_LAYOUTS = 6
_SIMULATED_PER_LAYOUT = 2
_RUNNER_UPS = 4


@dataclass(eq=False)
class _Search:
    """Everything tried for one layout."""

    layout: Layout
    pp_cross_node: bool
    feasible: list[tuple[float, Evaluation]] = field(default_factory=list)
    """(closed-form seconds per sequence, evaluation) of every N that fits."""
    closest: Evaluation | None = None
    """The failing evaluation that came closest to fitting."""
    skipped: str | None = None
    """Why the layout was not searched at all."""
    best: tuple[StepTime, Evaluation] | None = None
    """Its fastest simulated candidate, once simulated."""

    @property
    def estimate(self) -> float:
        return min(t for t, _ in self.feasible)


def solve(request: PlanRequest) -> Plan:
    """The fastest layout that fits, or ``NoFeasiblePlan`` naming the limit and by how much."""
    profile = request.profile
    limits = Limits(profile.hbm_bytes - profile.reserved_bytes, profile.host_bytes_per_gpu)
    layouts = _layouts(request)
    partitions = _Partitions(request.seq_len, request.config)
    searches = [_search(request, limits, layout, partitions) for layout in layouts]
    fitting = sorted((s for s in searches if s.feasible), key=lambda s: s.estimate)
    if not fitting:
        raise _no_plan(request, searches, limits)
    # Layouts whose pipeline stays inside nodes win whenever one fits (SPPO section 6.1).
    pool = [s for s in fitting if not s.pp_cross_node] or fitting
    for search in {id(s): s for s in pool[:_SIMULATED_LAYOUTS] + fitting[:_SIMULATED_LAYOUTS]}.values():
        search.best = _simulate_best(search)
    simulated = sorted((s for s in fitting if s.best), key=_per_sequence)
    in_pool = {id(s) for s in pool}
    winner = next(s for s in simulated if id(s) in in_pool)
    losers = [s for s in simulated if s is not winner][:_RUNNER_UPS]
    return _plan(request, winner, losers, [s for s in searches if not s.feasible])


def _layouts(request: PlanRequest) -> list[Layout]:
    """Candidate layouts, narrowed to the request's sp and pp when it fixes them."""
    layouts = candidate_layouts(request.config, request.world_size, request.profile.gpus_per_node)
    return [layout for layout in layouts if request.sp in (None, layout.sp) and request.pp in (None, layout.pp)]


def cost_model(request: PlanRequest, layout: Layout) -> CostModel:
    """Costs under the request's precision as the runtime applies it to ``layout`` (sharded when dp * sp > 1)."""
    dtypes = precision_bytes(request.precision, sharded=layout.dp * layout.sp > 1)
    return CostModel(request.config, dtypes, request.profile)


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


def assess_layout(
    request: PlanRequest, sp: int, pp: int, num_subsequences: int, partition: str = "flops"
) -> Assessment:
    """Evaluate one (sp, pp, N) the solver did not necessarily consider (e.g. a paper's choice), any placement."""
    layout = Layout(sp, pp, request.world_size // (sp * pp))
    if layout.world_size != request.world_size:
        raise ValueError(f"sp * pp = {sp * pp} must divide the {request.world_size} GPUs of the request.")
    profile = request.profile
    limits = Limits(profile.hbm_bytes - profile.reserved_bytes, profile.host_bytes_per_gpu)
    lengths = _Partitions(request.seq_len, request.config)(partition, num_subsequences, granularity(request, sp))
    evaluations = _evaluate_syncs(request, limits, layout, lengths, partition)
    fits = [e for e in evaluations if e.feasible]
    if not fits:
        evaluation = min(evaluations, key=_overflow)
        search = _Search(layout, evaluation.placement.pp_cross_node, closest=evaluation)
        peak_gpu, peak_host = evaluation.peak_gpu_bytes, evaluation.peak_host_bytes
        return Assessment(False, evaluation.policy, peak_gpu, peak_host, None, None, None, _rejection(search, request))
    step, evaluation = min(((simulate_step_time(e), e) for e in fits), key=lambda pair: pair[0].step_s)
    tokens = request.seq_len * request.batch_size / (step.step_s * pp * sp)
    return Assessment(
        True, evaluation.policy, evaluation.peak_gpu_bytes, evaluation.peak_host_bytes, step.step_s, tokens,
        step.bubble_ratio, "", evaluation.sync,
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
    """Partitions of one sequence, computed once per (policy, N, granularity): layouts with the same sp share them."""

    def __init__(self, seq_len: int, config: GPTConfig) -> None:
        self.seq_len, self.config = seq_len, config
        self._cache: dict[tuple[str, int, int], tuple[int, ...]] = {}

    def __call__(self, policy: str, n: int, granularity: int) -> tuple[int, ...]:
        key = (policy, n, granularity)
        if key not in self._cache:
            lengths = split_sequence(self.seq_len, n, policy, granularity=granularity, config=self.config)
            self._cache[key] = tuple(lengths)
        return self._cache[key]


def _search(request: PlanRequest, limits: Limits, layout: Layout, partitions: _Partitions) -> _Search:
    config, sp = request.config, layout.sp
    where = placement(layout, request.profile.gpus_per_node)
    search = _Search(layout, where.pp_cross_node)
    if request.seq_len % sp:
        search.skipped = f"--seq-len={request.seq_len} is not divisible by sp={sp} (each SP rank takes 1/sp)"
        return search
    costs = cost_model(request, layout)
    stages = stage_specs(config, layout.pp)
    grain = granularity(request, sp)
    counts = subsequence_counts(
        request.seq_len, sp, grain, request.min_tokens_per_device, request.max_tokens_per_device
    )
    fixed = min(
        max(fixed_memory(config, costs, layout, s, request.seq_len, request.batch_size, sync) for s in stages)
        for sync in _syncs(request, layout)
    )
    if fixed > limits.gpu_bytes:
        counts = counts[-1:]  # no N fits; one evaluation gives the numbers for the message
    for n in counts:
        for policy in request.partition:
            lengths = partitions(policy, n, grain)
            evaluations = _evaluate_syncs(request, limits, layout, lengths, policy, costs, where, stages)
            fits = [(estimate_step_time(e) / layout.dp, e) for e in evaluations if e.feasible]
            if fits:
                search.feasible.append(min(fits, key=lambda pair: pair[0]))
                break
            closest = min(evaluations, key=_overflow)
            if search.closest is None or _overflow(closest) < _overflow(search.closest):
                search.closest = closest
    return search


def _syncs(request: PlanRequest, layout: Layout) -> tuple[str, ...]:
    """FSDP sync modes to try: only "step" when the stage is not sharded (then there is no FSDP)."""
    return request.fsdp_sync if layout.dp * layout.sp > 1 else ("step",)


def _evaluate_syncs(
    request: PlanRequest,
    limits: Limits,
    layout: Layout,
    lengths: Sequence[int],
    policy: str,
    costs: CostModel | None = None,
    where: Placement | None = None,
    stages: Sequence[StageSpec] | None = None,
) -> list[Evaluation]:
    """One evaluation per allowed FSDP sync mode, each with the first offload policy that fits."""
    costs = costs or cost_model(request, layout)
    where = where or placement(layout, request.profile.gpus_per_node)
    stages = stages or stage_specs(request.config, layout.pp)
    times = stage_times(costs, layout, where, stages, lengths)
    return [
        evaluate(
            costs,
            layout,
            where,
            stages,
            lengths,
            limits,
            batch=request.batch_size,
            reserved=request.profile.reserved_bytes,
            partition_policy=policy,
            sync=sync,
            offloads=request.offload,
            times=times,
        )  # fmt: skip
        for sync in _syncs(request, layout)
    ]


def _simulate_best(search: _Search) -> tuple[StepTime, Evaluation]:
    """Simulate the layout's best few N by the closed form; keep the fastest."""
    candidates = sorted(search.feasible, key=lambda pair: pair[0])[:_SIMULATED_PER_LAYOUT]
    results = [(simulate_step_time(evaluation), evaluation) for _, evaluation in candidates]
    return min(results, key=lambda pair: pair[0].step_s)


def _per_sequence(search: _Search) -> float:
    return search.best[0].step_s / search.layout.dp


def _overflow(evaluation: Evaluation) -> tuple[float, float]:
    """How far over the limits, relative to them: the worse of device and host, then both together."""
    gpu = max(0.0, evaluation.gpu_overflow / evaluation.limits.gpu_bytes)
    host = max(0.0, evaluation.host_overflow / evaluation.limits.host_bytes)
    return max(gpu, host), gpu + host


# -- the answer ------------------------------------------------------------------------------------


def _plan(request: PlanRequest, winner: _Search, losers: Sequence[_Search], failed: Sequence[_Search]) -> Plan:
    step, evaluation = winner.best
    layout, profile = winner.layout, request.profile
    peak = evaluation.peak_stage
    model_flops = sequence_model_flops(request.config, evaluation.partition) * request.batch_size
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
        schedule=SCHEDULE,
        layers_per_stage=[s.stage.layers for s in evaluation.stages],
        partition=list(evaluation.partition),
        partition_policy=evaluation.partition_policy,
        offload=evaluation.policy,
        fsdp_sync=evaluation.sync,
        granularity=granularity(request, layout.sp),
        alpha=list(peak.offload.alpha),
        alpha_stage=peak.stage.index,
        alpha_by_stage=[list(s.offload.alpha) for s in evaluation.stages],
        peak_gpu_bytes=evaluation.peak_gpu_bytes,
        peak_host_bytes=evaluation.peak_host_bytes,
        gpu_bytes=profile.hbm_bytes,
        host_limit_bytes=profile.host_bytes_per_gpu,
        memory=peak.memory,
        step_time_s=step.step_s,
        tokens_per_gpu_per_s=_tokens_per_gpu_per_s(request, step, layout),
        mfu=mfu,
        bubble_ratio=step.bubble_ratio,
        time=step.breakdown,
        pp_cross_node=winner.pp_cross_node,
        runner_ups=[_runner_up(request, loser, winner) for loser in losers],
        rejected=[f"{s.layout}: {_rejection(s, request)}" for s in failed],
    )


def _tokens_per_gpu_per_s(request: PlanRequest, step: StepTime, layout: Layout) -> float:
    """One data-parallel replica (pp x sp GPUs) trains batch_size sequences per step."""
    return request.seq_len * request.batch_size / (step.step_s * layout.pp * layout.sp)


def _runner_up(request: PlanRequest, loser: _Search, winner: _Search) -> RunnerUp:
    step, evaluation = loser.best
    layout = loser.layout
    return RunnerUp(
        sp=layout.sp,
        pp=layout.pp,
        dp=layout.dp,
        num_subsequences=evaluation.num_subsequences,
        partition_policy=evaluation.partition_policy,
        offload=evaluation.policy,
        fsdp_sync=evaluation.sync,
        step_time_s=step.step_s,
        tokens_per_gpu_per_s=_tokens_per_gpu_per_s(request, step, layout),
        bubble_ratio=step.bubble_ratio,
        peak_gpu_bytes=evaluation.peak_gpu_bytes,
        why=_why_lost(loser, winner),
    )


_CAUSES = {
    "compute": "more compute per GPU per sequence (layer overheads, the head or uneven stages)",
    "all_to_all": "more Ulysses all-to-all time",
    "p2p": "more pipeline P2P time",
    "offload_wait": "offload copies not hidden by compute",
    "idle": "more pipeline bubble",
    "sync": "more exposed FSDP weight gather and gradient reduce-scatter",
}


def _why_lost(loser: _Search, winner: _Search) -> str:
    """The largest difference in per-sequence time between the loser's and the winner's busiest stage."""
    lost, won = loser.best[0], winner.best[0]
    ratio = _per_sequence(loser) / _per_sequence(winner) - 1
    if ratio < 0:
        return (
            f"{-ratio:.0%} faster, but its pipeline crosses nodes; PP stays inside nodes whenever a layout fits"
            " there (SPPO section 6.1)"
        )
    diffs = {
        name: getattr(lost.breakdown, name) / loser.layout.dp - getattr(won.breakdown, name) / winner.layout.dp
        for name in _CAUSES
    }
    cause = max(diffs, key=diffs.get)
    detail = f" (+{diffs[cause]:.2f} s per sequence"
    if cause == "idle":
        detail += f"; bubble ratio {lost.bubble_ratio:.2f} vs {won.bubble_ratio:.2f}"
    return f"{ratio:.0%} slower: {_CAUSES[cause]}{detail})"


def _rejection(search: _Search, request: PlanRequest) -> str:
    if search.skipped:
        return search.skipped
    evaluation = search.closest
    if evaluation.gpu_overflow > 0:
        memory = evaluation.peak_stage.memory
        return (
            f"GPU memory {format_bytes(memory.peak_gpu_bytes)} > {format_bytes(request.profile.hbm_bytes)}"
            f" (+{format_bytes(evaluation.gpu_overflow)}) at best ({_choices(evaluation)}): model state"
            f" {format_bytes(memory.model_state_bytes)}, K/V + fp32 dK/dV {format_bytes(memory.level1_bytes)},"
            f" activations {format_bytes(memory.activations)}, held stage inputs/outputs {format_bytes(memory.boundary)}"
        )
    host = evaluation.peak_host_bytes
    return (
        f"host memory {format_bytes(host)} > {format_bytes(request.profile.host_bytes_per_gpu)} per GPU"
        f" (+{format_bytes(evaluation.host_overflow)}) at best ({_choices(evaluation)})"
    )


def _choices(evaluation: Evaluation) -> str:
    return (
        f"N={evaluation.num_subsequences}, partition={evaluation.partition_policy}, offload={evaluation.policy},"
        f" fsdp_sync={evaluation.sync}"
    )


def _fixed(request: PlanRequest) -> str:
    """The request's own restrictions of the search, as flags."""
    sizes = (("sp", request.sp), ("pp", request.pp)) if request.world_size > 1 else ()
    fixed = [f"--{name}={value}" for name, value in sizes if value is not None]
    if set(request.offload) != set(OFFLOAD_ORDER):
        fixed.append(f"--offload={','.join(request.offload)}")
    if set(request.fsdp_sync) != set(FSDP_SYNC_MODES):
        fixed.append(f"--fsdp-sync={','.join(request.fsdp_sync)}")
    return " ".join(fixed)


def _no_layout(request: PlanRequest) -> str:
    fixed = " ".join(f"--{n}={v}" for n, v in (("sp", request.sp), ("pp", request.pp)) if v is not None)
    return (
        f"no (sp, pp){' with ' + fixed if fixed else ''} divides the {request.world_size} GPUs with sp dividing the"
        f" node size {request.profile.gpus_per_node}, n_head={request.config.n_head} and"
        f" n_query_groups={request.config.n_query_groups}, and pp <= n_layer={request.config.n_layer}"
    )


def _no_plan(request: PlanRequest, searches: Sequence[_Search], limits: Limits) -> NoFeasiblePlan:
    """One line: which limits, by how much, for the layout that came closest, and what to change."""
    tried = [s for s in searches if s.closest is not None]
    profile = request.profile
    what = (
        f"{request.config.name or 'the model'} at --seq-len={request.seq_len} ({format_tokens(request.seq_len)})"
        f" on {request.nodes} x {profile.gpus_per_node} {profile.name}"
    )
    if not tried:
        reasons = "; ".join(s.skipped for s in searches if s.skipped) or _no_layout(request)
        return NoFeasiblePlan(f"no layout for {what}: {reasons}.", "gpu", 0)
    closest = min(tried, key=lambda s: _overflow(s.closest)).closest
    memory = closest.peak_stage.memory
    host = closest.peak_host_bytes
    over = []
    if closest.gpu_overflow > 0:
        over.append(
            f"GPU memory {format_bytes(memory.peak_gpu_bytes)} per GPU, {format_bytes(closest.gpu_overflow)} over the"
            f" {format_bytes(profile.hbm_bytes)} of --gpu={profile.name} ({format_bytes(profile.reserved_bytes)}"
            " of it reserved)"
        )
    if closest.host_overflow > 0:
        over.append(
            f"host memory {format_bytes(host)} of offloaded activations per GPU, {format_bytes(closest.host_overflow)}"
            f" over the {format_bytes(profile.host_bytes_per_gpu)} per GPU of --gpu={profile.name}"
        )
    state = memory.model_state_bytes
    if state > limits.gpu_bytes:
        hint = f"too few GPUs for the model: its weights, gradients and AdamW state alone take {format_bytes(state)} per GPU; use more --nodes"
    else:
        hint = (
            f"the sequence is too long for the memory: K/V + fp32 dK/dV take {format_bytes(memory.level1_bytes)}"
            f" and the model state {format_bytes(state)} per GPU; use more --nodes or a shorter --seq-len"
        )
    fixed = _fixed(request)
    if fixed:
        hint += f"; the request fixes {fixed}, freeing those may help"
    layout = f"{closest.layout}, {_choices(closest)}"
    limit, overflow = ("gpu", closest.gpu_overflow) if closest.gpu_overflow > 0 else ("host", closest.host_overflow)
    return NoFeasiblePlan(
        f"no layout fits {what}: the closest ({layout}) needs {' and '.join(over)}; {hint}.", limit, overflow
    )
