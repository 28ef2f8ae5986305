"""The "sppo" schedule (multiplexed sequence partitioning) as the runtime runs it (``runtime/multiplexed.py``).

Which units are shared, and with whom, is the schedule's data (``schedule.msp``): stage s shares its Left-SP
units with ``left_ranks(s)`` = s..pp-1 and its Right-SP units with ``right_ranks(s)`` = 0..s. Every rank r is
therefore in a group of every other stage (of s < r's Left-SP, of s > r's Right-SP), and it runs shards of
that stage's units in every step. What that costs rank r, besides its own stage (``SharedUnits``):

    replica weights  every other stage, unsharded, in the activation dtype w (``parallel.fsdp.activation_dtype``:
                     bf16 on a sharded stage under bf16-mixed, else fp32), + autocast's bf16 copies of its
                     linear weights on an unsharded bf16-mixed stage (the step's one autocast context keeps them)
    replica grads    their ``p.grad``, in w, from the first backward that reaches them to the next step; counted
                     in full at the backward peak, an upper bound (the lower stages' replica gradients appear
                     only in the step's last backwards), as the planner counts every term at its own maximum
    replica K/V      per other stage a ``CachePool`` of its layers: K/V [B, G/sp, S, Dh] in the compute dtype and
                     dK/dV accumulators, for the WHOLE sequence S, allocated at the first shared unit and kept
                     across steps (``KVCache.reset`` keeps an allocation of the same length). With every stage's
                     replica, a rank holds level 1 of all n_layer layers, not of its own layers only
    shared units     per shared unit in flight, never offloaded: the saved activations of the rank's block, the
                     whole unit's input [B, L, D] (each member's block input is a view of it) and the block's
                     output; counted by walking the rank's action list together with its own units' offload
    step buffers     ``begin_step``/``end_step``: flat fp32 copies of a stage's weights (broadcast) and of the
                     replicas' gradients (reduced), one group at a time; a transient at the step's ends, when no
                     activations or stage messages are held (and, at the beginning, no replica gradients)

Time: a shard costs its share of the stage's compute and all-to-all; each shared action also moves data inside
its group (the unit's input or output gradient broadcast, the blocks' outputs or input gradients gathered, per
layer the blocks' K/V all-gathered and the dK/dV of the unit all-reduced, and, for a group that starts in the
middle of the sequence, the prefix K/V broadcast and its dK/dV reduced back). Each step begins with one fp32
broadcast of every stage's weights per group and ends with one fp32 reduce of the replicas' gradients per
group. Group links cross nodes when any of the group's pipeline boundaries does (``planner.layout``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.parallel.multiplex import block_lengths
from lightning_sppo.planner.activations import kv_cache_bytes_per_layer
from lightning_sppo.planner.costs import CostModel
from lightning_sppo.planner.layout import Layout, Placement, StageSpec
from lightning_sppo.planner.memory import level2_bytes, stage_parameter_counts
from lightning_sppo.planner.precision import PrecisionBytes
from lightning_sppo.schedule import Action, Op, build_schedule, simulate
from lightning_sppo.schedule.msp import multiplexed_groups, sharing_groups
from lightning_sppo.schedule.multiplexed import PLACEMENT_COSTS

__all__ = [
    "SCHEDULE_NAME",
    "Replicas",
    "activation_peak",
    "group_cross_node",
    "rank_actions",
    "replica_bytes",
    "shared_comm_seconds",
    "shared_saved_bytes",
    "shared_units",
    "step_buffer_bytes",
    "step_sync_seconds",
    "uniform_stretch",
]

SCHEDULE_NAME = "sppo"
_FP32 = 4


@dataclass(frozen=True)
class Replicas:
    """Bytes one rank holds for the other stages' replicas (``SharedUnits.modules``)."""

    weights: int
    grads: int
    kv_cache: int
    kv_grad: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.kv_cache + self.kv_grad


@lru_cache(maxsize=256)
def _schedule(pp: int, n: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(actions) for actions in build_schedule(SCHEDULE_NAME, pp, n, 1))


