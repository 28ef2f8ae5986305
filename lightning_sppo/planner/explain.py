"""The solver's verdicts in words: why a runner-up or another schedule lost, why a layout or the request does not fit.

``planner.solver`` searches and decides; this module only words what it found, so the search reads without the
messages and the messages can change without touching the search. It sees a search through ``Searched`` (what
``solver`` records for one layout under one schedule), and it does not search itself: whether the lossy
``--kv-grad-dtype=bf16`` would fit is the solver's to find out (``no_plan`` takes it as a callable), and the
``lossy_*`` functions word its answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from lightning_sppo.parallel.fsdp import FSDP_SYNC_MODES
from lightning_sppo.planner.evaluate import OFFLOAD_ORDER, SCHEDULE_ORDER, Evaluation, Limits
from lightning_sppo.planner.layout import Layout
from lightning_sppo.planner.memory import MemoryBreakdown
from lightning_sppo.planner.plan import NoFeasiblePlan, Plan, PlanRequest, RunnerUp
from lightning_sppo.planner.step_time import StepTime
from lightning_sppo.planner.units import format_bytes, format_tokens

__all__ = [
    "Searched",
    "lossy_fits",
    "lossy_no_fit",
    "lossy_short",
    "no_plan",
    "other_schedule",
    "rejection",
    "runner_up",
    "tokens_per_gpu_per_s",
]


class Searched(Protocol):
    """What the explanations read of one layout searched under one schedule (``solver``'s record of it)."""

    layout: Layout
    schedule: str
    closest: Evaluation | None
    """The failing evaluation that came closest to fitting."""
    skipped: str | None
    """Why the layout was not searched at all."""
    fixed_overflow: int
    """Bytes over the device limit before any activation, when that is why it was skipped."""
    most_subsequences: int | None
    """The largest N the layout takes, when a pinned N (``--num-subsequences``) larger than it is why it was skipped."""
    best: tuple[StepTime, Evaluation] | None
    """Its fastest simulated candidate, once simulated."""
    pruned: float | None
    """The lowest bound (seconds per sequence) of the N the search left out, if it left any."""

    @property
    def per_sequence(self) -> float:
        """Simulated seconds per sequence of ``best``."""
        ...

    @property
    def overflow(self) -> tuple[float, float]:
        """How far ``closest`` is over the limits (the solver's ranking of failures)."""
        ...


def tokens_per_gpu_per_s(request: PlanRequest, step: StepTime, layout: Layout) -> float:
    """One data-parallel replica (pp x sp GPUs) trains batch_size sequences per step."""
    return request.seq_len * request.batch_size / (step.step_s * layout.pp * layout.sp)


# -- a plan that fits: what lost and why ---------------------------------------------------------


def runner_up(request: PlanRequest, loser: Searched, winner: Searched) -> RunnerUp:
    """A simulated layout that lost to ``winner``, with why."""
    step, evaluation = loser.best
    layout = loser.layout
    return RunnerUp(
        schedule=loser.schedule,
        sp=layout.sp,
        pp=layout.pp,
        dp=layout.dp,
        num_subsequences=evaluation.num_subsequences,
        partition_policy=evaluation.partition_policy,
        offload=evaluation.policy,
        fsdp_sync=evaluation.sync,
        recompute=evaluation.recompute,
        kv_device_tokens=evaluation.kv_device_tokens,
        model_state=evaluation.model_state,
        step_time_s=step.step_s,
        tokens_per_gpu_per_s=tokens_per_gpu_per_s(request, step, layout),
        bubble_ratio=step.bubble_ratio,
        peak_gpu_bytes=evaluation.peak_gpu_bytes,
        why=_why_lost(loser, winner),
    )


def other_schedule(
    request: PlanRequest,
    schedule: str,
    winner: Searched,
    searches: Sequence[Searched],
    simulated: Sequence[Searched],
) -> str:
    """Why ``schedule`` lost: its fastest plan against the winner's, or why none of its layouts fits."""
    best = next((s for s in simulated if s.schedule == schedule), None)
    if best is not None:
        step, evaluation = best.best
        return (
            f"{schedule}: best {best.layout} N={evaluation.num_subsequences},"
            f" {tokens_per_gpu_per_s(request, step, best.layout):.0f} tokens/GPU/s,"
            f" {format_bytes(evaluation.peak_gpu_bytes)} per GPU; {_why_lost(best, winner)}"
        )
    pruned = [s for s in searches if s.schedule == schedule and s.pruned is not None]
    if pruned:
        bound = min(pruned, key=lambda s: s.pruned)
        return (
            f"{schedule}: slower wherever it was not evaluated: at best {bound.pruned:.0f} s per sequence"
            f" ({bound.layout}, by the cost model's lower bound), slower than the fastest plans found"
        )
    tried = [s for s in searches if s.schedule == schedule and s.closest is not None]
    if not tried:
        skipped = sorted((s for s in searches if s.schedule == schedule and s.skipped), key=lambda s: s.fixed_overflow)
        if not skipped:
            return f"{schedule}: not searched (no layout with pp > 1)"
        return f"{schedule}: no layout fits; the closest, {skipped[0].layout}: {skipped[0].skipped}"
    closest = min(tried, key=lambda s: s.overflow)
    return f"{schedule}: no layout fits; the closest, {closest.layout}: {rejection(closest, request)}"


_CAUSES = {
    "compute": "more compute per GPU per sequence (layer overheads, the head or uneven stages)",
    "all_to_all": "more Ulysses all-to-all time",
    "p2p": "more pipeline P2P time",
    "offload_wait": "offload copies not hidden by compute",
    "idle": "more pipeline bubble",
    "sync": "more exposed FSDP weight gather and gradient reduce-scatter",
    "shared": "more MSP traffic (shared units' streamed weights and K/V, their groups' all-to-alls)",
    "spill": "K/V copies from host that attention does not hide",
    "optimizer": "a longer CPU optimizer step (model state on host)",
}


def _why_lost(loser: Searched, winner: Searched) -> str:
    """The largest difference in per-sequence time between the loser's and the winner's busiest stage."""
    lost, won = loser.best[0], winner.best[0]
    ratio = loser.per_sequence / winner.per_sequence - 1
    diffs = {
        name: getattr(lost.breakdown, name) / loser.layout.dp - getattr(won.breakdown, name) / winner.layout.dp
        for name in _CAUSES
    }
    cause = max(diffs, key=diffs.get)
    detail = f" (+{diffs[cause]:.2f} s per sequence"
    if cause == "idle":
        detail += f"; bubble ratio {lost.bubble_ratio:.2f} vs {won.bubble_ratio:.2f}"
    return f"{ratio:.0%} slower: {_CAUSES[cause]}{detail})"


# -- a layout that does not fit ------------------------------------------------------------------


def rejection(search: Searched, request: PlanRequest) -> str:
    """Why a searched layout does not fit: why it was skipped, or its closest evaluation's overflow."""
    if search.skipped:
        return search.skipped
    evaluation = search.closest
    if evaluation.gpu_overflow > 0:
        memory = evaluation.peak_stage.memory
        return (
            f"GPU memory {format_bytes(memory.peak_gpu_bytes)} > {format_bytes(request.profile.hbm_bytes)}"
            f" (+{format_bytes(evaluation.gpu_overflow)}) at best ({_choices(evaluation)}): model state"
            f" {format_bytes(memory.model_state_bytes)}, {_level1(memory, request)},"
            f" activations {format_bytes(memory.activations)},"
            f" held stage inputs/outputs {format_bytes(memory.boundary)}"
        )
    host = evaluation.peak_host_bytes
    return (
        f"host memory {format_bytes(host)} > {format_bytes(request.profile.host_bytes_per_gpu)} per GPU"
        f" (+{format_bytes(evaluation.host_overflow)}) at best ({_choices(evaluation)})"
    )


def _level1(memory: MemoryBreakdown, request: PlanRequest) -> str:
    """The K/V terms of a memory breakdown, naming the dK/dV dtype and, under "sppo", the shared units' streams."""
    text = f"K/V + {request.kv_grad_dtype} dK/dV {format_bytes(memory.level1_bytes)}"
    if memory.stream_bytes:
        text += (
            f", shared units' streams {format_bytes(memory.stream_bytes)} (weight pieces"
            f" {format_bytes(memory.stream_weights)}, K/V of one layer {format_bytes(memory.stream_kv)})"
        )
    return text


def _choices(evaluation: Evaluation) -> str:
    kv = "all" if evaluation.kv_device_tokens is None else evaluation.kv_device_tokens
    return (
        f"schedule={evaluation.schedule}, N={evaluation.num_subsequences}, partition={evaluation.partition_policy},"
        f" offload={evaluation.policy}, fsdp_sync={evaluation.sync}, recompute={evaluation.recompute},"
        f" kv_device_tokens={kv}, model_state={evaluation.model_state}"
    )


# -- nothing fits ----------------------------------------------------------------------------------


def no_plan(
    request: PlanRequest,
    searches: Sequence[Searched],
    limits: Limits,
    lossy_hint: Callable[[PlanRequest], str],
) -> NoFeasiblePlan:
    """One line: which limits, by how much, for the layout that came closest, and what to change.

    ``lossy_hint`` is the solver's clause on whether ``--kv-grad-dtype=bf16`` would fit; it is called only when
    some layout was searched or stopped over the device limit (it may run the search again).
    """
    tried = [s for s in searches if s.closest is not None]
    profile = request.profile
    what = (
        f"{request.config.name or 'the model'} at --seq-len={request.seq_len} ({format_tokens(request.seq_len)})"
        f" on {request.nodes} x {profile.gpus_per_node} {profile.name}"
    )
    over_fixed = [s for s in searches if s.fixed_overflow]
    if not tried and over_fixed:
        search = min(over_fixed, key=lambda s: s.fixed_overflow)
        return NoFeasiblePlan(
            f"no layout fits {what}: the closest, {search.layout}: {search.skipped}{lossy_hint(request)}.",
            "gpu",
            search.fixed_overflow,
            before_activations=True,
        )
    if not tried:
        reasons = _skipped(searches) or _no_layout(request)
        return NoFeasiblePlan(f"no layout for {what}: {reasons}.", "gpu", 0)
    # The message is about the request's first schedule (seq1f1b unless excluded); others get a clause.
    first = [s for s in tried if s.schedule == tried[0].schedule]
    closest = min(first, key=lambda s: s.overflow).closest
    hint = _hint(request, closest.peak_stage.memory, limits)
    hint += "".join(_other_no_fit(schedule, searches) for schedule in request.schedule[1:])
    hint += lossy_hint(request)
    fixed = _fixed(request)
    if fixed:
        hint += f"; the request fixes {fixed}, freeing those may help"
    layout = f"{closest.layout}, {_choices(closest)}"
    limit, overflow = ("gpu", closest.gpu_overflow) if closest.gpu_overflow > 0 else ("host", closest.host_overflow)
    return NoFeasiblePlan(
        f"no layout fits {what}: the closest ({layout}) needs {_over(request, closest)}; {hint}.", limit, overflow
    )


def _skipped(searches: Sequence[Searched]) -> str:
    """Why the layouts were skipped, each reason once; of those a pinned N cuts too fine, only the layout that takes
    the most (the fewest SP ranks): its bound is the one to name."""
    too_fine = [s for s in searches if s.most_subsequences]
    kept = [max(too_fine, key=lambda s: s.most_subsequences)] if too_fine else []
    kept += [s for s in searches if s.skipped and not s.most_subsequences]
    return "; ".join(dict.fromkeys(s.skipped for s in kept))


def _over(request: PlanRequest, closest: Evaluation) -> str:
    """The limits the closest evaluation exceeds, and by how much."""
    profile, memory = request.profile, closest.peak_stage.memory
    over = []
    if closest.gpu_overflow > 0:
        over.append(
            f"GPU memory {format_bytes(memory.peak_gpu_bytes)} per GPU, {format_bytes(closest.gpu_overflow)} over the"
            f" {format_bytes(profile.hbm_bytes)} of --gpu={profile.name} ({format_bytes(profile.reserved_bytes)}"
            " of it reserved)"
        )
    if closest.host_overflow > 0:
        over.append(
            f"host memory {format_bytes(closest.peak_host_bytes)} per GPU (offloaded activations"
            f" {format_bytes(memory.host)}, spilled K/V {format_bytes(memory.host_kv)}, model state"
            f" {format_bytes(memory.host_state)}),"
            f" {format_bytes(closest.host_overflow)} over the {format_bytes(profile.host_bytes_per_gpu)} per GPU"
            f" of --gpu={profile.name} (7/8 of --host-memory over the node's GPUs)"
        )
    return " and ".join(over)


def _hint(request: PlanRequest, memory: MemoryBreakdown, limits: Limits) -> str:
    """What to change: more GPUs when the model state alone does not fit, else more GPUs or a shorter sequence."""
    state = memory.model_state_bytes
    if state > limits.gpu_bytes:
        host = "" if "host" in request.model_state else " or --model-state=host"
        return (
            "too few GPUs for the model: its weights, gradients and AdamW state alone take"
            f" {format_bytes(state)} per GPU; use more --nodes{host}"
        )
    return (
        f"the sequence is too long for the memory: {_level1(memory, request)} and the model state"
        f" {format_bytes(state)} per GPU; use more --nodes or a shorter --seq-len"
    )


def _other_no_fit(schedule: str, searches: Sequence[Searched]) -> str:
    """A clause on how far another schedule's closest layout is from fitting."""
    tried = [s for s in searches if s.schedule == schedule and s.closest is not None]
    skipped = [s for s in searches if s.schedule == schedule and s.fixed_overflow]
    if tried:
        evaluation = min(tried, key=lambda s: s.overflow).closest
        over = [
            f"+{format_bytes(o)} {limit}"
            for limit, o in (("GPU", evaluation.gpu_overflow), ("host", evaluation.host_overflow))
            if o > 0
        ]
        return f"; --schedule={schedule} fits no better: its closest, {evaluation.layout}, needs {' and '.join(over)}"
    if skipped:
        search = min(skipped, key=lambda s: s.fixed_overflow)
        return (
            f"; --schedule={schedule} fits no better: its closest, {search.layout}, needs"
            f" +{format_bytes(search.fixed_overflow)} GPU before any activation"
        )
    return ""


def _fixed(request: PlanRequest) -> str:
    """The request's own restrictions of the search, as flags."""
    sizes = (("sp", request.sp), ("pp", request.pp)) if request.world_size > 1 else ()
    fixed = [f"--{name}={value}" for name, value in sizes if value is not None]
    if set(request.offload) != set(OFFLOAD_ORDER):
        fixed.append(f"--offload={','.join(request.offload)}")
    if set(request.fsdp_sync) != set(FSDP_SYNC_MODES):
        fixed.append(f"--fsdp-sync={','.join(request.fsdp_sync)}")
    if set(request.schedule) != set(SCHEDULE_ORDER):
        fixed.append(f"--schedule={','.join(request.schedule)}")
    return " ".join(fixed)


def _no_layout(request: PlanRequest) -> str:
    fixed = " ".join(f"--{n}={v}" for n, v in (("sp", request.sp), ("pp", request.pp)) if v is not None)
    return (
        f"no (sp, pp){' with ' + fixed if fixed else ''} divides the {request.world_size} GPUs with sp dividing the"
        f" node size {request.profile.gpus_per_node}, n_head={request.config.n_head} and"
        f" n_query_groups={request.config.n_query_groups}, and pp <= n_layer={request.config.n_layer}"
    )


# -- the lossy bf16 dK/dV hint: the solver re-runs the search, these word its answer ------------

_LOSSY = "--kv-grad-dtype=bf16 (dK/dV accumulated in bf16: lossy)"


def lossy_short(short: int) -> str:
    """Even bf16 dK/dV leaves every layout ``short`` bytes over before any activation."""
    return f"; even {_LOSSY} leaves every layout at least {format_bytes(short)} over before any activation"


def lossy_no_fit(error: NoFeasiblePlan) -> str:
    """The search with bf16 dK/dV found nothing either: how far its closest layout is."""
    when = "before any activation" if error.before_activations else "with its activations"
    over = format_bytes(error.overflow_bytes)
    return f"; even {_LOSSY} leaves the closest layout {over} over the {error.limit} limit {when}"


def lossy_fits(plan: Plan) -> str:
    """The plan bf16 dK/dV allows, and the dK/dV bytes it saves."""
    fp32_grads = plan.memory.kv_grad * 2  # 4 bytes per element instead of 2
    margin = plan.gpu_bytes - plan.peak_gpu_bytes
    return (
        f"; fits with {_LOSSY}: {plan.schedule} sp={plan.sp}"
        f" pp={plan.pp} dp={plan.dp} N={plan.num_subsequences} then needs {format_bytes(plan.peak_gpu_bytes)} per"
        f" GPU, {format_bytes(margin)} under the {format_bytes(plan.gpu_bytes)}, its dK/dV taking"
        f" {format_bytes(plan.memory.kv_grad)} instead of {format_bytes(fp32_grads)}"
    )
