"""The solver's side of the layer order (``order="layer"``): where it may run, its fastest step that fits at every
layout, and that step as the planner's answer.

Where: one stage (pp = 1) on every (sp, dp) the runtime accepts (``layer_layouts``: sp divides the heads, and the K/V
groups or is a multiple of them, and fills part of a node or whole nodes), recompute "selective" or "full", offload "none" or "full", dK/dV
summed in fp32, the model state on the device or on host. What is searched per layout: the chunk count (1, 2, 4, ...
while each rank's share of a chunk is at least 2K tokens, at most 64 chunks; or the request's), recompute, offload,
model state place and K/V placement (all on the device, or all on host streamed in chunks: R = 0; or the request's
R). A step's bytes are ``planner.layer_order``'s, its time ``planner.layer_time``'s; the fastest per sequence that
fits the device and the host wins (a dp-way layout trains dp sequences per step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from lightning_sppo.partition import spans as to_spans
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner.advice import ac_advice
from lightning_sppo.planner.costs import CostModel, resolve_attention
from lightning_sppo.planner.flops import sequence_model_flops
from lightning_sppo.planner.layer_order import LayerOrderSetup, layer_order_memory
from lightning_sppo.planner.layer_time import layer_order_time
from lightning_sppo.planner.layout import Layout, placement
from lightning_sppo.planner.memory import MemoryBreakdown
from lightning_sppo.planner.plan import Plan, PlanRequest
from lightning_sppo.planner.step_time import TimeBreakdown

__all__ = [
    "LAYER_OFFLOAD",
    "LAYER_RECOMPUTE",
    "LayerOrderStep",
    "best_layer_order",
    "layer_layouts",
    "layer_order_fits",
    "layer_order_misses",
    "layer_order_plan",
    "layer_order_refusal",
    "layer_order_step",
    "layer_order_summary",
]

LAYER_RECOMPUTE = ("selective", "full")
LAYER_OFFLOAD = ("none", "full")
_SHORTEST_CHUNK = 2048
"""The shortest chunk share of one SP rank tried: below it a layer pass's fixed costs outweigh what a shorter chunk
saves."""
_MOST_CHUNKS = 64
"""The most chunks tried: more only shrink the one chunk's block graph a backward holds, already small beside the
layer's working set over the whole sequence."""

CostsFor = Callable[[Layout, str, str], CostModel]
"""(layout, recompute, model state) -> the cost model the run has there (``solver.cost_model``)."""
Grain = Callable[[int], int]
"""sp -> the granularity chunk boundaries fall on (``solver.granularity``)."""


@dataclass(frozen=True)
class LayerOrderStep:
    """One step of the layer order on one rank of its layout, predicted: its choices, time by kind, the step's
    distance from the model FLOPs at peak by cause, and the device peak's parts."""

    spans: tuple[tuple[int, int], ...]
    setup: LayerOrderSetup
    model_state: str
    step_s: float
    time: TimeBreakdown
    memory: MemoryBreakdown
    terms: tuple[tuple[str, float], ...] = ()
    """Where the step goes beyond the model FLOPs at the peak rate, in seconds (``layer_time.GAP_TERMS``)."""

    @property
    def peak_gpu_bytes(self) -> int:
        return self.memory.peak_gpu_bytes

    @property
    def layout(self) -> Layout:
        return self.setup.layout

    @property
    def recompute(self) -> str:
        return self.setup.recompute

    @property
    def offload(self) -> str:
        return self.setup.offload

    @property
    def device_tokens(self) -> int | None:
        return self.setup.device_tokens

    @property
    def per_sequence_s(self) -> float:
        """Seconds per sequence: a dp-way layout trains dp sequences (of batch_size each) per step."""
        return self.step_s / self.setup.layout.dp


def layer_order_step(
    costs: CostModel, spans: Sequence[tuple[int, int]], setup: LayerOrderSetup, memory: MemoryBreakdown | None = None
) -> LayerOrderStep:
    """Time and device peak of one step of ``order="layer"`` over ``spans`` (the chunks of the whole sequence) on one
    rank of ``setup.layout``; ``costs``: the model, precision, recompute and model state place it runs with."""
    timed = layer_order_time(costs, spans, setup)
    memory = memory or layer_order_memory(costs, spans, setup)
    return LayerOrderStep(
        tuple(spans), setup, costs.model_state, timed.step_s, timed.breakdown, memory, tuple(timed.terms.items())
    )


