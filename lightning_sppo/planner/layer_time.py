"""Seconds of one step of the layer order (``order="layer"``, ``runtime/layer_major.py``) on one of its dp x sp ranks,
as the design it runs says (``/work/notes/fpdt-design.md``), priced by ``CostModel``'s terms.

A step is, per layer, a forward phase over every chunk, then the head and loss, then per layer (last first) a
backward phase: every chunk replayed, then the chunk-major attention backward. One phase on one rank:

    compute     per chunk, the block's work on its c_i / sp local tokens with H / sp heads' attention (the larger of
                device and host time, ``CostModel.layer_forward`` / ``layer_backward``); in the backward the replay
                (the block's forward again, without the attention kernel under "selective") and the projection of
                q, k, v a third time as each chunk's gradients are final, and the chunk-major attention backward:
                each chunk's diagonal and every later chunk's queries over it, plus the host's ops per pair
    all-to-all  per chunk, on the compute stream (not overlapped): forward q, k, v in and the output back (2 H + 2 G'
                head vectors per token), backward the replay's q, k, v in and its output back, dout in and dq, dk, dv
                back (4 H + 4 G'); G' = max(G, sp): fewer K/V groups than ranks are repeated to the ranks first
                (``CostModel.all_to_all_seconds``)
    host link   one link per GPU, both directions one after another (``CostModel.copy_seconds``): the layer's
                checkpoints to host (forward, offload "full", every layer but the last) and the next one's back
                (backward: chunk by chunk as the chunk-major loop finishes this layer's, so these copies hide only
                behind the loop's attention kernels after its first key chunk); K/V beyond R written to host and the prefixes' host parts read back
                (forward), written again by the replay and each chunk read once by the chunk-major loop (and the
                prefixes again under "full"); with model state on host each gather's fp32 shard H2D and each
                reduce-scatter's gradient shard D2H
    FSDP        over dp x sp > 1 ranks (or the model state on host): the next unit's gather during this layer's
                forward, the previous one's gather and the later block's reduce-scatter during its backward, on their
                own stream: a chain of its host copies and collectives (``CostModel.fsdp_gather`` / ``fsdp_reduce``);
                blocks are gathered twice a step and reduced once, the root (embedding, final norm, head) gathered
                three times (embedding, loss, the embedding's backward) and reduced twice

The copies and the FSDP chain run beside the phase's compute and all-to-alls: a phase lasts the longest of the
three, and the K/V copies can hide only behind the attention kernels they feed, so a phase lasts at least its compute
plus what those copies take beyond its attention (in the backward, with the checkpoints coming back: beyond the
chunk-major kernels that run once the first chunk is let go of). What does not hide is counted, never hidden. The step's first
gather (the root and block 0) and last reduce-scatter (block 0 and the root) have nothing to hide behind; the
optimizer steps after the last backward (on the CPU with the model state on host: ``CostModel.optimizer_seconds``).

The step's distance from the model FLOPs at the peak rate (``GAP_TERMS``; they sum to step - ideal, so each names
its share of the MFU lost): the attention kernels below the peak (their backward runs 2.5x the forward's FLOPs where
MFU counts 2x), the block GEMMs below it, the head and loss beyond their GEMMs' FLOPs at the peak, the recomputed
GEMMs (and under "full" the attention forward), the elementwise kernels and the host's ops, the all-to-alls, the host
copies and FSDP traffic that do not hide, and the optimizer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_sppo.planner.costs import CostModel
from lightning_sppo.planner.flops import attention_flops, block_matmul_params, head_flops
from lightning_sppo.planner.kernels import matmul_seconds
from lightning_sppo.planner.layer_order import LayerOrderSetup, kept_bytes_per_token, local_kv_groups
from lightning_sppo.planner.layout import StageSpec
from lightning_sppo.planner.memory import stage_parameter_counts
from lightning_sppo.planner.step_time import TimeBreakdown

__all__ = ["GAP_TERMS", "LayerOrderTime", "layer_order_time"]

GAP_TERMS = {
    "attention": "attention kernels below peak",
    "gemms": "block GEMMs below peak",
    "head": "head and loss",
    "recompute": "recomputed forward work",
    "elementwise": "elementwise kernels and host ops",
    "all_to_all": "Ulysses all-to-alls",
    "copies": "host copies not hidden",
    "fsdp": "FSDP traffic not hidden",
    "optimizer": "optimizer step",
}
"""The causes of a layer-order step's distance from its model FLOPs at the peak rate, and their words."""