def rank_actions(pp: int, n: int, rank: int) -> tuple[Action, ...]:
    """Rank ``rank``'s compute actions of the one-micro-batch "sppo" schedule (cached per (pp, N))."""
    return _schedule(pp, n)[rank]


def shared_units(pp: int, n: int) -> dict[int, dict[int, tuple[int, ...]]]:
    """stage -> {subsequence: ranks} of the units "sppo" shares with one micro-batch."""
    out: dict[int, dict[int, tuple[int, ...]]] = {stage: {} for stage in range(pp)}
    for (stage, _, sub), ranks in multiplexed_groups(pp, n, 1).items():
        out[stage][sub] = ranks
    return out


@lru_cache(maxsize=256)
def uniform_stretch(pp: int, n: int) -> float:
    """Makespan of "sppo" at uniform costs (F = 1, B = 2) over one stage's own work (3 N): the closed form's factor."""
    return simulate(_schedule(pp, n), PLACEMENT_COSTS).makespan / (3.0 * n)


# -- memory ----------------------------------------------------------------------------------------


def replica_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stages: Sequence[StageSpec], own: int, seq_len: int, sp: int,
    batch: int = 1,
) -> Replicas:  # fmt: skip
    """What rank ``own`` holds for every other stage: weights and grads in the activation dtype, full K/V caches."""
    others = [s for s in stages if s.index != own]
    params = [stage_parameter_counts(config, s) for s in others]
    weights = sum(dtypes.working * p.total + dtypes.autocast_copy * p.cast for p in params)
    grads = sum(dtypes.working * p.total for p in params)
    kv, kv_grad = kv_cache_bytes_per_layer(config, dtypes, seq_len, sp, batch)
    layers = sum(s.layers for s in others)
    return Replicas(weights, grads, layers * kv, layers * kv_grad)


def step_buffer_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stages: Sequence[StageSpec], own: int
) -> tuple[int, int]:
    """(``begin_step``, ``end_step``) flat fp32 buffers at their largest on rank ``own`` (pp > 1).

    begin: the stage's full weights (gathered from the shards when sharded: the list and its concatenation), and
    one other stage's received flat at a time. end: the fp32 sum of helpers' gradients, the group's flat (a
    replica's gradients in w and their fp32 copy) and the previous group's flat, not yet released.
    """
    sizes = [stage_parameter_counts(config, s).total for s in stages]
    mine, largest = sizes[own], max(size for k, size in enumerate(sizes) if k != own)
    begin = max((2 if dtypes.sharded else 1) * _FP32 * mine, _FP32 * (mine + largest))
    flat = max(_FP32 * mine, (dtypes.working + _FP32) * largest)
    return begin, _FP32 * mine + flat + _FP32 * max(mine, largest)


