"""The "sppo" schedule (multiplexed sequence partitioning) as the runtime runs it (``runtime/multiplexed.py``).

Which units are shared, and with whom, is the schedule's data (``schedule.msp``): stage s shares its Left-SP units
with ``left_ranks(s)`` = s..pp-1 and its Right-SP units with ``right_ranks(s)`` = 0..s. A member r of a unit of L
tokens at offset o takes b_r = ``block_lengths(L / sp, m)[r]`` tokens of each SP chunk and g_r of the G' = G / sp
K/V groups (``group_split``: as even as can be, the remainder to the owner first); with G' < m, one group and the
query rows [a_r, e_r) of it (``team_tasks``: a team per group, its rows cut at equal causal cost). What that costs a
rank, besides its own stage (w: the stage's working weight dtype, a: the dK/dV dtype, c: the compute dtype):

    stream weights  one piece (embedding, block, head) at a time, never a stage: walked phase by phase as
                    ``runtime.streaming`` runs (``weight_walk``): the piece computing and the next arriving, in
                    FSDP's W = dp x sp chunk layout (a 1 / sp slot on the wire, the gathered piece and its unpacked
                    copy), and in backward the piece's gradient (w), its fp32 packing and the previous piece's fp32
                    chunk still on its way to the owner
    stream K/V      per block, on helpers with groups: forward the prefix [0, o) of their heads (2 B g_r o Dh c);
                    backward the unit's K/V [o, o + L) and the owner's dK/dV for them (2 B g_r L Dh (c + a)), the
                    prefix again with the dK/dV their queries add to it (2 B g_r o Dh 2c); dropped after the layer
                    (the owner's cache is the only copy). Row split: forward its group's prefix and the unit's K/V
                    [0, e_r) (2 B (o + e_r) Dh c), backward K/V [0, o + e_r) and their dK/dV contributions
                    (2 B (o + e_r) Dh (c + a)). The owner: what it packs to send (its helpers' groups of the prefix,
                    and in backward their dK/dV coming back), under the row split also its contribution to every
                    group's dK/dV of the unit (2 B G' L Dh a). With K/V spilled to host (``kv_device_tokens``) the
                    prefix travels in chunks of ``kv_chunk_tokens`` (``parallel.prefix_stream``): o above is then at
                    most a chunk
    shared units    per shared unit in flight, never offloaded: the saved activations of the member's b_r tokens
                    (``layer_saved_bytes_per_token`` without its attention terms), the attention of its h_r heads over
                    all L tokens (q, output, fp32 log-sum-exp) and the projection's input copy, the unit's output kept
                    for backward; counted by walking the rank's action list together with its own units' offload.
                    Under recompute (``lightning_sppo.recompute``, shell blocks included) a block keeps its input
                    ("full"), or that with its tokens' output and its heads' (rows') log-sum-exp ("selective")

Stream bytes are a peak over the units a rank takes part in; they are added to the activations' peak (an upper
bound: the two need not coincide). Measured against the runtime on gloo in tests/distributed/test_planner_sppo_memory.py.

Time (``shared_seconds``): a member's share of a unit costs its tokens' matmuls and its heads' attention (row split:
its rows' causal attention over o + a_r earlier keys, for its group's heads), the stage's Ulysses for its tokens, and
per block the group's all-to-alls (q, k, v in, the owner receiving every group's K/V for its cache; the output back),
the prefix K/V the owner sends out; per piece the weights: the first piece's transfer is exposed, each later one
overlaps the previous piece's compute (what exceeds it is exposed), plus the SP all-gather inside the member's node;
in backward also K/V [0, o + L), the dK/dV for [o, o + L) and the prefix dK/dV back to the owner, and each piece's
gradient chunk to the owner (overlapped with the next piece). Each unit also scatters its input (output gradient)
from the owner and gathers its output (input gradient). A collective finishes with its slowest member, so the
owner's sends and receives bound it. Links cross nodes when any of the group's pipeline boundaries does
(``planner.layout``). The row split moves more (``_row_exchanges``): the owner streams a group's prefix to every
other member rather than to the members with groups, and the dK/dV contributions travel in the dK/dV dtype; across
nodes that usually costs more than the attention it spreads. Under recompute a block's backward runs its forward's
matmuls again ("full": its attention and the group's forward exchanges too; "selective": q and the kept output move
with the output's gradient). With K/V on host the owner copies the host part of the prefix in and its dK/dV out,
what its attention share does not hide (``shared_copy_seconds``); with model state on host it copies each piece's
shard in before sending it and the piece's gradient out after.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.parallel.multiplex import block_lengths, group_split, team_tasks
from lightning_sppo.planner.activations import layer_saved_bytes_per_token, stage_extra_bytes_per_token
from lightning_sppo.planner.costs import CostModel
from lightning_sppo.planner.flops import ATTENTION_BACKWARD_FACTOR, attention_flops, block_matmul_params, head_flops
from lightning_sppo.planner.layout import Layout, Placement, StageSpec
from lightning_sppo.planner.memory import stage_cast_parameters
from lightning_sppo.planner.precision import PrecisionBytes
from lightning_sppo.schedule import Action, Op, build_schedule, simulate
from lightning_sppo.schedule.msp import multiplexed_groups
from lightning_sppo.schedule.multiplexed import PLACEMENT_COSTS

__all__ = [
    "SCHEDULE_NAME",
    "ShareTimes",
    "Stream",
    "UnitShare",
    "WalkProfile",
    "activation_peak",
    "group_cross_node",
    "piece_shapes",
    "rank_actions",
    "shared_kept_bytes",
    "shared_copy_seconds",
    "shared_saved_bytes",
    "shared_seconds",
    "shared_units",
    "stream_peak",
    "uniform_stretch",
    "unit_share",
    "weight_walk",
]

SCHEDULE_NAME = "sppo"
_FP32 = 4


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


# -- a member's share ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitShare:
    """Member ``index`` of a shared unit: its tokens per SP chunk and its K/V groups (of this SP rank's G')."""

    index: int
    owner: int
    members: int
    tokens: int
    """b_r: its tokens of each SP chunk (per rank)."""
    groups: int
    """g_r: its K/V groups."""
    split: tuple[int, ...]
    """Every member's K/V groups."""
    stage_groups: int = 0
    """G': the K/V groups of this SP rank (all members')."""
    rows: tuple[tuple[int, int], ...] = ()
    """Every member's query rows [a, e) of the unit when the group splits them (``by_rows``); else empty (all rows)."""

    @property
    def is_owner(self) -> bool:
        return self.index == self.owner

    @property
    def by_rows(self) -> bool:
        """Fewer K/V groups than members: each member attends query rows of one group (``team_tasks``)."""
        return bool(self.rows)

    def row_count(self, length: int) -> int:
        """The query rows this member attends (all ``length`` rows of its groups under the group split)."""
        return self.rows[self.index][1] - self.rows[self.index][0] if self.rows else length