_PARTS = ("attention", "gemms", "recompute", "elementwise")
"""What a phase's compute is made of (``GAP_TERMS``)."""
_PAIR_OPS = 6
"""Ops the host issues per (query chunk, key chunk) pair of the chunk-major loop: the kernel's backward and three
in-place sums, with their slices."""


@dataclass(frozen=True)
class LayerOrderTime:
    """One step's seconds on one rank: by kind (``breakdown``) and by distance from the peak (``terms``)."""

    step_s: float
    breakdown: TimeBreakdown
    ideal_s: float
    """The step's model FLOPs (one replica's batch, per rank) at the profile's peak rate."""
    terms: dict[str, float] = field(default_factory=dict)
    """Seconds per ``GAP_TERMS`` cause; they sum to ``step_s - ideal_s``."""


@dataclass
class _Phase:
    """One layer's forward or backward on one rank: its compute by cause, all-to-alls and attention kernels."""

    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_PARTS, 0.0))
    all_to_all: float = 0.0
    attention: float = 0.0
    """Device seconds of the attention kernels the K/V copies feed (forward calls, or the chunk-major backward)."""
    fetching: float = 0.0
    """Of those, the seconds the checkpoints of the layer below can hide behind: the chunk-major kernels after the
    first key chunk's loop (its first chunk is let go of then; 0 in the forward)."""

    @property
    def compute(self) -> float:
        return sum(self.parts.values())


def layer_order_time(costs: CostModel, spans: Sequence[tuple[int, int]], setup: LayerOrderSetup) -> LayerOrderTime:
    """The seconds of one step over ``spans`` (module docstring); ``costs`` carries the recompute mode and model state
    place the run uses."""
    config, layers = costs.config, costs.config.n_layer
    sp, batch = setup.layout.sp, setup.batch
    forward, backward = _forward_phase(costs, spans, setup), _backward_phase(costs, spans, setup)
    seq_len = spans[-1][0] + spans[-1][1]
    local = batch * seq_len / sp
    head = sum(max(*costs.head_seconds(local, backward=b)) for b in (False, True))
    links = _Links(costs, spans, setup)
    exposed = Counter()
    for phase, copies in links.phases(forward, backward):
        for kind, seconds in _exposed(costs, phase, copies).items():
            exposed[kind] += seconds
    exposed["fsdp"] += links.ends()
    params = stage_parameter_counts(config, StageSpec(0, layers, first=True, last=True)).total
    optimizer = costs.optimizer_seconds(params, setup.shards)
    compute = layers * (forward.compute + backward.compute) + head
    all_to_all = layers * (forward.all_to_all + backward.all_to_all)
    breakdown = TimeBreakdown(
        compute, all_to_all, 0.0, exposed["offload"], 0.0, exposed["fsdp"], spill=exposed["spill"], optimizer=optimizer
    )
    step = compute + all_to_all + exposed["offload"] + exposed["fsdp"] + exposed["spill"] + optimizer
    ideal, peak = _ideal(costs, spans, setup)
    parts = {name: forward.parts[name] + backward.parts[name] for name in _PARTS}
    terms = {
        "attention": layers * parts["attention"] - ideal["attention"],
        "gemms": layers * parts["gemms"] - ideal["gemms"],
        "head": head - ideal["head"],
        "recompute": layers * parts["recompute"],
        "elementwise": layers * parts["elementwise"],
        "all_to_all": all_to_all,
        "copies": exposed["offload"] + exposed["spill"],
        "fsdp": exposed["fsdp"],
        "optimizer": optimizer,
    }
    return LayerOrderTime(step, breakdown, peak, terms)


