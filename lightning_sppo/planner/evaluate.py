"""Evaluate one candidate (layout, N, FSDP sync mode): per-stage times, offload decision and memory.

Offload policies are tried in the order none, adaptive, full and the first that fits is kept: "none"
copies nothing, "adaptive" copies only what the next forward hides (so it costs no time), and "full"
frees the most device memory but may expose copy time. The FSDP sync mode (``parallel/fsdp.py``) trades
memory for communication; the solver evaluates each allowed mode and keeps the fastest that fits. Stages
that are alike (same layer count, same ends, same links) share their numbers, which keeps the search fast.

Under the "sppo" schedule (``planner.multiplexed``) each rank also runs shares of other stages' units, streaming
their weights one piece at a time and the K/V of its heads one layer at a time, so every stage is planned on its
own: its shared units are not offloaded, its activation peak comes from walking its action list, it holds the
largest weight + K/V stream of the units it takes part in, and each member's share of a unit carries its compute
and its group's traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.alpha import OffloadPlan, plan_offload
from lightning_sppo.planner.costs import CostModel, PassTimes
from lightning_sppo.planner.layout import Layout, Placement, StageSpec
from lightning_sppo.planner.memory import (
    MemoryBreakdown,
    boundary_bytes,
    level1_bytes,
    level2_bytes,
    model_state_bytes,
    stage_parameter_counts,
    transient_bytes,
)
from lightning_sppo.planner.multiplexed import (
    SCHEDULE_NAME,
    ShareTimes,
    Stream,
    activation_peak,
    rank_actions,
    shared_kept_bytes,
    shared_saved_bytes,
    shared_seconds,
    shared_units,
    stream_peak,
    unit_share,
)

__all__ = [
    "OFFLOAD_ORDER",
    "SCHEDULE_ORDER",
    "Evaluation",
    "Limits",
    "StagePlan",
    "evaluate",
    "fixed_memory",
    "stage_times",
]

OFFLOAD_ORDER = ("none", "adaptive", "full")
SCHEDULE_ORDER = ("seq1f1b", SCHEDULE_NAME)
"""Schedules the planner models (``schedule.generators``), one micro-batch each."""


@dataclass(frozen=True)
class Limits:
    """What one GPU may use: device bytes after the reserve, and pinned host bytes."""

    gpu_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class StagePlan:
    """One stage of a candidate: its times per subsequence, offload decision and peak memory."""

    stage: StageSpec
    forward: tuple[PassTimes, ...]
    backward: tuple[PassTimes, ...]
    offload: OffloadPlan
    memory: MemoryBreakdown
    shared: dict[tuple[int, int], ShareTimes] | None = None
    """"sppo": (subsequence, rank) -> seconds of that rank's share of this stage's shared unit."""

    @property
    def forward_s(self) -> list[float]:
        """Per subsequence, forward time including the wait for the previous subsequence's D2H."""
        return [t.total + w for t, w in zip(self.forward, self.offload.forward_wait, strict=True)]

    @property
    def backward_s(self) -> list[float]:
        return [t.total + w for t, w in zip(self.backward, self.offload.backward_wait, strict=True)]


@dataclass(frozen=True)
class Evaluation:
    """A candidate with every stage planned; ``feasible`` says whether it fits the limits."""

    layout: Layout
    placement: Placement
    partition: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    limits: Limits
    partition_policy: str = "flops"
    """The ``lightning_sppo.partition`` policy that produced ``partition``."""
    sync: str = "step"
    """The FSDP sync mode (``parallel/fsdp.py``); "step" when the stage is not sharded."""
    schedule: str = "seq1f1b"
    """The pipeline schedule (``SCHEDULE_ORDER``)."""

    @property
    def num_subsequences(self) -> int:
        return len(self.partition)

    @property
    def peak_stage(self) -> StagePlan:
        """The stage with the highest device peak (the one that decides whether the layout fits)."""
        return max(self.stages, key=lambda s: s.memory.resident_bytes + s.memory.transient)

    @property
    def peak_gpu_bytes(self) -> int:
        """Predicted device peak of the fullest stage."""
        return max(s.memory.peak_gpu_bytes for s in self.stages)

    @property
    def peak_host_bytes(self) -> int:
        """Predicted pinned host bytes of the stage that offloads the most."""
        return max(s.memory.host for s in self.stages)

    @property
    def gpu_overflow(self) -> int:
        """Bytes over the device limit on the fullest stage (<= 0 when it fits)."""
        return max(s.memory.resident_bytes + s.memory.transient for s in self.stages) - self.limits.gpu_bytes

    @property
    def host_overflow(self) -> int:
        return self.peak_host_bytes - self.limits.host_bytes

    @property
    def feasible(self) -> bool:
        return self.gpu_overflow <= 0 and self.host_overflow <= 0

    @property
    def policy(self) -> str:
        return self.stages[0].offload.policy