def shared_saved_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, tokens: int, members: int, sp: int, batch: int = 1
) -> int:
    """What one member holds for its block of a shared unit of ``stage`` (``tokens`` long) until its backward.

    The block's saved activations (the largest block, on this SP rank), the whole unit's input that the block
    input is a view of (not on the first stage: its input is the token ids), and the block's output.
    """
    block = block_lengths(tokens, members, sp)[0]
    saved = level2_bytes(config, dtypes, stage, [block], sp, batch)[0]
    if stage.first:
        return saved
    whole = batch * tokens * config.n_embd * dtypes.message
    output = 0 if stage.last else batch * (block // sp) * config.n_embd * dtypes.residual
    return saved + whole + output


def activation_peak(
    actions: Sequence[Action],
    own: int,
    level2: Sequence[int],
    offloaded: Sequence[int],
    shared_bytes: Callable[[Action], int],
) -> int:
    """Peak device bytes of saved activations on rank ``own`` over its action list.

    The units it runs alone follow the offloader (``offload.policy``): subsequence i's offloaded share leaves
    the device at the end of the next unit the offloader sees, and comes back before its backward together
    with its predecessor's (the prefetch). Shared blocks stay on the device from forward to backward.
    """
    shared = {a.subsequence for a in actions if a.multiplexed and a.stage == own}
    live = peak = 0
    pending: int | None = None  # the unit whose D2H is still in flight
    fetched: set[int] = set()
    held: dict[Action, int] = {}
    for action in actions:
        if action.multiplexed:
            key = action._replace(op=Op.F)
            if action.op == Op.F:
                held[key] = shared_bytes(action)
                live += held[key]
                peak = max(peak, live)
            else:
                live -= held.pop(key)
            continue
        i = action.subsequence
        if action.op == Op.F:
            live += level2[i]
            peak = max(peak, live)
            if pending is not None:
                live -= offloaded[pending]
            pending = i
        else:
            if pending is not None:
                live -= offloaded[pending]
                pending = None
            for j in (i, i - 1):  # its own share back, and the predecessor's prefetch
                if j >= 0 and j not in fetched and j not in shared:
                    live += offloaded[j]
                    fetched.add(j)
            peak = max(peak, live)
            live -= level2[i]
    return peak


# -- time ------------------------------------------------------------------------------------------


def group_cross_node(placement: Placement, ranks: Sequence[int]) -> bool:
    """Whether a sharing group spans a pipeline boundary that crosses nodes."""
    return any(placement.boundary_cross_node[k] for k in range(min(ranks), max(ranks)))


def shared_comm_seconds(
    costs: CostModel, layout: Layout, placement: Placement, stage: StageSpec, tokens: int, offset: int,
    ranks: Sequence[int], *, prefix: bool, batch: int = 1,
) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds of the data a shared unit moves inside its group (module docstring).

    ``prefix``: the group's first unit starts mid-sequence (the prefix K/V go out, and their dK/dV come back).
    """
    config, dtypes, sp, members = costs.config, costs.dtypes, layout.sp, len(ranks)
    cross = group_cross_node(placement, ranks)
    hidden = batch * tokens * config.n_embd * dtypes.message  # the whole unit's [B, L, D]
    sp_gather = hidden * (sp - 1) / sp  # the stage's rank gathers its SP chunks
    kv_layer, grad_layer = kv_cache_bytes_per_layer(config, dtypes, tokens, sp, batch)
    kv_prefix, grad_prefix = kv_cache_bytes_per_layer(config, dtypes, offset, sp, batch) if prefix else (0, 0)
    share = (members - 1) / members
    spread = 0.0 if stage.first else hidden  # input (forward) to every member
    collect = 0.0 if stage.last else hidden / sp * share  # the blocks' outputs to the stage's rank
    forward = costs.link_seconds(spread + collect + stage.layers * (kv_layer * share + kv_prefix), cross)
    forward += costs.link_seconds(sp_gather * ((not stage.first) + (not stage.last)), placement.sp_cross_node)
    spread_grad = 0.0 if stage.last else hidden
    collect_grad = 0.0 if stage.first else hidden / sp * share
    reduce = stage.layers * (2 * share * grad_layer + grad_prefix)  # ring all-reduce, prefix reduce
    backward = costs.link_seconds(spread_grad + collect_grad + reduce, cross)
    backward += costs.link_seconds(sp_gather * ((not stage.first) + (not stage.last)), placement.sp_cross_node)
    return forward, backward


def step_sync_seconds(costs: CostModel, layout: Layout, placement: Placement, stages: Sequence[StageSpec]) -> float:
    """Per step: every group's fp32 weight broadcast and gradient reduce, and on sharded stages the full-weight
    gather of ``begin_step`` and the all-reduce of helpers' gradients over the stage's shard group."""
    sizes = [stage_parameter_counts(costs.config, s).total for s in stages]
    groups = sum(
        costs.link_seconds(2 * _FP32 * sizes[stage], group_cross_node(placement, ranks))
        for stage, ranks in sharing_groups(layout.pp)
    )
    shards = layout.dp * layout.sp
    if shards == 1:
        return groups
    fsdp = max(sizes) * _FP32 * (shards - 1) / shards * 3  # gather, then all-reduce (twice a reduce-scatter)
    return groups + costs.link_seconds(fsdp, placement.fsdp_cross_node)