def _forward_phase(costs: CostModel, spans: Sequence[tuple[int, int]], setup: LayerOrderSetup) -> _Phase:
    """One layer's forward over every chunk: the block's work without a graph (``CostModel.layer_forward``)."""
    plain, sp, batch = replace(costs, recompute="none"), setup.layout.sp, setup.batch
    widths = 2 * costs.config.n_head + 2 * _exchanged_groups(costs.config, sp)
    phase = _Phase()
    for offset, length in spans:
        device, host = plain.layer_forward(length, offset, sp)
        gemms = batch * costs.matmul_seconds(length / sp, 1)
        attention = batch * costs.engine_attention_seconds(length, offset, sp, backward=False)
        phase.parts["gemms"] += gemms
        phase.parts["attention"] += attention
        phase.parts["elementwise"] += max(batch * device, host) - gemms - attention
        phase.attention += attention
        phase.all_to_all += costs.all_to_all_seconds(setup.batch * length, sp, setup.sp_cross_node, widths)
    return phase


def _backward_phase(costs: CostModel, spans: Sequence[tuple[int, int]], setup: LayerOrderSetup) -> _Phase:
    """One layer's backward: every chunk replayed with a graph and its GEMMs' backward (``CostModel.layer_backward``
    without its attention kernel), the projection of q, k, v a third time, and the chunk-major attention backward."""
    config, profile, sp, batch = costs.config, costs.profile, setup.layout.sp, setup.batch
    model = replace(costs, recompute=setup.recompute)
    full = setup.recompute == "full"
    widths = 4 * config.n_head + 4 * _exchanged_groups(config, sp)
    qkv = ((config.n_embd, (config.n_head + 2 * config.n_query_groups) * config.head_size),)
    phase = _Phase()
    for offset, length in spans:
        local = length / sp
        device, host = model.layer_backward(length, offset, sp)
        device -= model.engine_attention_seconds(length, offset, sp, backward=True)  # taken chunk-major instead
        projection = matmul_seconds(profile.peak_bf16_tflops * 1e12, profile.mfu, profile.gemm_tile, local, qkv)
        device += projection
        forward_ops = model.census.engine["none"]["forward_prefix" if offset else "forward"].ops
        host += costs.host_seconds(forward_ops / 4)  # the pre part: about a quarter of the forward
        again = costs.matmul_seconds(local, 1) + projection
        again += model.engine_attention_seconds(length, offset, sp, backward=False) if full else 0.0
        gemms = costs.matmul_seconds(local, 2)
        phase.parts["gemms"] += batch * gemms
        phase.parts["recompute"] += batch * again
        phase.parts["elementwise"] += max(batch * device, host) - batch * (gemms + again)
        phase.all_to_all += costs.all_to_all_seconds(batch * length, sp, setup.sp_cross_node, widths)
    kernels, first, ops = _chunk_major(costs, spans, sp)
    phase.parts["attention"] += batch * kernels
    phase.parts["elementwise"] += ops
    phase.attention, phase.fetching = batch * kernels, batch * (kernels - first)
    return phase


def _exchanged_groups(config, sp: int) -> int:
    """K/V groups in the all-to-alls: G, or, with fewer groups than ranks, each repeated to sp / G ranks first."""
    return max(config.n_query_groups, sp) if sp > 1 else config.n_query_groups