def fixed_memory(
    config: GPTConfig, costs: CostModel, layout: Layout, stage: StageSpec, seq_len: int, batch: int, sync: str = "step",
    schedule: str = "seq1f1b", stages: Sequence[StageSpec] | None = None,
) -> int:  # fmt: skip
    """Device bytes of a stage that no choice of N or alpha changes: model state, level 1, boundary messages (the same
    under "sppo": its streams depend on N and are counted with the activations)."""
    params = stage_parameter_counts(config, stage)
    state = sum(model_state_bytes(params, costs.dtypes, layout.dp * layout.sp, sync))
    kv, kv_grad = level1_bytes(config, costs.dtypes, stage, seq_len, layout.sp, batch)
    return state + kv + kv_grad + boundary_bytes(config, costs.dtypes, stage, seq_len, layout.sp, batch)


def evaluate(
    costs: CostModel,
    layout: Layout,
    placement: Placement,
    stages: Sequence[StageSpec],
    partition: Sequence[int],
    limits: Limits,
    *,
    batch: int = 1,
    reserved: int = 0,
    partition_policy: str = "flops",
    sync: str = "step",
    offloads: Sequence[str] = OFFLOAD_ORDER,
    times: dict | None = None,
    schedule: str = "seq1f1b",
    shared: dict | None = None,
) -> Evaluation:
    """Plan every stage of ``layout`` for ``partition`` under ``schedule``, trying ``offloads`` in order until one
    fits.

    ``times`` are ``stage_times`` of the same layout and partition, when the caller already has them; ``shared``, a
    dict the caller keeps for one layout and partition, holds what "sppo"'s shared units take across calls.
    """
    if schedule not in SCHEDULE_ORDER:
        raise ValueError(f"The planner models schedule in {list(SCHEDULE_ORDER)}, got --schedule={schedule!r}.")
    timed = times if times is not None else stage_times(costs, layout, placement, stages, partition)
    timed = {key: _with_fsdp(costs, layout, placement, key, passes, sync) for key, passes in timed.items()}
    multiplexed = schedule == SCHEDULE_NAME and layout.pp > 1
    # What shared units stream and take does not depend on the offload policy: once per candidate.
    if multiplexed:
        shared = shared if shared is not None else {}
        if "plan" not in shared:
            shared["plan"] = _SharedPlan.of(costs, layout, placement, stages, partition, batch)
        shared = shared["plan"]
    attempt: Evaluation | None = None
    for policy in offloads:
        if multiplexed:
            planned = _plan_stages_multiplexed(
                costs, layout, placement, stages, partition, timed, policy, sync, batch, reserved, shared
            )
        else:
            planned = _plan_stages(costs, layout, placement, stages, partition, timed, policy, sync, batch, reserved)
        attempt = Evaluation(layout, placement, tuple(partition), planned, limits, partition_policy, sync, schedule)
        if attempt.feasible:
            break
    return attempt


def stage_times(
    costs: CostModel, layout: Layout, placement: Placement, stages: Sequence[StageSpec], partition: Sequence[int]
) -> dict[tuple, tuple[tuple[PassTimes, ...], tuple[PassTimes, ...]]]:
    """Forward and backward times per subsequence without FSDP traffic, computed once per kind of stage."""
    prefixes = [0, *accumulate(partition)][:-1]
    times = {}
    for stage in stages:
        key = _kind(stage, placement)
        if key in times:
            continue
        _, send_forward, send_backward = key[:3]
        common = dict(sp=layout.sp, sp_cross=placement.sp_cross_node)
        forward = tuple(
            costs.forward(stage, n, c, send_cross=send_forward, **common)
            for n, c in zip(partition, prefixes, strict=True)
        )
        backward = tuple(
            costs.backward(stage, n, c, send_cross=send_backward, **common)
            for n, c in zip(partition, prefixes, strict=True)
        )
        times[key] = (forward, backward)
    return times


def _kind(stage: StageSpec, placement: Placement) -> tuple:
    """What a stage's times depend on: layers, ends, and whether its neighbours are across the network."""
    k = stage.index
    send_forward = None if stage.last else placement.boundary_cross_node[k]
    send_backward = None if stage.first else placement.boundary_cross_node[k - 1]
    return (stage.layers, send_forward, send_backward, stage.first, stage.last)


def _plan_stages(
    costs: CostModel,
    layout: Layout,
    placement: Placement,
    stages: Sequence[StageSpec],
    partition: Sequence[int],
    timed: dict,
    policy: str,
    sync: str,
    batch: int,
    reserved: int,
) -> tuple[StagePlan, ...]:
    planned: dict[tuple, StagePlan] = {}
    out = []
    for stage in stages:
        key = _kind(stage, placement)
        if key not in planned:
            forward, backward = timed[key]
            planned[key] = _plan_stage(
                costs, layout, placement, stage, partition, forward, backward, policy, sync, batch, reserved
            )
        out.append(_with_stage(planned[key], stage))
    return tuple(out)