# -- where it runs ------------------------------------------------------------------------------------------


def layer_order_refusal(request: PlanRequest) -> str | None:
    """Why ``request`` cannot run in the layer order (None: it can): one stage, fp32 dK/dV sums, a recompute mode and
    an offload policy it runs, and a layout with sp dividing the heads."""
    if "layer" not in request.order:
        return "not asked for (--order)"
    if request.pp not in (None, 1):
        return f"it runs the whole model as one stage, got --pp={request.pp} (use --pp 1)"
    if request.kv_grad_dtype != "fp32":
        return "it sums one chunk's dK/dV at a time, in fp32 (--kv-grad-dtype fp32)"
    if not set(request.recompute) & set(LAYER_RECOMPUTE) or not set(request.offload) & set(LAYER_OFFLOAD):
        return "it recomputes (--recompute selective or full) and offloads none or full"
    if not layer_layouts(request):
        return f"--sp={request.sp} divides neither the heads nor the node (Ulysses gives each SP rank whole heads)"
    return None


def layer_layouts(request: PlanRequest) -> list[Layout]:
    """The (sp, dp) layouts of one stage the runtime accepts, narrowed to the request's sp: sp divides the heads, and
    the K/V groups or is a multiple of them (fewer groups are repeated to the ranks), and fills part of a node or
    whole nodes (``layout.candidate_layouts``' rule)."""
    config, world, node = request.config, request.world_size, request.profile.gpus_per_node
    layouts = []
    for sp in (d for d in range(1, world + 1) if world % d == 0):
        groups = config.n_query_groups
        if config.n_head % sp or (groups % sp and sp % groups) or (node % sp and sp % node):
            continue
        if request.sp in (None, sp):
            layouts.append(Layout(sp, 1, world // sp))
    return layouts


# -- the search ---------------------------------------------------------------------------------------------


def best_layer_order(request: PlanRequest, costs_for: CostsFor, grain: Grain) -> LayerOrderStep | None:
    """The fastest step per sequence of the layer order that fits ``request``'s GPU and host memory, over every layout,
    chunk count, recompute mode, offload policy, model state place and K/V placement it allows (None: none fits)."""
    best = None
    for costs, spans, setup in _candidates(request, costs_for, grain):
        memory = layer_order_memory(costs, spans, setup)
        if not _fits(request, memory):
            continue
        step = layer_order_step(costs, spans, setup, memory)
        if best is None or step.per_sequence_s < best.per_sequence_s:
            best = step
    return best


def layer_order_fits(request: PlanRequest, costs_for: CostsFor, grain: Grain) -> bool:
    """Whether some configuration of the layer order fits (the leanest tried first; ``solver.fits``)."""
    return any(_fits(request, layer_order_memory(*c)) for c in _candidates(request, costs_for, grain, lean=True))


def _fits(request: PlanRequest, memory: MemoryBreakdown) -> bool:
    profile = request.profile
    return memory.peak_gpu_bytes <= profile.hbm_bytes and memory.host_bytes <= profile.host_bytes_per_gpu


def _candidates(
    request: PlanRequest, costs_for: CostsFor, grain: Grain, lean: bool = False
) -> Iterator[tuple[CostModel, list[tuple[int, int]], LayerOrderSetup]]:
    """Every configuration the request allows (``lean``: those holding the least on the device first)."""
    order = reversed if lean else list
    pinned = request.kv_device_tokens
    places = [pinned] if pinned != "auto" else [None, 0]
    for layout in layer_layouts(request):
        if request.seq_len % layout.sp:
            continue
        where = placement(layout, request.profile.gpus_per_node)
        for state in order(request.model_state):
            for recompute in order([r for r in LAYER_RECOMPUTE if r in request.recompute]):
                costs = costs_for(layout, recompute, state)
                for n in order(_chunk_counts(request, layout.sp, grain(layout.sp))):
                    lengths = split_sequence(request.seq_len, n, "length", granularity=grain(layout.sp))
                    spans = to_spans(lengths)
                    for offload in order([o for o in LAYER_OFFLOAD if o in request.offload]):
                        for device_tokens in order(places):
                            setup = LayerOrderSetup(
                                recompute, offload, device_tokens, request.kv_chunk_tokens, request.batch_size,
                                layout, where.sp_cross_node, where.fsdp_cross_node,
                            )  # fmt: skip
                            yield costs, spans, setup


def _chunk_counts(request: PlanRequest, sp: int, grain: int) -> list[int]:
    """The chunk counts tried: the request's (when the granularity allows it), or 1, 2, 4, ... while each SP rank's
    share of a chunk is at least ``_SHORTEST_CHUNK`` tokens, up to ``_MOST_CHUNKS``."""
    most = request.seq_len // grain
    if request.num_subsequences is not None:
        return [request.num_subsequences] if request.num_subsequences <= most else []
    counts, n = [1], 2
    while request.seq_len // (n * sp) >= _SHORTEST_CHUNK and n <= min(_MOST_CHUNKS, most):
        counts.append(n)
        n *= 2
    return counts


# -- the answer -------------------------------------------------------------------------------------------------


def layer_order_plan(request: PlanRequest, step: LayerOrderStep, grain: Grain, ac: dict | None, others: list[str]):
    """``step`` as the planner's answer (a ``Plan`` with ``order="layer"``); ``others``: what the subsequence order
    came to, for the report."""
    profile, config, layout = request.profile, request.config, step.layout
    lengths = [length for _, length in step.spans]
    model_flops = request.batch_size * sequence_model_flops(config, lengths, request.document_length)
    tokens = request.batch_size * request.seq_len / (step.step_s * layout.sp)
    return Plan(
        model=config.name, seq_len=request.seq_len, nodes=request.nodes, gpus_per_node=profile.gpus_per_node,
        profile=profile.name, precision=request.precision, sp=layout.sp, pp=1, dp=layout.dp,
        num_subsequences=len(lengths), num_microbatches=1, schedule="seq1f1b", kv_grad_dtype=request.kv_grad_dtype,
        layers_per_stage=[config.n_layer], partition=lengths, partition_policy="length",
        document_length=request.document_length, offload=step.offload, fsdp_sync="step",
        recompute=step.recompute, kv_device_tokens=step.device_tokens, kv_chunk_tokens=request.kv_chunk_tokens,
        model_state=step.model_state, granularity=grain(layout.sp), alpha=[], alpha_stage=0, alpha_by_stage=[[]],
        peak_gpu_bytes=step.peak_gpu_bytes, peak_host_bytes=step.memory.host_bytes, gpu_bytes=profile.hbm_bytes,
        host_limit_bytes=profile.host_bytes_per_gpu, host_bytes_per_node=profile.host_bytes_per_node,
        memory=step.memory, step_time_s=step.step_s, tokens_per_gpu_per_s=tokens,
        mfu=model_flops / (step.step_s * layout.sp * profile.peak_bf16_tflops * 1e12), bubble_ratio=0.0,
        time=step.time, pp_cross_node=False, other_schedules=others,
        attention_kernel=resolve_attention(request.attention, profile), plain_ac=ac,
        advice=ac_advice(ac, tokens) if ac else "", order="layer", mfu_terms=dict(step.terms),
    )  # fmt: skip


def layer_order_summary(request: PlanRequest, step: LayerOrderStep) -> str:
    """One line for a plan of the other order: the layer order's fastest step and its layout."""
    tokens = request.batch_size * request.seq_len / (step.step_s * step.layout.sp)
    return (
        f"order=layer: best {step.layout} N={len(step.spans)}, {tokens:.0f} tokens/GPU/s ({step.recompute} recompute)"
    )


def layer_order_misses(request: PlanRequest) -> str:
    """Why ``--order layer`` alone has no plan."""
    return (
        f"the layer order fits {request.config.name} at --seq-len={request.seq_len} on {request.world_size}"
        f" {request.profile.name} in no configuration (layout, chunks, recompute, offload, K/V and model state on"
        " host): shorten --seq-len or allow --order subsequence."
    )