def _chunk_major(costs: CostModel, spans: Sequence[tuple[int, int]], sp: int) -> tuple[float, float, float]:
    """(device seconds, of them the first key chunk's loop, host seconds) of one layer's chunk-major attention
    backward on H / sp heads: each chunk's diagonal, and every later chunk's queries over it (calls of the same shape
    timed once: the chunks are of one length but perhaps the last); the host's ops per pair."""
    kernel, heads = costs.attention_kernel, max(1, costs.config.n_head // sp)
    lengths = [length for _, length in spans]

    def seconds(diagonal: Counter, pairs: Counter) -> float:
        calls = sum(n * costs.attention_call(kernel, s, s, True, heads, backward=True) for s, n in diagonal.items())
        return calls + sum(
            n * costs.attention_call(kernel, q, k, False, heads, backward=True) for (q, k), n in pairs.items()
        )

    pairs = Counter((later, length) for j, length in enumerate(lengths) for later in lengths[j + 1 :])
    whole = seconds(Counter(lengths), pairs)
    first = seconds(Counter(lengths[:1]), Counter((later, lengths[0]) for later in lengths[1:]))
    share = costs._document_share(spans[-1][0] + spans[-1][1], 0)
    return whole * share, first * share, pairs.total() * costs.host_seconds(_PAIR_OPS)


@dataclass(frozen=True)
class _Copies:
    """One phase's traffic beside its compute: host-link bytes by owner, and the FSDP chain's seconds."""

    checkpoints: tuple[float, float] = (0.0, 0.0)
    """(D2H, H2D) bytes of the checkpoints (H2D: the layer below's, fetched by the chunk-major loop)."""
    kv: tuple[float, float] = (0.0, 0.0)
    """(D2H, H2D) bytes of K/V beyond R."""
    state: tuple[float, float] = (0.0, 0.0)
    """(D2H, H2D) bytes of the model state's shards (model state on host)."""
    fsdp: float = 0.0
    """Seconds of the FSDP stream: its collectives and the host copies they wait for."""


class _Links:
    """The traffic beside each phase on one rank, and the step's ends (module docstring)."""

    def __init__(self, costs: CostModel, spans: Sequence[tuple[int, int]], setup: LayerOrderSetup) -> None:
        self.costs, self.setup = costs, setup
        config, dtypes, sp = costs.config, costs.dtypes, setup.layout.sp
        seq_len = spans[-1][0] + spans[-1][1]
        self.kept = setup.batch * seq_len / sp * kept_bytes_per_token(config, dtypes, setup.recompute)
        per_token = 2 * setup.batch * local_kv_groups(config, sp) * config.head_size * dtypes.compute
        R = seq_len if setup.device_tokens is None else min(setup.device_tokens, seq_len)
        written = (seq_len - R) * per_token
        prefixes = sum(max(0, offset - R) for offset, _ in spans) * per_token
        again = prefixes if setup.recompute == "full" else 0
        self.kv_forward, self.kv_backward = (written, prefixes), (written, again + written)
        self.sharded = setup.shards > 1 or costs.model_state == "host"
        params = stage_parameter_counts(config, StageSpec(0, config.n_layer, first=True, last=True))
        self.block, self.root = params.block, params.root

    def phases(self, forward: _Phase, backward: _Phase) -> list[tuple[_Phase, _Copies]]:
        """(phase, its traffic), layer by layer: forward l sends its checkpoints to host
        (offload "full", every layer but the last) while FSDP gathers block l + 1 (the last forward: the root, for
        the loss); backward l brings layer l - 1's checkpoints back while FSDP gathers block l - 1 (the first layer:
        the root, for the embedding's backward) and reduce-scatters block l + 1 (the last layer: the root, after
        the loss)."""
        layers = self.costs.config.n_layer
        offload = self.setup.offload == "full"
        out = []
        for layer in range(layers):
            sends = offload and layer < layers - 1
            gather = self._gather(self.block if layer < layers - 1 else self.root)
            copies = _Copies((self.kept if sends else 0.0, 0.0), self.kv_forward, (0.0, gather[1]), gather[0])
            out.append((forward, copies))
        for layer in reversed(range(layers)):
            brings = offload and layer > 0
            gather = self._gather(self.block if layer > 0 else self.root)
            reduce = self._reduce(self.block if layer < layers - 1 else self.root)
            state = (reduce[1], gather[1])
            copies = _Copies((0.0, self.kept if brings else 0.0), self.kv_backward, state, gather[0] + reduce[0])
            out.append((backward, copies))
        return out

    def ends(self) -> float:
        """The step's first gathers (the root, for the embedding, and block 0) and last reduce-scatters (block 0 and
        the root, after the embedding's backward), with the host copies they wait for: nothing runs beside them."""
        gathers = self._gather(self.root)[0] + self._gather(self.block)[0]
        return gathers + self._reduce(self.block)[0] + self._reduce(self.root)[0]

    def _gather(self, params: int) -> tuple[float, float]:
        """(seconds of the FSDP stream, H2D bytes of the shard) of gathering ``params`` (0 without FSDP)."""
        if not self.sharded:
            return 0.0, 0.0
        costs, shards = self.costs, self.setup.shards
        return costs.fsdp_gather(params, shards, self.setup.fsdp_cross_node), self._shard(costs.dtypes.master, params)

    def _reduce(self, params: int) -> tuple[float, float]:
        """(seconds of the FSDP stream, D2H bytes of the gradient shard) of reduce-scattering ``params``'s gradients."""
        if not self.sharded:
            return 0.0, 0.0
        costs, shards = self.costs, self.setup.shards
        return costs.fsdp_reduce(params, shards, self.setup.fsdp_cross_node), self._shard(costs.dtypes.reduce, params)

    def _shard(self, element: int, params: int) -> float:
        return element * params / self.setup.shards if self.costs.model_state == "host" else 0.0


def _exposed(costs: CostModel, phase: _Phase, copies: _Copies) -> dict[str, float]:
    """What one phase's traffic adds to its compute and all-to-alls, by kind ("offload": checkpoints, "spill": K/V,
    "fsdp": the FSDP stream and the model state's copies): the phase lasts the longest of its window, its host link,
    its FSDP stream, its window plus the K/V copies beyond its attention, and its window plus the checkpoints
    fetched beyond the chunk-major kernels that follow the first chunk (module docstring)."""
    window = phase.compute + phase.all_to_all
    seconds = {
        "offload": costs.copy_seconds(*copies.checkpoints),
        "spill": costs.copy_seconds(*copies.kv),
        "fsdp": costs.copy_seconds(*copies.state),
    }
    link = sum(seconds.values())
    spill = max(0.0, seconds["spill"] - phase.attention)
    fetched = costs.copy_seconds(0.0, copies.checkpoints[1])
    late = max(0.0, fetched - phase.fetching)  # the link's sharing with K/V is the ``link`` bound's
    longest = max(window, link, copies.fsdp, window + spill, window + late)
    exposed = longest - window
    if exposed <= 0:
        return {}
    if longest == copies.fsdp:
        return {"fsdp": exposed}
    if longest == window + spill:
        return {"spill": exposed}
    if longest == window + late:
        return {"offload": exposed}
    return {kind: exposed * part / link for kind, part in seconds.items()}  # the link: each by its share of it


def _ideal(costs: CostModel, spans: Sequence[tuple[int, int]], setup: LayerOrderSetup) -> tuple[dict, float]:
    """The model FLOPs of one replica's step (3x the forward, ``planner.flops``) at the peak rate on one of its sp
    ranks, by kind, and their sum."""
    config, sp, batch = costs.config, setup.layout.sp, setup.batch
    rate = costs.profile.peak_bf16_tflops * 1e12 * sp / batch
    layers, document = config.n_layer, costs.document_length
    attention = sum(3 * layers * attention_flops(config, s, o, document) for o, s in spans) / rate
    gemms = sum(3 * layers * 2 * s * block_matmul_params(config) for _, s in spans) / rate
    head = sum(3 * head_flops(config, s) for _, s in spans) / rate
    return {"attention": attention, "gemms": gemms, "head": head}, attention + gemms + head
