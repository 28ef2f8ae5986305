"""Evaluate one candidate (layout, N, FSDP sync mode): per-stage times, offload decision and memory.

Offload policies are tried in the order none, adaptive, full and the first that fits is kept: "none"
copies nothing, "adaptive" copies only what the next forward hides (so it costs no time), and "full"
frees the most device memory but may expose copy time. The FSDP sync mode (``parallel/fsdp.py``) trades
memory for communication; the solver evaluates each allowed mode and keeps the fastest that fits. Stages
that are alike (same layer count, same ends, same links) share their numbers, which keeps the search fast.

Recompute and model state on host (``planner.options``) come with the cost model (``CostModel.recompute``,
``CostModel.model_state``). K/V spilled to host is decided here: with ``kv_device_tokens="auto"`` every offload
policy is tried first with all K/V on the device, then with the largest R (tokens of each layer's K/V kept on the
device, the same on every stage as the run's one setting) that fits the fullest stage: the device bytes R frees
are known exactly, so R is solved for, then checked with the spill's own copy times and temporaries.

Under the "sppo" schedule (``planner.multiplexed``) each rank also runs shares of other stages' units, streaming
their weights one piece at a time and the K/V of its heads one layer at a time, so every stage is planned on its
own: its shared units are not offloaded, its activation peak comes from walking its action list, it holds the
largest weight + K/V stream of the units it takes part in, and each member's share of a unit carries its compute
and its group's traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.activations import kv_cache_bytes_per_layer
from lightning_sppo.planner.alpha import OffloadPlan, plan_offload
from lightning_sppo.planner.costs import CostModel, PassTimes
from lightning_sppo.planner.layout import Layout, Placement, StageSpec
from lightning_sppo.planner.memory import (
    MemoryBreakdown,
    boundary_bytes,
    host_state_bytes,
    kv_spill_bytes,
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
    shared_copy_seconds,
    shared_kept_bytes,
    shared_saved_bytes,
    shared_seconds,
    shared_units,
    stream_peak,
    unit_share,
)
from lightning_sppo.planner.options import DEFAULT_KV_CHUNK_TOKENS, KV_AUTO, KVDeviceTokens

__all__ = [
    "OFFLOAD_ORDER",
    "SCHEDULE_ORDER",
    "Evaluation",
    "Limits",
    "StagePlan",
    "evaluate",
    "fixed_memory",
    "stage_times",
    "with_fsdp",
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
    optimizer_s: float = 0.0
    """The CPU AdamW step of this rank's shard when model state lives on host (once per step)."""

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
    recompute: str = "none"
    model_state: str = "device"
    kv_device_tokens: int | None = None
    """R, the tokens of each layer's K/V kept on the device; None: all of them."""

    @property
    def optimizer_s(self) -> float:
        """The slowest stage's CPU optimizer step (model state on host), after the pipeline drains."""
        return max(s.optimizer_s for s in self.stages)

    @property
    def num_subsequences(self) -> int:
        return len(self.partition)

    @property
    def peak_stage(self) -> StagePlan:
        """The stage with the highest device peak (the one that decides whether the layout fits)."""
        return max(self.stages, key=lambda s: s.memory.allocated_bytes + s.memory.allocator_slack)

    @property
    def peak_gpu_bytes(self) -> int:
        """Predicted device peak of the fullest stage."""
        return max(s.memory.peak_gpu_bytes for s in self.stages)

    @property
    def peak_host_bytes(self) -> int:
        """Predicted host bytes of the stage that keeps the most there (activations, K/V, model state)."""
        return max(s.memory.host_bytes for s in self.stages)

    @property
    def gpu_overflow(self) -> int:
        """Bytes over the device limit on the fullest stage (<= 0 when it fits)."""
        return max(s.memory.allocated_bytes + s.memory.allocator_slack for s in self.stages) - self.limits.gpu_bytes

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
    schedule: str = "seq1f1b", stages: Sequence[StageSpec] | None = None, kv_device_tokens: KVDeviceTokens = None,
    kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS,
) -> int:  # fmt: skip
    """Device bytes of a stage that no choice of N or alpha changes: model state, level 1 (of R = ``kv_device_tokens``
    tokens; "auto": only the chunks in flight, as all K/V may go to host), boundary messages (the same under "sppo":
    its streams depend on N and are counted with the activations)."""
    params = stage_parameter_counts(config, stage)
    state = sum(model_state_bytes(params, costs.dtypes, layout.dp * layout.sp, sync, costs.model_state == "host"))
    device_tokens = 0 if kv_device_tokens == KV_AUTO else kv_device_tokens
    kv = kv_spill_bytes(config, costs.dtypes, stage, seq_len, layout.sp, batch, device_tokens, kv_chunk_tokens)
    return state + sum(kv[:3]) + boundary_bytes(config, costs.dtypes, stage, seq_len, layout.sp, batch)


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
    kv_device_tokens: KVDeviceTokens = None,
    kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS,
    fsdp_applied: bool = False,
) -> Evaluation:
    """Plan every stage of ``layout`` for ``partition`` under ``schedule``, trying ``offloads`` in order until one
    fits; ``kv_device_tokens``: R, None (all K/V on the device) or "auto" (module docstring).

    ``times`` are ``stage_times`` of the same layout and partition, when the caller already has them; ``shared``, a
    dict the caller keeps for one layout and partition, holds what "sppo"'s shared units take across calls (per
    recompute mode, model state place and K/V spill).
    ``fsdp_applied``: ``times`` already carry the FSDP traffic of ``sync`` (``with_fsdp``).
    """
    if schedule not in SCHEDULE_ORDER:
        raise ValueError(f"The planner models schedule in {list(SCHEDULE_ORDER)}, got --schedule={schedule!r}.")
    timed = times if times is not None else stage_times(costs, layout, placement, stages, partition)
    if not fsdp_applied:
        timed = with_fsdp(costs, layout, placement, timed, sync)
    multiplexed = schedule == SCHEDULE_NAME and layout.pp > 1
    # What shared units stream and take does not depend on the offload policy or the sync mode: once per candidate
    # and recompute mode, model state place and K/V spill (``_SharedPlan.cached``).
    shared = shared if shared is not None else {}
    options = dict(recompute=costs.recompute, model_state=costs.model_state)
    pinned = kv_device_tokens if kv_device_tokens != KV_AUTO else None
    spill = _Spill(costs, stages, sum(partition), layout.sp, batch, limits, kv_chunk_tokens)

    def plan(policy: str, tokens: int | None) -> Evaluation:
        if multiplexed:
            units = _SharedPlan.cached(shared, costs, layout, placement, stages, partition, batch, tokens, spill)
            planned = _plan_stages_multiplexed(
                costs, layout, placement, stages, partition, timed, policy, sync, batch, reserved, units,
                spill.at(tokens),
            )  # fmt: skip
        else:
            planned = _plan_stages(
                costs, layout, placement, stages, partition, timed, policy, sync, batch, reserved, spill.at(tokens)
            )
        return Evaluation(
            layout, placement, tuple(partition), planned, limits, partition_policy, sync, schedule, **options,
            kv_device_tokens=tokens if spill.spills(tokens) else None,
        )  # fmt: skip

    attempts = []
    for policy in offloads:
        attempts.append(plan(policy, pinned))
        if attempts[-1].feasible:
            return attempts[-1]
    if kv_device_tokens == KV_AUTO:
        for whole in attempts:  # the same policies, now keeping only the prefix of K/V that fits
            if multiplexed:  # under any spill the shared units stream the prefix in chunks: R is fitted from that
                whole = plan(whole.policy, spill.seq_len)
            attempt = spill.fit(whole, lambda tokens, p=whole.policy: plan(p, tokens))
            if attempt is not None and attempt.feasible:
                return attempt
    return attempts[-1]


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
        first = forward[0]  # the step's start (the K/V gradient buffers zeroed) rides on the first forward
        start = costs.step_seconds(stage, sum(partition), layout.sp)
        forward = (replace(first, compute=first.compute + start), *forward[1:])
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