_FP32 = 4


def _with_stage(plan: StagePlan, stage: StageSpec) -> StagePlan:
    if plan.stage == stage:
        return plan
    return StagePlan(stage, plan.forward, plan.backward, plan.offload, plan.memory)


def _with_fsdp(
    costs: CostModel, layout: Layout, placement: Placement, kind: tuple, passes: tuple, sync: str
) -> tuple[tuple[PassTimes, ...], tuple[PassTimes, ...]]:
    """Forward and backward passes of one kind of stage plus the FSDP communication they cannot hide."""
    shards = layout.dp * layout.sp
    if shards == 1:
        return passes
    layers, first, last = kind[0], kind[3], kind[4]
    params = stage_parameter_counts(costs.config, StageSpec(0, layers, first, last))
    units = layers + (params.root > 0)
    out = []
    for backward, times in enumerate(passes):
        comm = [
            costs.fsdp_pass_comm(
                params.total, shards, placement.fsdp_cross_node, sync, backward=bool(backward), first=first_pass
            )
            for first_pass in (False, True)
        ]
        out.append(
            tuple(
                PassTimes(t.compute, t.all_to_all, t.p2p, _exposed(comm[i == 0], t.compute, units))
                for i, t in enumerate(times)
            )
        )
    return out[0], out[1]


def _exposed(comm: float, compute: float, units: int) -> float:
    """FSDP overlaps each unit's communication with its neighbour's compute (``planner.costs``)."""
    return max(comm - compute, comm / max(1, units)) if comm else 0.0


def _plan_stage(
    costs: CostModel,
    layout: Layout,
    placement: Placement,
    stage: StageSpec,
    partition: Sequence[int],
    forward: tuple[PassTimes, ...],
    backward: tuple[PassTimes, ...],
    policy: str,
    sync: str,
    batch: int,
    reserved: int,
) -> StagePlan:
    config, dtypes, sp = costs.config, costs.dtypes, layout.sp
    seq_len = sum(partition)
    level2 = level2_bytes(config, dtypes, stage, partition, sp, batch)
    offload = plan_offload(policy, level2, [t.total for t in forward], [t.total for t in backward], costs)
    memory = replace(
        _stage_state(costs, layout, stage, seq_len, sync, batch, reserved),
        activations=offload.device_peak,
        transient=transient_bytes(config, dtypes, stage, seq_len, max(partition), sp, batch),
        host=offload.host_bytes,
    )
    return StagePlan(stage, forward, backward, offload, memory)


def _stage_state(
    costs: CostModel, layout: Layout, stage: StageSpec, seq_len: int, sync: str, batch: int, reserved: int
) -> MemoryBreakdown:
    """What a stage's rank holds whatever the schedule: model state, level 1 and the stage's messages.

    Activations, temporaries and host bytes are left at 0 for the caller (they depend on the schedule).
    """
    config, dtypes, sp = costs.config, costs.dtypes, layout.sp
    params = stage_parameter_counts(config, stage)
    weights, grads, optimizer = model_state_bytes(params, dtypes, layout.dp * sp, sync)
    kv, kv_grad = level1_bytes(config, dtypes, stage, seq_len, sp, batch)
    boundary = boundary_bytes(config, dtypes, stage, seq_len, sp, batch)
    return MemoryBreakdown(
        weights=weights, gradients=grads, optimizer=optimizer, kv_cache=kv, kv_grad=kv_grad,
        activations=0, boundary=boundary, transient=0, reserved=reserved, host=0,
    )  # fmt: skip


# -- the "sppo" schedule ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _SharedPlan:
    """Per stage: its shared units' ranks, each member's seconds, and the stream peak of the stage's rank."""

    groups: dict[int, dict[int, tuple[int, ...]]]
    times: dict[int, dict[tuple[int, int], ShareTimes]]
    streams: dict[int, Stream]
    saved: dict[tuple[int, int, int], tuple[int, int]]
    """(stage, subsequence, rank) -> what that member saves of the unit, and what of it stays on the device."""

    @classmethod
    def of(
        cls, costs: CostModel, layout: Layout, placement: Placement, stages: Sequence[StageSpec],
        partition: Sequence[int], batch: int,
    ) -> _SharedPlan:  # fmt: skip
        config, dtypes = costs.config, costs.dtypes
        groups = shared_units(layout.pp, len(partition))
        times = {s.index: _shared_times(costs, layout, placement, s, partition, groups[s.index], batch) for s in stages}
        streams = {
            s.index: stream_peak(config, dtypes, stages, s.index, partition, layout.sp, layout.dp, batch)
            for s in stages
        }
        saved = {}
        for stage in stages:
            for sub, ranks in groups[stage.index].items():
                for rank in ranks:
                    share = unit_share(config, partition[sub], layout.sp, ranks, rank, stage.index)
                    saved[(stage.index, sub, rank)] = (
                        shared_saved_bytes(config, dtypes, stage, partition[sub], share, layout.sp, batch),
                        shared_kept_bytes(config, dtypes, stage, share, batch),
                    )
        return cls(groups, times, streams, saved)