def unit_share(
    config: GPTConfig, length: int, sp: int, ranks: Sequence[int], rank: int, stage: int, offset: int = 0
) -> UnitShare:
    """How ``rank`` takes part in ``stage``'s unit of ``length`` tokens at ``offset`` shared by ``ranks``
    (``runtime.multiplexed``; the offset decides the row cuts when the group splits rows)."""
    return _unit_share(config.n_query_groups // sp, length, sp, tuple(ranks), rank, stage, offset)


@lru_cache(maxsize=65536)
def _unit_share(
    groups: int, length: int, sp: int, ranks: tuple[int, ...], rank: int, stage: int, offset: int
) -> UnitShare:
    """``unit_share`` for ``groups`` K/V groups per SP rank (cached: the planner asks for every member of every unit
    under every memory mode)."""
    index, owner, members = ranks.index(rank), ranks.index(stage), len(ranks)
    tokens = block_lengths(length // sp, members)[index]
    if groups < members:
        tasks = team_tasks(groups, members, owner, offset, length)
        widths = tuple(g1 - g0 for g0, g1, _, _ in tasks)
        rows = tuple((a, e) for _, _, a, e in tasks)
        return UnitShare(index, owner, members, tokens, widths[index], widths, groups, rows)
    split = group_split(groups, members, owner)
    return UnitShare(index, owner, members, tokens, split[index], split, groups)


# -- memory ------------------------------------------------------------------------------------------


def piece_shapes(config: GPTConfig, stage: StageSpec) -> list[list[tuple[int, ...]]]:
    """Parameter shapes of each piece of ``stage`` (``runtime.streaming.stage_pieces``): embedding, blocks, head."""
    d, dh = config.n_embd, config.head_size
    norm = [(d,)] + ([(d,)] if config.norm == "layernorm" and config.bias else [])
    qkv = (config.n_head + 2 * config.n_query_groups) * dh
    block = [*norm, (qkv, d)] + ([(qkv,)] if config.bias or config.attn_bias else [])
    block += [(d, config.n_head * dh)] + ([(d,)] if config.bias else [])
    if config.norm_qk:
        block += [(dh,)] * (2 if config.norm == "rmsnorm" or not config.bias else 4)
    block += norm
    mlp_in = 2 if config.mlp == "swiglu" else 1
    block += [(config.intermediate_size, d)] * mlp_in + ([(config.intermediate_size,)] * mlp_in if config.bias else [])
    block += [(d, config.intermediate_size)] + ([(d,)] if config.bias else [])
    pieces = [[(config.vocab_size, d)]] if stage.first else []
    pieces += [list(block) for _ in range(stage.layers)]
    if stage.last:
        pieces.append([*norm, (config.vocab_size, d)])
    return pieces


@dataclass(frozen=True)
class _Piece:
    """One piece on the wire under W chunks: its elements, its chunk's elements S, its largest padded parameter."""

    numel: int
    chunk: int
    widest: int

    @classmethod
    @lru_cache(maxsize=1024)
    def of(cls, shapes: tuple[tuple[int, ...], ...], chunks: int) -> _Piece:
        def padded(shape: tuple[int, ...]) -> int:
            return math.ceil(shape[0] / chunks) * chunks * math.prod(shape[1:])

        chunk = sum(math.ceil(s[0] / chunks) * math.prod(s[1:]) for s in shapes)
        return cls(sum(math.prod(s) for s in shapes), chunk, max(padded(s) for s in shapes))


@dataclass(frozen=True)
class WalkProfile:
    """A stage's weight walk (``weight_walk``): the peak outside the blocks' compute, and the weights held while a
    block computes in forward and in backward (when a helper also holds that layer's K/V)."""

    base: int
    forward_block: int
    backward_block: int

    def peak(self, kv_forward: int = 0, kv_backward: int = 0) -> int:
        return max(self.base, self.forward_block + kv_forward, self.backward_block + kv_backward)


def weight_walk(
    pieces: list[list[tuple[int, ...]]], w: int, dp: int, sp: int, blocks: range | None = None, *, owner: bool = False
) -> WalkProfile:
    """Bytes of one shared unit's weights on a member, phase by phase as ``runtime.streaming`` runs them.

    ``pieces``: parameter shapes per piece; ``w``: the weights' dtype bytes; the chunk layout is W = dp x sp (FSDP),
    or 1 x 1 when ``dp * sp == 1``; ``blocks``: which pieces are blocks (where K/V streams add on top).
    """
    chunks = dp * sp
    p = [_Piece.of(tuple(shapes), chunks) for shapes in pieces]
    n = len(p)
    blocks = blocks if blocks is not None else range(0)
    flat = [w * x.numel for x in p]
    slot = [0 if chunks == 1 else w * dp * x.chunk for x in p]  # what arrives on the column link
    if owner and chunks > 1 and dp > 1:
        slot = [s + w * x.chunk for s, x in zip(slot, p, strict=True)]  # its own chunk, gathered over dp
    incoming = [flat[i] if chunks == 1 else slot[i] for i in range(n)]  # what a prefetch holds
    # one parameter's temporaries (W ch rest elements, ``widest``): its slot columns made contiguous (dp > 1), the SP
    # all-gather (sp > 1), the reordered rows (both); in backward its padded fp32 gradient, reordered, reduce-scattered
    unpack = [w * x.widest * (sp > 1) * (1 + (dp > 1)) + w * x.widest // sp * (dp > 1) for x in p]
    pack = [_FP32 * x.widest * (1 + (dp > 1 and sp > 1)) + _FP32 * x.widest // sp * (sp > 1) for x in p]

    def restore(i: int) -> int:  # waiting for piece i and unpacking it (W = 1: it landed in place)
        return flat[i] if chunks == 1 else slot[i] + flat[i] + unpack[i]

    base = forward_block = backward_block = 0
    for i in range(n):  # forward: restore i, fetch i + 1, compute i, release i
        computing = flat[i] + (incoming[i + 1] if i + 1 < n else 0)
        base = max(base, restore(i), computing)
        forward_block = max(forward_block, computing if i in blocks else 0)
    for i in reversed(range(n)):  # backward: restore i, fetch i - 1, backward i; then release i, receive i + 1, send i
        outgoing = _outgoing(p[i + 1], dp, chunks) if i + 1 < n else 0
        before = incoming[i - 1] if i > 0 else 0
        grad = w * p[i].numel
        computing = outgoing + flat[i] + before + grad
        # W = 1: the gradients concatenated in fp32 (and one parameter's cast); else the outgoing chunk and one
        # parameter's packing
        cast = 0 if w == _FP32 else _FP32 * p[i].widest
        send = _FP32 * p[i].numel + cast if chunks == 1 else _FP32 * dp * p[i].chunk + pack[i]
        base = max(base, outgoing + restore(i), computing, before + grad + send)
        backward_block = max(backward_block, computing if i in blocks else 0)
    return WalkProfile(base, forward_block, backward_block)


def _outgoing(piece: _Piece, dp: int, chunks: int) -> int:
    """The fp32 gradient chunk of a piece on its way to the owner (the whole piece when W = 1)."""
    if chunks == 1:
        return _FP32 * piece.numel
    return _FP32 * dp * piece.chunk


@dataclass(frozen=True)
class Stream:
    """What a rank holds for shared units' weights and K/V streams, at the peak of the unit that needs most."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def stream_peak(
    config: GPTConfig, dtypes: PrecisionBytes, stages: Sequence[StageSpec], rank: int, partition: Sequence[int],
    sp: int, dp: int, batch: int = 1, *, others_only: bool = False, chunk: int | None = None,
) -> Stream:  # fmt: skip
    """The largest weight + K/V stream peak of any shared unit ``rank`` takes part in (one micro-batch's schedule).

    ``others_only``: only units of other stages (what a helper holds for stages it does not own). ``chunk``: with K/V
    spilled to host, the owner's prefix travels in chunks of this many tokens (``parallel.prefix_stream``).
    """
    groups = shared_units(len(stages), len(partition))
    offsets = [sum(partition[:i]) for i in range(len(partition))]
    chunks = (dp, sp) if dtypes.sharded else (1, 1)
    best = Stream(0, 0)
    for stage in stages:
        if others_only and stage.index == rank:
            continue
        units = [(sub, ranks) for sub, ranks in groups[stage.index].items() if rank in ranks]
        if not units:
            continue
        blocks = range(int(stage.first), int(stage.first) + stage.layers)
        walk = weight_walk(piece_shapes(config, stage), dtypes.working, *chunks, blocks, owner=stage.index == rank)
        for sub, ranks in units:
            share = unit_share(config, partition[sub], sp, ranks, rank, stage.index, offsets[sub])
            kv = stream_kv(config, dtypes, offsets[sub], partition[sub], share, batch, chunk)
            total = walk.peak(*kv)
            if total > best.total:
                weights = walk.peak()
                best = Stream(weights, total - weights)
    return best


def stream_kv(
    config: GPTConfig, dtypes: PrecisionBytes, offset: int, length: int, share: UnitShare, batch: int = 1,
    chunk: int | None = None,
) -> tuple[int, int]:  # fmt: skip
    """(forward, backward) K/V bytes a member holds for one block of a unit besides its own tokens' (module
    docstring). ``chunk``: the owner's prefix travels in chunks of this many tokens (K/V spilled to host), else in
    one piece.

    Group split, a helper: forward its groups' prefix; backward the unit's K/V and the dK/dV later subsequences left
    for them, and its groups' prefix with the dK/dV its queries add to it (in the K/V dtype). Row split, a helper: the same of its group,
    with the unit's K/V up to its last row. The owner: what it packs to send (its helpers' groups of the prefix, in
    backward with their dK/dV coming back), and under the row split its contribution to every group's dK/dV of the
    unit."""
    c, a = dtypes.compute, dtypes.accumulation
    per = 2 * batch * config.head_size  # K and V (dK and dV) of one group and token
    prefix = offset if chunk is None else min(offset, chunk)  # the part of the prefix held at once
    if share.by_rows:
        others = share.members - 1  # one group each
        if share.is_owner:
            return per * others * max(prefix, length) * c, per * (
                share.stage_groups * length * a + others * prefix * (c + a)
            )
        last = share.rows[share.index][1]
        return per * share.groups * (prefix + last) * c, per * share.groups * (prefix + last) * (c + a)
    others = sum(g for i, g in enumerate(share.split) if i != share.owner)
    if share.is_owner:  # the prefix's dK/dV come back in the K/V dtype
        return per * others * prefix * c, per * others * max(length * max(c, a), prefix * 2 * c)
    return per * share.groups * prefix * c, per * share.groups * (length * (c + a) + prefix * 2 * c)


def shared_saved_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, length: int, share: UnitShare, sp: int, batch: int = 1,
    recompute: str = "none",
) -> int:  # fmt: skip
    """What one member keeps from a shared unit's forward to its backward (module docstring), under ``recompute``:
    its blocks' inputs only ("full"), or with the output of its tokens and the log-sum-exp of its heads' (rows') share
    ("selective"), as ``lightning_sppo.recompute`` keeps them for a shell block."""
    c, h = dtypes.compute, config.n_head
    heads = share.groups * (config.n_head // config.n_query_groups)
    if recompute == "none":
        per_query_head = 2 * c * config.head_size + _FP32  # q, the output, the log-sum-exp
        per_token = layer_saved_bytes_per_token(config, dtypes, sp) - (h // sp) * per_query_head
        if sp == 1:
            per_token += c * h * config.head_size  # the output comes back as a fresh copy, which the projection saves
        attention = heads * share.row_count(length) * per_query_head
        # Autocast (an unsharded stage under bf16-mixed) casts the streamed weights for every unit, uncached: the
        # matmuls save those copies until the unit's backward.
        casts = dtypes.autocast_copy * stage_cast_parameters(config, stage)
    else:  # the first run has no graph: nothing else is saved, autocast's weight copies included
        per_token = layer_saved_bytes_per_token(config, dtypes, sp, recompute)
        attention, casts = 0, 0
        if recompute == "selective":  # the log-sum-exp is kept as computed: its heads, all the unit's rows (or its)
            per_token -= _FP32 * h
            attention = heads * share.row_count(length) * _FP32
    saved = stage.layers * (batch * share.tokens * per_token + batch * attention) + casts
    saved += batch * share.tokens * stage_extra_bytes_per_token(config, dtypes, last=stage.last, recompute=recompute)
    if not stage.last:
        saved += batch * share.tokens * config.n_embd * dtypes.message  # the unit's output, kept for backward
    return saved


def shared_kept_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, share: UnitShare, batch: int = 1
) -> int:
    """What of ``shared_saved_bytes`` stays on the device when shared units are offloaded: the unit's input (a leaf
    that collects its gradient, which the offloader keeps) and its output (the graph's root, held for backward)."""
    per = batch * share.tokens * config.n_embd * dtypes.message
    return per * ((not stage.first) + (not stage.last))


def activation_peak(
    actions: Sequence[Action],
    own: int,
    level2: Sequence[int],
    offloaded: Sequence[int],
    shared_bytes: Callable[[Action], tuple[int, int]],
) -> int:
    """Peak device bytes of saved activations on rank ``own`` over its action list.

    The units it runs alone follow the offloader (``offload.policy``): subsequence i's offloaded share leaves
    the device at the end of the next unit the offloader sees, and comes back before its backward together
    with its predecessor's (the prefetch). ``shared_bytes(action)`` gives a shared unit's (saved, offloaded) bytes:
    the shared units' own offloader (policy "full") frees a unit's offloaded bytes at the end of the next compute
    action of any kind (``SharedUnits.after_action``), and brings them back before the unit's backward, with its
    stage's previous unit of the micro-batch.
    """
    shared = {a.subsequence for a in actions if a.multiplexed and a.stage == own}
    live = peak = 0
    pending: int | None = None  # the unit whose D2H is still in flight
    fetched: set[int] = set()
    units: dict[tuple, list] = {}  # shared: [saved, offloaded, state] with state "resident", "released", "fetched"
    copying: tuple | None = None  # the shared unit whose D2H is still in flight
    for action in actions:
        if action.multiplexed:
            key = (action.stage, action.microbatch, action.subsequence)
            if action.op == Op.F:
                saved, off = shared_bytes(action)
                units[key] = [saved, off, "resident"]
                live += saved
                peak = max(peak, live)
                live -= _release(units, copying)
                copying = key if off else None
                continue
            for unit in (key, (key[0], key[1], key[2] - 1)):  # its own bytes and the prefetch
                if unit in units and units[unit][2] == "released":
                    units[unit][2] = "fetched"
                    live += units[unit][1]
            peak = max(peak, live)
            saved, off, state = units.pop(key)
            live -= saved - (off if state == "released" else 0)
            live -= _release(units, copying)
            copying = None
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
        live -= _release(units, copying)  # the end of this action: the shared unit's copy is done
        copying = None
    return peak


def _release(units: dict[tuple, list], copying: tuple | None) -> int:
    """The device bytes freed when ``copying``'s D2H is waited for (0 when nothing is in flight)."""
    if copying is None or copying not in units or units[copying][2] != "resident":
        return 0
    units[copying][2] = "released"
    return units[copying][1]


# -- time ------------------------------------------------------------------------------------------


def group_cross_node(placement: Placement, ranks: Sequence[int]) -> bool:
    """Whether a sharing group spans a pipeline boundary that crosses nodes."""
    return any(placement.boundary_cross_node[k] for k in range(min(ranks), max(ranks)))


@dataclass(frozen=True)
class ShareTimes:
    """Seconds of one member's share of a shared unit: in all, and of it its own compute."""

    forward: float
    backward: float
    forward_compute: float
    backward_compute: float


def shared_seconds(
    costs: CostModel, layout: Layout, placement: Placement, stage: StageSpec, length: int, offset: int,
    ranks: Sequence[int], *, batch: int = 1, h2d_bytes: dict[int, int] | None = None,
) -> dict[int, ShareTimes]:  # fmt: skip
    """Seconds of every member's share of ``stage``'s unit shared by ``ranks`` (module docstring), by rank.

    Every collective runs at its busiest member's pace, so the group's traffic is charged to every member.
    ``h2d_bytes``: per rank, offloaded bytes its backward waits to bring back (not hidden by a prefetch).
    With K/V spilled to host, add ``shared_copy_seconds``.
    Under ``costs.recompute`` a block's backward runs its forward again: its matmuls, under "full" its attention
    and the group's forward exchanges too, under "selective" q and the kept output travel with the output's gradient.
    """
    config, dtypes, sp, recompute = costs.config, costs.dtypes, layout.sp, costs.recompute
    cross = group_cross_node(placement, ranks)
    shares = [unit_share(config, length, sp, ranks, r, stage.index, offset) for r in ranks]
    link = lambda nbytes: costs.link_seconds(nbytes, cross)  # noqa: E731
    chunks = layout.dp * sp if dtypes.sharded else 1
    pieces = [_Piece.of(tuple(shapes), chunks) for shapes in piece_shapes(config, stage)]
    exchange_f, exchange_b, gradient_in = (
        link(x) for x in _group_exchanges(config, dtypes, length, offset, shares, sp, batch)
    )
    if recompute == "selective":  # q and the kept output to the heads' members, beside the output's gradient
        exchange_b += 2 * gradient_in
    elif recompute == "full":  # the group attends again, exchanges and all
        exchange_b += exchange_f
    hidden = batch * (length // sp) * config.n_embd * dtypes.message  # the owner's chunk of the unit
    moves = link(hidden * (len(ranks) - 1) / len(ranks)) * ((not stage.first) + (not stage.last))
    flops, overhead = costs.profile.flops_per_s, costs.layer_fixed_s
    blocks = range(int(stage.first), int(stage.first) + stage.layers)
    out = {}
    for rank, share in zip(ranks, shares, strict=True):
        matmul = 2.0 * share.tokens * block_matmul_params(config)
        attention = _attention(costs, share, length, offset, sp)
        a2a = costs._all_to_all(StageSpec(0, 1, False, False), share.tokens * sp, sp, placement.sp_cross_node)
        forward = [0.0] * len(pieces)
        backward = [0.0] * len(pieces)
        for i in blocks:
            forward[i] = costs.flop_seconds(matmul, attention) + overhead + a2a
            backward[i] = costs.flop_seconds(2 * matmul, ATTENTION_BACKWARD_FACTOR * attention) + 2 * overhead + a2a
            if recompute != "none":  # the block's forward again (with its attention under "full")
                backward[i] += costs.flop_seconds(matmul, attention if recompute == "full" else 0.0) + overhead + a2a
        if stage.last:
            forward[-1] = head_flops(config, share.tokens) / flops
            backward[-1] = 3.0 * head_flops(config, share.tokens) / flops
        compute = (sum(forward), sum(backward))
        for i in blocks:
            forward[i] += exchange_f
            backward[i] += exchange_b
        h2d = costs.h2d((h2d_bytes or {}).get(rank, 0))
        out[rank] = ShareTimes(
            _with_weights(costs, layout, placement, pieces, forward, cross, gradients=False) + moves,
            _with_weights(costs, layout, placement, pieces[::-1], backward[::-1], cross, gradients=True) + moves + h2d,
            *compute,
        )
    return out


def _attention(costs: CostModel, share: UnitShare, length: int, offset: int, sp: int) -> float:
    """Forward attention FLOPs of one member's share of one block: its rows of its heads (all rows under the group
    split), over their causal prefix."""
    config = costs.config
    a, e = share.rows[share.index] if share.by_rows else (0, length)
    flops = attention_flops(config, e - a, offset + a, costs.document_length) / sp * share.groups
    return flops / max(1, config.n_query_groups // sp)


def shared_copy_seconds(
    costs: CostModel, layout: Layout, stage: StageSpec, length: int, offset: int, ranks: Sequence[int],
    device_tokens: int, batch: int = 1,
) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds the owner's host copies add to every member's share of ``stage``'s unit, with K/V
    spilled to host (R = ``device_tokens``; ``_owner_copies`` per block, every member waiting for the owner)."""
    sp = layout.sp
    owner = unit_share(costs.config, length, sp, ranks, stage.index, stage.index, offset)
    attention = _attention(costs, owner, length, offset, sp)
    forward, backward = _owner_copies(costs, length, offset, sp, batch, device_tokens, attention)
    return stage.layers * forward, stage.layers * backward


def _owner_copies(
    costs: CostModel, length: int, offset: int, sp: int, batch: int, device_tokens: int | None, attention: float
) -> tuple[float, float]:
    """(forward, backward) seconds per block the owner's host copies add beyond its own attention share, with K/V
    spilled to host (R = ``device_tokens``): forward the host part of the prefix in (every group's: it sends the
    members theirs) and the unit's own host part out; backward the host part of [0, o + L) in, K/V and dK/dV, and
    the prefix's dK/dV out. Double-buffered as a stage's own (``CostModel.spill_seconds``): only what the copies
    take beyond the attention beside them shows; every member waits for the owner."""
    if device_tokens is None:
        return 0.0, 0.0
    c, a = costs.dtypes.compute, costs.dtypes.accumulation
    per_token = 2 * batch * (costs.config.n_query_groups // sp) * costs.config.head_size
    read = max(0, offset - device_tokens) * per_token
    written = max(0, offset + length - max(offset, device_tokens)) * per_token
    on_host = max(0, offset + length - device_tokens) * per_token
    seconds = costs.flop_seconds(0.0, attention)
    forward = max(costs.h2d(read * c), costs.d2h(written * c)) - seconds
    backward = max(costs.h2d(on_host * (c + a)), costs.d2h(read * a)) - ATTENTION_BACKWARD_FACTOR * seconds
    return max(0.0, forward), max(0.0, backward)


def _group_exchanges(
    config: GPTConfig, dtypes: PrecisionBytes, length: int, offset: int, shares: list[UnitShare], sp: int, batch: int
) -> tuple[float, float, float]:  # fmt: skip
    """Bytes one block's attention moves in the group (forward, backward, and of backward the output's gradient to
    the heads' members), at the pace of the busiest member: per exchange, the most any member sends or receives
    (``parallel.multiplex``; a prefix streamed in chunks moves the same bytes)."""
    if shares[0].by_rows:
        return _row_exchanges(config, dtypes, length, offset, shares, sp, batch)
    c, a, dh = dtypes.compute, dtypes.accumulation, config.head_size
    groups = config.n_query_groups // sp
    per = config.n_head // config.n_query_groups  # query heads per K/V group
    owner = next(s for s in shares if s.is_owner)
    others = groups - owner.groups  # groups the owner streams to the other members

    def busiest(sent: Callable[[UnitShare], float], received: Callable[[UnitShare], float]) -> float:
        return max(max(sent(s), received(s)) for s in shares) * dh * batch

    def tokens(s: UnitShare) -> int:  # after the stage's Ulysses: its tokens of every SP chunk
        return s.tokens * sp

    def kv_in(s: UnitShare) -> int:  # the owner takes every group's K/V, for its cache
        return groups if s.is_owner else s.groups

    forward = busiest(  # q, k, v to the heads' members
        lambda s: tokens(s) * ((groups - s.groups) * per * c + 2 * (groups - s.groups) * c),
        lambda s: (length - tokens(s)) * (s.groups * per + 2 * kv_in(s)) * c,
    )
    forward += busiest(  # the output back to the tokens' members
        lambda s: (length - tokens(s)) * s.groups * per * c,
        lambda s: tokens(s) * (groups - s.groups) * per * c,
    )
    forward += busiest(
        lambda s: offset * 2 * others * c if s.is_owner else 0, lambda s: 0 if s.is_owner else offset * 2 * s.groups * c
    )
    gradient_in = busiest(  # the output's gradient to the heads' members
        lambda s: tokens(s) * (groups - s.groups) * per * c,
        lambda s: (length - tokens(s)) * s.groups * per * c,
    )
    streams = ((offset + length) * c + length * a) * 2  # K/V [0, o + L) and the later dK/dV, per group
    backward = gradient_in + busiest(
        lambda s: others * streams if s.is_owner else 0, lambda s: 0 if s.is_owner else s.groups * streams
    )
    backward += busiest(  # the prefix's dK/dV back to the owner (in the K/V dtype: one kernel call's result)
        lambda s: 0 if s.is_owner else offset * 2 * s.groups * c, lambda s: offset * 2 * others * c if s.is_owner else 0
    )
    backward += busiest(  # dq, dk, dv back to the tokens' members
        lambda s: (length - tokens(s)) * s.groups * (per + 2) * c,
        lambda s: tokens(s) * (groups - s.groups) * (per + 2) * c,
    )
    return forward, backward, gradient_in


def _row_exchanges(
    config: GPTConfig, dtypes: PrecisionBytes, length: int, offset: int, shares: list[UnitShare], sp: int, batch: int
) -> tuple[float, float, float]:  # fmt: skip
    """``_group_exchanges`` when the group splits query rows (``parallel.multiplex._RowAttentionFn``): member t
    attends rows [a_t, e_t) of its team's groups (``team_tasks``). A member's tokens lie evenly over the unit (a block of every SP chunk), so
    of the rows [lo, hi) it holds about its share n_r / L of them.

    forward   q of each member's rows to it, K/V [0, e_t) of its groups (the owner: every group's [0, L), for its
              cache); the prefix [0, o) of its groups from the owner to each other member; the output rows back
    backward  the output gradient of its rows to it; K/V [0, o + e_t) of its groups from the owner; the prefix's dK/dV
              (dK/dV dtype) from each other member to the owner; every member's dK/dV contributions [0, e_t)
              (the owner's: every group's [0, L), with what later units left) summed on the tokens' members
              (dK/dV dtype); dq back
    """
    c, a, dh = dtypes.compute, dtypes.accumulation, config.head_size
    per = config.n_head // config.n_query_groups
    members, owner = len(shares), shares[0].owner
    held = [s.tokens * sp / length for s in shares]  # the fraction of any rows a member holds
    rows = [share.rows[share.index] for share in shares]
    groups = shares[0].stage_groups
    widths = shares[0].split
    kv_span = [(groups, length) if t == owner else (widths[t], rows[t][1]) for t in range(members)]  # (groups, [0, hi))

    def busiest(pair: Callable[[int, int], float]) -> float:
        """Most bytes any member sends or receives when member s sends ``pair(s, t)`` elements to member t."""
        sent = [sum(pair(s, t) for t in range(members) if t != s) for s in range(members)]
        got = [sum(pair(s, t) for s in range(members) if s != t) for t in range(members)]
        return max(max(sent), max(got)) * dh * batch

    def queries(s: int, t: int) -> float:  # s's tokens of t's rows, t's heads
        return per * widths[t] * held[s] * (rows[t][1] - rows[t][0])

    def answers(s: int, t: int) -> float:  # s computed rows that t holds
        return per * widths[s] * held[t] * (rows[s][1] - rows[s][0])

    def keys(s: int, t: int) -> float:  # s's tokens of K/V [0, hi_t), t's groups
        return 2 * kv_span[t][0] * held[s] * kv_span[t][1]

    def contributions(s: int, t: int) -> float:  # s's dK/dV of t's tokens
        return 2 * kv_span[s][0] * held[t] * kv_span[s][1]

    def from_owner(tokens: Callable[[int], int]) -> Callable[[int, int], float]:
        return lambda s, t: 2 * widths[t] * tokens(t) if s == owner else 0

    def to_owner(tokens: Callable[[int], int]) -> Callable[[int, int], float]:
        return lambda s, t: 2 * widths[s] * tokens(s) if t == owner else 0

    forward = busiest(lambda s, t: queries(s, t) + keys(s, t)) * c
    forward += busiest(from_owner(lambda t: offset)) * c
    forward += busiest(answers) * c
    gradient_in = busiest(queries) * c
    backward = gradient_in + busiest(from_owner(lambda t: offset + rows[t][1])) * c
    backward += busiest(to_owner(lambda s: offset)) * a
    backward += busiest(contributions) * a
    backward += busiest(answers) * c
    return forward, backward, gradient_in


def _with_weights(
    costs: CostModel, layout: Layout, placement: Placement, pieces: list[_Piece], compute: list[float], cross: bool,
    *, gradients: bool,
) -> float:  # fmt: skip
    """Pieces in order, each waiting for its weights (the next one's transfer overlapping it), plus the SP all-gather
    inside the member's node; in backward each piece's gradient chunk travels during the next piece."""
    dtypes, sp, dp = costs.dtypes, layout.sp, layout.dp
    chunks = dp * sp if dtypes.sharded else 1
    w = dtypes.working

    host = costs.model_state == "host"  # the owner's shard is in host memory: copied in first, gradients back out

    def arrive(piece: _Piece) -> float:
        slot = w * (piece.numel if chunks == 1 else dp * piece.chunk)
        seconds = costs.link_seconds(slot, cross)
        if chunks > 1 and dp > 1:  # the owner gathers its column's chunks over dp first
            seconds += costs.link_seconds(w * piece.chunk * (dp - 1), placement.fsdp_cross_node)
        if host:
            seconds += costs.h2d(dtypes.master * (piece.numel if chunks == 1 else piece.chunk))
        return seconds

    def gather(piece: _Piece) -> float:  # inside the member's stage: unpack over SP
        return costs.link_seconds(w * chunks * piece.chunk * (sp - 1) / sp, placement.sp_cross_node) if sp > 1 else 0.0

    def reduce(piece: _Piece) -> float:
        chunk = _FP32 * (piece.numel if chunks == 1 else dp * piece.chunk)
        seconds = costs.link_seconds(chunk, cross)
        if chunks > 1 and sp > 1:
            seconds += costs.link_seconds(_FP32 * chunks * piece.chunk * (sp - 1) / sp, placement.sp_cross_node)
        if host:
            seconds += costs.d2h(_FP32 * (piece.numel if chunks == 1 else piece.chunk))
        return seconds

    total = arrive(pieces[0])
    for i, piece in enumerate(pieces):
        busy = compute[i] + gather(piece)
        hidden = [arrive(pieces[i + 1])] if i + 1 < len(pieces) else []
        if gradients and i > 0:
            hidden.append(reduce(pieces[i - 1]))
        total += max([busy, *hidden])
    if gradients:
        total += reduce(pieces[-1])
    return total