@dataclass(frozen=True)
class _SpillAt:
    """K/V of each layer's tokens [0, device_tokens) on the device (None: all), in chunks of ``chunk_tokens``."""

    device_tokens: int | None
    chunk_tokens: int


_SPILL_ROUNDING = 1024
"""R is a multiple of this when the planner chooses it (whole kernel tiles, a readable number)."""
_SPILL_REFITS = 2
"""Times R is lowered again when the spill's own copy times and temporaries still overflow (each by the overflow)."""


class _Spill:
    """The largest R that fits one evaluation: per token of R a stage holds its layers' K/V and dK/dV, and the
    kernel's prefix dK/dV temporary covers up to R tokens (``transient_bytes``' window)."""

    def __init__(
        self, costs: CostModel, stages: Sequence[StageSpec], seq_len: int, sp: int, batch: int, limits: Limits,
        chunk_tokens: int,
    ) -> None:  # fmt: skip
        self.stages, self.seq_len, self.limits, self.chunk_tokens = stages, seq_len, limits, chunk_tokens
        kv, grad = kv_cache_bytes_per_layer(costs.config, costs.dtypes, 1, sp, batch)
        self.per_token = {s.layers: s.layers * (kv + grad) for s in stages}
        self.window = kv * (2 if batch > 1 else 1)
        self.in_flight = 2 * min(chunk_tokens, seq_len) * (kv + grad)

    def spills(self, tokens: int | None) -> bool:
        return tokens is not None and tokens < self.seq_len

    def at(self, tokens: int | None) -> _SpillAt:
        return _SpillAt(tokens if self.spills(tokens) else None, self.chunk_tokens)

    def fit(self, whole: Evaluation, plan) -> Evaluation | None:
        """``plan(R)`` at the largest R that fits ``whole`` (the evaluation with all K/V on the device), checked and
        lowered by what still overflows; None when even R = 0 leaves more than the K/V over the device limit."""
        if whole.gpu_overflow <= 0:
            return None  # over the host limit: spilling only adds to it
        tokens = min(self._largest(stage.stage, stage.memory) for stage in whole.stages)
        if tokens < 0:
            return None
        attempt = plan(tokens)
        for _ in range(_SPILL_REFITS):
            if attempt.gpu_overflow <= 0 or tokens == 0:
                break
            per_token = max(self.per_token.values())
            tokens = max(0, _round_down(tokens - -(-attempt.gpu_overflow // per_token)))
            attempt = plan(tokens)
        return attempt

    def _largest(self, stage: StageSpec, memory: MemoryBreakdown) -> int:
        """R at which this stage's device bytes meet the limit, from its bytes with all K/V on the device."""
        layers = stage.layers
        rest = memory.allocated_bytes + memory.allocator_slack - memory.level1_bytes - self.window * self.seq_len
        room = self.limits.gpu_bytes - rest - self.in_flight
        tokens = room // (self.per_token[layers] + self.window)
        if tokens < self.chunk_tokens:  # the kernel's window is a chunk at least
            tokens = (room - self.window * self.chunk_tokens) // self.per_token[layers]
        return _round_down(min(tokens, self.seq_len - 1)) if tokens >= 0 else -1


def _round_down(tokens: int) -> int:
    return tokens - tokens % _SPILL_ROUNDING if tokens >= _SPILL_ROUNDING else tokens


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
    spill: _SpillAt,
) -> tuple[StagePlan, ...]:
    planned: dict[tuple, StagePlan] = {}
    out = []
    for stage in stages:
        key = _kind(stage, placement)
        if key not in planned:
            forward, backward = timed[key]
            planned[key] = _plan_stage(
                costs, layout, placement, stage, partition, forward, backward, policy, sync, batch, reserved, spill
            )
        out.append(_with_stage(planned[key], stage))
    return tuple(out)


_FP32 = 4


def _with_stage(plan: StagePlan, stage: StageSpec) -> StagePlan:
    if plan.stage == stage:
        return plan
    return StagePlan(stage, plan.forward, plan.backward, plan.offload, plan.memory, plan.shared, plan.optimizer_s)


def with_fsdp(costs: CostModel, layout: Layout, placement: Placement, times: dict, sync: str) -> dict:
    """``stage_times`` plus the FSDP traffic of ``sync`` (and, with model state on host, its copies)."""
    return {key: _with_fsdp(costs, layout, placement, key, passes, sync) for key, passes in times.items()}


def _with_fsdp(
    costs: CostModel, layout: Layout, placement: Placement, kind: tuple, passes: tuple, sync: str
) -> tuple[tuple[PassTimes, ...], tuple[PassTimes, ...]]:
    """Forward and backward passes of one kind of stage plus the FSDP communication they cannot hide."""
    shards = layout.dp * layout.sp
    if shards == 1 and costs.model_state != "host":  # no FSDP (with model state on host: a one-rank FSDP mesh)
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
        out.append(tuple(replace(t, fsdp=_exposed(comm[i == 0], t.compute, units)) for i, t in enumerate(times)))
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
    spill: _SpillAt,
) -> StagePlan:
    config, dtypes, sp = costs.config, costs.dtypes, layout.sp
    seq_len = sum(partition)
    if spill.device_tokens is not None:
        forward, backward = _with_spill(costs, layout, stage, partition, forward, backward, batch, spill.device_tokens)
    level2 = level2_bytes(config, dtypes, stage, partition, sp, batch, costs.recompute)
    if policy != "none":  # the offloader's hooks pack and unpack every saved tensor in Python
        prefixes = [0, *accumulate(partition)][:-1]
        forward = tuple(costs.with_hooks(t, stage, c) for t, c in zip(forward, prefixes, strict=True))
        backward = tuple(costs.with_hooks(t, stage, c) for t, c in zip(backward, prefixes, strict=True))
    units = [stage.layers * costs.saved_per_layer(i > 0)[1] for i in range(len(partition))]
    offload = plan_offload(policy, level2, [t.total for t in forward], [t.total for t in backward], costs, units=units)
    if offload.host_bytes and costs.profile.copy_unit_s:  # the copies are issued from Python: host time, then waits
        sent = [u * a for u, a in zip(units, offload.alpha, strict=True)]
        forward = tuple(costs.with_copies_issued(t, u) for t, u in zip(forward, sent, strict=True))
        backward = tuple(costs.with_copies_issued(t, u) for t, u in zip(backward, [*sent[1:], 0.0], strict=True))
        offload = plan_offload(
            policy, level2, [t.total for t in forward], [t.total for t in backward], costs, units=units
        )
    window = None if spill.device_tokens is None else max(spill.device_tokens, spill.chunk_tokens)
    state = _stage_state(costs, layout, stage, seq_len, sync, batch, reserved, spill, seq_len - partition[-1])
    copies = dtypes.autocast_copy * stage_parameter_counts(config, stage).cast if costs.recompute != "none" else 0
    activations, credit, dropped = _activation_peak(offload, state.gradients, copies)
    memory = replace(
        state,
        activations=activations,
        transient=transient_bytes(config, dtypes, stage, seq_len, max(partition), sp, batch, costs.recompute, window),
        host=offload.host_bytes,
        gradient_credit=credit,
        autocast_credit=dropped,
    )
    return StagePlan(stage, forward, backward, offload, memory, optimizer_s=_optimizer_s(costs, layout, stage))


def _activation_peak(offload: OffloadPlan, gradients: int, copies: int = 0) -> tuple[int, int, int]:
    """(level 2 at the step's peak, the gradients not yet built then, the weight copies dropped by then): the step
    starts without gradients and builds them all in its first backward, so the peak is the forward's or the first
    backward's without them, or a later backward's with them (``alpha.backward_residency``); ``copies``, autocast's
    weight copies that only the forward holds (under recompute), count in the forward's peak only."""
    forward = offload.device_peak + copies
    first = offload.first_backward_peak
    later = offload.backward_peak + gradients
    if later >= max(forward, first):
        return offload.backward_peak, 0, copies
    if first >= forward:
        return first, gradients, copies
    return offload.device_peak, gradients, 0


def _with_spill(
    costs: CostModel, layout: Layout, stage: StageSpec, partition: Sequence[int], forward: tuple[PassTimes, ...],
    backward: tuple[PassTimes, ...], batch: int, device_tokens: int,
) -> tuple[tuple[PassTimes, ...], tuple[PassTimes, ...]]:  # fmt: skip
    """The passes plus the K/V copies their attention does not hide (``CostModel.spill_seconds``)."""
    prefixes = [0, *accumulate(partition)][:-1]
    waits = [
        costs.spill_seconds(stage, n, c, layout.sp, device_tokens, batch)
        for n, c in zip(partition, prefixes, strict=True)
    ]
    return (
        tuple(_add_spill(t, w[0]) for t, w in zip(forward, waits, strict=True)),
        tuple(_add_spill(t, w[1]) for t, w in zip(backward, waits, strict=True)),
    )


def _add_spill(times: PassTimes, seconds: float) -> PassTimes:
    return replace(times, spill=seconds) if seconds else times


def _optimizer_s(costs: CostModel, layout: Layout, stage: StageSpec) -> float:
    return costs.optimizer_seconds(stage_parameter_counts(costs.config, stage).total, layout.dp * layout.sp)


def _stage_state(
    costs: CostModel, layout: Layout, stage: StageSpec, seq_len: int, sync: str, batch: int, reserved: int,
    spill: _SpillAt | None = None, last_offset: int | None = None,
) -> MemoryBreakdown:  # fmt: skip
    """What a stage's rank holds whatever the schedule: model state, level 1 (dK/dV of the tokens before the last
    subsequence, ``last_offset``) and the stage's messages.

    Activations, temporaries and offloaded bytes are left at 0 for the caller (they depend on the schedule).
    """
    config, dtypes, sp = costs.config, costs.dtypes, layout.sp
    params = stage_parameter_counts(config, stage)
    host = costs.model_state == "host"
    weights, grads, optimizer = model_state_bytes(params, dtypes, layout.dp * sp, sync, host)
    optimizer = optimizer if costs.optimizer else 0  # a step without the optimizer's (gpu_suite's) holds no AdamW state
    spill = spill or _SpillAt(None, DEFAULT_KV_CHUNK_TOKENS)
    summed = last_offset if costs.kv_grads == "before_last" else None
    kv, kv_grad, in_flight, host_kv = kv_spill_bytes(
        config, dtypes, stage, seq_len, sp, batch, spill.device_tokens, spill.chunk_tokens, summed
    )
    boundary = boundary_bytes(config, dtypes, stage, seq_len, sp, batch)
    return MemoryBreakdown(
        weights=weights, gradients=grads, optimizer=optimizer, kv_cache=kv, kv_grad=kv_grad,
        activations=0, boundary=boundary, transient=0, reserved=reserved, host=0, kv_in_flight=in_flight,
        host_kv=host_kv, host_state=host_state_bytes(params, layout.dp * sp) if host else 0,
        allocator_slack=costs.profile.allocator_slack_bytes,
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
    peaks: dict = field(default_factory=dict)
    """(stage, policy, level 2, offloaded) -> (activation peak, shared units' host bytes): the walk over the rank's
    actions, the same for every sync mode and K/V spill that leave its offload unchanged; and ("spill", kind of stage,
    R, passes) -> the passes with their K/V copies, the same for alike stages and every offload policy."""

    def activation_peak(
        self, layout: Layout, stage: int, policy: str, level2: Sequence[int], offloaded: Sequence[int]
    ) -> tuple[int, int]:
        """``multiplexed.activation_peak`` of the rank of ``stage``, and the host bytes its shared units offload."""
        key = (stage, policy, tuple(level2), tuple(offloaded))
        if key not in self.peaks:
            host = 0

            def shared_bytes(action) -> tuple[int, int]:
                nonlocal host
                saved, kept = self.saved[(action.stage, action.subsequence, stage)]
                off = 0 if policy == "none" else saved - kept
                host += off  # the host pool is reset at the end of the step only
                return saved, off

            actions = rank_actions(layout.pp, len(level2), stage)
            self.peaks[key] = (activation_peak(actions, stage, level2, offloaded, shared_bytes), host)
        return self.peaks[key]

    @classmethod
    def cached(
        cls, cache: dict, costs: CostModel, layout: Layout, placement: Placement, stages: Sequence[StageSpec],
        partition: Sequence[int], batch: int, tokens: int | None, spill: _Spill,
    ) -> _SharedPlan:  # fmt: skip
        """What shared units take on one layout and partition (``cache``), under the costs' recompute mode and model
        state place and the K/V spill: with any ``kv_device_tokens`` (``tokens`` not None) the owner's prefix streams
        in chunks, and the host part beyond R costs the owner copies. Each part is kept for what it depends on."""
        config, dtypes = costs.config, costs.dtypes
        chunk = None if tokens is None else spill.chunk_tokens
        device_tokens = spill.at(tokens).device_tokens
        groups = shared_units(layout.pp, len(partition))

        def part(key: tuple, make):
            if key not in cache:
                cache[key] = make()
            return cache[key]

        def shared_times() -> dict:
            return {
                s.index: _shared_times(costs, layout, placement, s, partition, groups[s.index], batch) for s in stages
            }

        def copy_times() -> dict:
            return {
                s.index: _copy_times(costs, layout, s, partition, groups[s.index], batch, device_tokens) for s in stages
            }

        def stream_peaks() -> dict:
            return {
                s.index: stream_peak(
                    config, dtypes, stages, s.index, partition, layout.sp, layout.dp, batch, chunk=chunk
                )
                for s in stages
            }

        times = part(("times", costs.recompute, costs.model_state), shared_times)
        if device_tokens is not None:
            copies = part(("copies", costs.model_state, device_tokens), copy_times)
            times = {k: {key: _plus(t, *copies[k][key[0]]) for key, t in unit.items()} for k, unit in times.items()}
        streams = part(("streams", dtypes, chunk), stream_peaks)
        saved = part(
            ("saved", costs.recompute, dtypes), lambda: _saved(costs, layout, stages, partition, groups, batch)
        )
        peaks = part(("peaks", costs.recompute, dtypes), dict)
        return cls(groups, times, streams, saved, peaks)


def _saved(
    costs: CostModel, layout: Layout, stages: Sequence[StageSpec], partition: Sequence[int], groups: dict, batch: int
) -> dict[tuple[int, int, int], tuple[int, int]]:
    """(stage, subsequence, rank) -> what that member saves of the unit, and what of it stays on the device."""
    config, dtypes = costs.config, costs.dtypes
    saved = {}
    for stage in stages:
        for sub, ranks in groups[stage.index].items():
            for rank in ranks:
                offset = sum(partition[:sub])
                share = unit_share(config, partition[sub], layout.sp, ranks, rank, stage.index, offset)
                saved[(stage.index, sub, rank)] = (
                    shared_saved_bytes(config, dtypes, stage, partition[sub], share, layout.sp, batch, costs.recompute),
                    shared_kept_bytes(config, dtypes, stage, share, batch),
                )
    return saved


def _copy_times(
    costs: CostModel, layout: Layout, stage: StageSpec, partition: Sequence[int], mine: dict[int, tuple[int, ...]],
    batch: int, device_tokens: int,
) -> dict[int, tuple[float, float]]:  # fmt: skip
    """subsequence -> what the owner's host copies add to each member's share of ``stage``'s unit (K/V spilled)."""
    offsets = [0, *accumulate(partition)][:-1]
    return {
        sub: shared_copy_seconds(costs, layout, stage, partition[sub], offsets[sub], ranks, device_tokens, batch)
        for sub, ranks in mine.items()
    }


def _plus(times: ShareTimes, forward: float, backward: float) -> ShareTimes:
    return replace(times, forward=times.forward + forward, backward=times.backward + backward)


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
    spill: _SpillAt,
) -> tuple[StagePlan, ...]:
    """Every stage on its own: what a rank holds and waits for depends on where it sits in the pipeline."""
    return tuple(
        _plan_stage_multiplexed(
            costs, layout, placement, stages, stage, partition, timed, policy, sync, batch, reserved, shared, spill
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
    spill: _SpillAt,
) -> StagePlan:
    config, dtypes, sp = costs.config, costs.dtypes, layout.sp
    seq_len, k = sum(partition), stage.index
    kind = _kind(stage, placement)
    forward, backward = timed[kind]
    if spill.device_tokens is not None:  # the stage's own units stream their host K/V as under seq1f1b
        key = ("spill", kind, spill.device_tokens, forward, backward)  # alike stages, every offload policy
        if key not in shared.peaks:
            shared.peaks[key] = _with_spill(
                costs, layout, stage, partition, forward, backward, batch, spill.device_tokens
            )
        forward, backward = shared.peaks[key]
    mine = shared.groups[k]
    level2 = level2_bytes(config, dtypes, stage, partition, sp, batch, costs.recompute)
    offload = plan_offload(
        policy, level2, [t.total for t in forward], [t.total for t in backward], costs, shared=frozenset(mine)
    )
    offloaded = [round(a * b) for a, b in zip(offload.alpha, level2, strict=True)]
    activations, shared_host = shared.activation_peak(layout, k, policy, level2, offloaded)
    own = _stage_state(costs, layout, stage, seq_len, sync, batch, reserved, spill, seq_len - partition[-1])
    stream = shared.streams[k]
    longest = max(partition)
    window = None if spill.device_tokens is None else max(spill.device_tokens, spill.chunk_tokens)
    transient = max(
        transient_bytes(config, dtypes, stage, seq_len, longest, sp, batch, costs.recompute, window),
        transient_bytes(config, dtypes, stages[-1], seq_len, longest, sp, batch, costs.recompute, window),  # the last's
    )
    # Shared units add to the sharded gradients at once; under sync "step" those exist beside FSDP's unsharded ones
    # (in host memory, with model state on host).
    device_grads = sync == "step" and layout.dp * sp > 1 and costs.model_state != "host"
    sharded_grads = _FP32 * stage_parameter_counts(config, stage).total // (layout.dp * sp) if device_grads else 0
    # Under "regather" FSDP holds no gathered block between the stage's own passes, when shared units run: the
    # streams and FSDP's gathered blocks (counted in ``weights``) are never held at once.
    gathered = _regathered(config, dtypes, stage, layout.dp * sp) if sync == "regather" else 0
    memory = replace(
        own,
        gradients=own.gradients + sharded_grads,
        activations=activations,
        transient=transient,
        host=offload.host_bytes + shared_host,
        stream_weights=max(0, stream.weights - gathered),
        stream_kv=max(0, stream.kv - max(0, gathered - stream.weights)),
    )
    return StagePlan(stage, forward, backward, offload, memory, shared.times[k], _optimizer_s(costs, layout, stage))


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