def _plan_stages_multiplexed(
    costs: CostModel,
    layout: Layout,
    placement: Placement,
    stages: Sequence[StageSpec],
    partition: Sequence[int],
    timed: dict,
    policy: str,
    sync: str,
    batch: int,
    reserved: int,
    shared: _SharedPlan,
) -> tuple[StagePlan, ...]:
    """Every stage on its own: what a rank holds and waits for depends on where it sits in the pipeline."""
    return tuple(
        _plan_stage_multiplexed(
            costs, layout, placement, stages, stage, partition, timed, policy, sync, batch, reserved, shared
        )
        for stage in stages
    )


def _plan_stage_multiplexed(
    costs: CostModel,
    layout: Layout,
    placement: Placement,
    stages: Sequence[StageSpec],
    stage: StageSpec,
    partition: Sequence[int],
    timed: dict,
    policy: str,
    sync: str,
    batch: int,
    reserved: int,
    shared: _SharedPlan,
) -> StagePlan:
    config, dtypes, sp = costs.config, costs.dtypes, layout.sp
    seq_len, k = sum(partition), stage.index
    forward, backward = timed[_kind(stage, placement)]
    mine = shared.groups[k]
    level2 = level2_bytes(config, dtypes, stage, partition, sp, batch)
    offload = plan_offload(
        policy, level2, [t.total for t in forward], [t.total for t in backward], costs, shared=frozenset(mine)
    )
    offloaded = [round(a * b) for a, b in zip(offload.alpha, level2, strict=True)]

    shared_host = 0

    def shared_bytes(action) -> tuple[int, int]:
        nonlocal shared_host
        saved, kept = shared.saved[(action.stage, action.subsequence, k)]
        off = 0 if policy == "none" else saved - kept
        shared_host += off  # the host pool is reset at the end of the step only
        return saved, off

    actions = rank_actions(layout.pp, len(partition), k)
    own = _stage_state(costs, layout, stage, seq_len, sync, batch, reserved)
    stream = shared.streams[k]
    activations = activation_peak(actions, k, level2, offloaded, shared_bytes)
    longest = max(partition)
    transient = max(
        transient_bytes(config, dtypes, stage, seq_len, longest, sp, batch),
        transient_bytes(config, dtypes, stages[-1], seq_len, longest, sp, batch),  # helping the last stage
    )
    # Shared units add to the sharded gradients at once; under sync "step" those exist beside FSDP's unsharded ones.
    sharded_grads = _FP32 * stage_parameter_counts(config, stage).total // (layout.dp * sp) if sync == "step" else 0
    # Under "regather" FSDP holds no gathered block between the stage's own passes, when shared units run: the
    # streams and FSDP's gathered blocks (counted in ``weights``) are never held at once.
    gathered = _regathered(config, dtypes, stage, layout.dp * sp) if sync == "regather" else 0
    memory = replace(
        own,
        gradients=own.gradients + (sharded_grads if layout.dp * sp > 1 else 0),
        activations=activations,
        transient=transient,
        host=offload.host_bytes + shared_host,
        stream_weights=max(0, stream.weights - gathered),
        stream_kv=max(0, stream.kv - max(0, gathered - stream.weights)),
    )
    return StagePlan(stage, forward, backward, offload, memory, shared.times[k])


def _regathered(config: GPTConfig, dtypes, stage: StageSpec, shards: int) -> int:
    """The gathered weights ``model_state_bytes`` counts under sync "regather" (the root and two blocks)."""
    if shards == 1:
        return 0
    params = stage_parameter_counts(config, stage)
    return dtypes.working * min(params.total, params.root + 2 * params.block)


def _shared_times(
    costs: CostModel, layout: Layout, placement: Placement, stage: StageSpec, partition: Sequence[int],
    mine: dict[int, tuple[int, ...]], batch: int,
) -> dict[tuple[int, int], ShareTimes]:  # fmt: skip
    """(subsequence, rank) -> that member's seconds for each of ``stage``'s shared units."""
    offsets = [0, *accumulate(partition)][:-1]
    times = {}
    for sub, ranks in mine.items():
        members = shared_seconds(costs, layout, placement, stage, partition[sub], offsets[sub], ranks, batch=batch)
        times |= {(sub, rank): t for rank, t in members.items()}
    return times
