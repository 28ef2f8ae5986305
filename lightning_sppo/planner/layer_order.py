"""Bytes of the layer order on one device (``order="layer"``, ``runtime/layer_major.py``), counted from the code.

Per token and layer, what the forward keeps for the backward (``kept_bytes_per_token``; D hidden, H heads, Dh head
size, r residual and c compute element bytes):

    "full"       r D                   the layer's input
    "selective"  r D + c H Dh + 4 H     also the attention output and its fp32 log-sum-exp

with ``offload="full"`` on host for every layer but the last (the device holds two layers' worth during the
backward: the running one and the next one arriving).

The running layer's working set in its backward, per token of the whole sequence (``working_bytes_per_token``):
the input gradient (r D: the incoming one, replaced chunk by chunk by the residual's share, then by the input
gradient), q and the attention's dout (2 c H Dh), the fp32 dq sums (4 H Dh), and under "full" the recomputed
output and log-sum-exp (c H Dh + 4 H).

K/V and dK/dV on the device (``kv_peak_bytes``), what ``LayerMajorEngine.meter`` measures: the cache's device
buffer of min(R, S) tokens (``kv_device_tokens`` R), plus the most of either
    forward   two chunks of ``kv_chunk_tokens`` of the prefix's host part streamed in (the one attended, the next);
    backward  for key chunk j: its host part fetched (and, when it straddles R, the whole chunk joined), the next
              chunk's host part arriving, and, when a later chunk reads it, its fp32 dK/dV sums.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.activations import layer_saved_bytes_per_token
from lightning_sppo.planner.costs import CostModel, resolve_attention
from lightning_sppo.planner.kernels import matmul_seconds
from lightning_sppo.planner.layout import StageSpec
from lightning_sppo.planner.memory import (
    MemoryBreakdown,
    model_state_bytes,
    stage_cast_parameters,
    stage_parameter_counts,
    transient_bytes,
)
from lightning_sppo.planner.precision import PrecisionBytes
from lightning_sppo.planner.step_time import TimeBreakdown

__all__ = [
    "LayerOrderStep",
    "best_layer_order",
    "kept_bytes_per_token",
    "kv_peak_bytes",
    "layer_order_plan",
    "layer_order_refusal",
    "layer_order_step",
    "working_bytes_per_token",
]

_FP32 = 4


def kept_bytes_per_token(config: GPTConfig, dtypes: PrecisionBytes, recompute: str) -> int:
    """What the forward keeps per token and layer for the backward (module docstring)."""
    kept = dtypes.residual * config.n_embd
    if recompute == "selective":
        kept += dtypes.compute * config.n_head * config.head_size + _FP32 * config.n_head
    return kept


def working_bytes_per_token(config: GPTConfig, dtypes: PrecisionBytes, recompute: str) -> int:
    """The running layer's working set in its backward, per token of the sequence (module docstring)."""
    heads = config.n_head * config.head_size
    working = dtypes.residual * config.n_embd + 2 * dtypes.compute * heads + _FP32 * heads
    if recompute == "full":
        working += dtypes.compute * heads + _FP32 * config.n_head
    return working


def kv_peak_bytes(
    config: GPTConfig,
    dtypes: PrecisionBytes,
    spans: list[tuple[int, int]],
    device_tokens: int | None,
    chunk_tokens: int,
    batch: int = 1,
) -> int:
    """The most K/V and dK/dV bytes on the device at once during a step (module docstring)."""
    seq_len = spans[-1][0] + spans[-1][1]
    R = seq_len if device_tokens is None else min(device_tokens, seq_len)
    per_token = 2 * batch * config.n_query_groups * config.head_size  # K and V elements of one token
    kv, sums = per_token * dtypes.compute, per_token * _FP32
    prefix_host = max(0, spans[-1][0] - R)  # the longest prefix's host part (the last chunk's)
    forward = min(prefix_host, 2 * chunk_tokens) * kv

    def host(offset: int, length: int) -> int:
        return max(0, offset + length - max(offset, R))

    backward = 0
    for j, (offset, length) in enumerate(spans):
        joined = length if offset < R < offset + length else 0
        arriving = host(*spans[j + 1]) if j + 1 < len(spans) else 0
        summed = length * sums if j + 1 < len(spans) else 0
        backward = max(backward, (host(offset, length) + joined + arriving) * kv + summed)
    return R * kv + max(forward, backward)


# -- time and memory of a step, and the search -------------------------------------------------------------


@dataclass(frozen=True)
class LayerOrderStep:
    """One step of the layer order, predicted: its choices, time by kind and the device peak's parts."""

    spans: tuple[tuple[int, int], ...]
    recompute: str
    offload: str
    device_tokens: int | None
    step_s: float
    time: TimeBreakdown
    memory: MemoryBreakdown

    @property
    def peak_gpu_bytes(self) -> int:
        return self.memory.peak_gpu_bytes


def layer_order_step(
    costs: CostModel, spans: Sequence[tuple[int, int]], recompute: str, offload: str, device_tokens: int | None,
    chunk_tokens: int, batch: int = 1,
) -> LayerOrderStep:  # fmt: skip
    """Time and device peak of one step of ``order="layer"`` over ``spans`` (module docstring of ``runtime.layer_major``
    for what runs; the terms are ``CostModel``'s, as the subsequence order's)."""
    config, layers = costs.config, costs.config.n_layer
    forward = sum(_pass(costs, "none", s, o, backward=False) for o, s in spans)
    backward = sum(_pass(costs, recompute, s, o, backward=True) for o, s in spans) + _chunk_major(costs, spans)
    head = sum(max(*costs.head_seconds(batch * sum(s for _, s in spans), backward=b)) for b in (False, True))
    seq_len = spans[-1][0] + spans[-1][1]
    waits = _checkpoint_waits(costs, seq_len, batch, recompute, offload, forward, backward)
    spill = _spill_waits(costs, spans, device_tokens, recompute, batch)
    params = stage_parameter_counts(config, StageSpec(0, layers, first=True, last=True)).total
    optimizer = costs.optimizer_seconds(params, 1)
    compute = layers * (forward + backward) + head
    time = TimeBreakdown(compute, 0.0, 0.0, layers * waits, 0.0, 0.0, spill=layers * spill, optimizer=optimizer)
    step_s = compute + time.offload_wait + time.spill + optimizer
    memory = _memory(costs, spans, recompute, offload, device_tokens, chunk_tokens, batch)
    return LayerOrderStep(tuple(spans), recompute, offload, device_tokens, step_s, time, memory)


def _pass(costs: CostModel, recompute: str, tokens: int, prefix: int, backward: bool) -> float:
    """One layer's forward, or backward (3a and 3b of the runtime without the chunk-major attention: the block's
    forward again, the backward of its GEMMs and elementwise work, the projection of q, k, v a third time), of one
    chunk: the larger of device and host time."""
    model = replace(costs, recompute=recompute)
    if not backward:
        return max(*model.layer_forward(tokens, prefix))
    device, host = model.layer_backward(tokens, prefix)
    device -= model.engine_attention_seconds(tokens, prefix, 1, backward=True)  # taken chunk-major instead
    config, profile = costs.config, costs.profile
    qkv = ((config.n_embd, (config.n_head + 2 * config.n_query_groups) * config.head_size),)
    device += matmul_seconds(profile.peak_bf16_tflops * 1e12, profile.mfu, profile.gemm_tile, tokens, qkv)
    forward_ops = model.census.engine["none"]["forward_prefix" if prefix else "forward"].ops
    return max(device, host + costs.host_seconds(forward_ops / 4))  # the pre part: about a quarter of the forward


def _chunk_major(costs: CostModel, spans: Sequence[tuple[int, int]]) -> float:
    """One layer's chunk-major attention backward: each chunk's diagonal, and every later chunk's queries over it
    (calls of the same shape timed once: the chunks are of one length but perhaps the last)."""
    kernel, heads = costs.attention_kernel, costs.config.n_head
    lengths = [length for _, length in spans]
    diagonal = Counter(lengths)
    pairs = Counter((later, length) for j, length in enumerate(lengths) for later in lengths[j + 1 :])
    seconds = sum(n * costs.attention_call(kernel, s, s, True, heads, backward=True) for s, n in diagonal.items())
    seconds += sum(n * costs.attention_call(kernel, q, k, False, heads, backward=True) for (q, k), n in pairs.items())
    seconds += pairs.total() * costs.host_seconds(_PAIR_OPS)
    return seconds * _document_share(costs, spans)


_PAIR_OPS = 6
"""Ops the host issues per (query chunk, key chunk) pair of the chunk-major loop: the kernel's backward and three
in-place sums, with their slices."""


def _document_share(costs: CostModel, spans: Sequence[tuple[int, int]]) -> float:
    seq_len = spans[-1][0] + spans[-1][1]
    return costs._document_share(seq_len, 0)


def _checkpoint_waits(
    costs: CostModel, seq_len: int, batch: int, recompute: str, offload: str, forward: float, backward: float
) -> float:
    """Per layer: what the copies of its checkpoints (to host in its forward, back during the next layer's backward)
    take beyond the compute they overlap (every layer but the last, with offload="full")."""
    if offload != "full" or costs.config.n_layer < 2:
        return 0.0
    nbytes = batch * seq_len * kept_bytes_per_token(costs.config, costs.dtypes, recompute)
    to_host = max(0.0, costs.copy_seconds(nbytes, 0) - forward)
    back = max(0.0, costs.copy_seconds(0, nbytes) - backward)
    return (to_host + back) * (costs.config.n_layer - 1) / costs.config.n_layer


def _spill_waits(
    costs: CostModel, spans: Sequence[tuple[int, int]], device_tokens: int | None, recompute: str, batch: int
) -> float:
    """Per layer: the K/V copies of tokens beyond R (written in each pass over the layer, the prefixes read back for
    the forward's attention, and each chunk once for the chunk-major loop) beyond the attention they overlap."""
    seq_len = spans[-1][0] + spans[-1][1]
    if device_tokens is None or device_tokens >= seq_len:
        return 0.0
    config = costs.config
    per_token = 2 * batch * config.n_query_groups * config.head_size * costs.dtypes.compute
    written = (seq_len - device_tokens) * per_token
    prefixes = sum(max(0, offset - device_tokens) for offset, _ in spans) * per_token
    forward_attention = sum(costs.engine_attention_seconds(s, o, 1, backward=False) for o, s in spans)
    forward = max(0.0, costs.copy_seconds(written, prefixes) - forward_attention)
    again = prefixes if recompute == "full" else 0
    backward = max(0.0, costs.copy_seconds(written, again + written) - _chunk_major(costs, spans))
    return forward + backward


def _memory(
    costs: CostModel, spans: Sequence[tuple[int, int]], recompute: str, offload: str, device_tokens: int | None,
    chunk_tokens: int, batch: int,
) -> MemoryBreakdown:  # fmt: skip
    """The device peak: model state, then the larger of the forward's and the backward's peak (module docstring)."""
    config, dtypes, profile = costs.config, costs.dtypes, costs.profile
    layers, seq_len, longest = config.n_layer, spans[-1][0] + spans[-1][1], max(s for _, s in spans)
    stage = StageSpec(0, layers, first=True, last=True)
    params = stage_parameter_counts(config, stage)
    weights, gradients, optimizer = model_state_bytes(params, dtypes, 1, "step", False)
    optimizer = optimizer if costs.optimizer else 0
    tokens = batch * seq_len
    kept_layer = tokens * kept_bytes_per_token(config, dtypes, recompute)
    kv = kv_peak_bytes(config, dtypes, list(spans), device_tokens, chunk_tokens, batch)
    hidden = 2 * tokens * dtypes.residual * config.n_embd  # a layer's input and output, every chunk
    forward = (layers if offload == "none" else 1) * kept_layer + hidden
    chunk_graph = batch * longest * layer_saved_bytes_per_token(config, dtypes)  # one chunk's block graph
    backward = (layers if offload == "none" else min(layers, 2)) * kept_layer
    backward += tokens * working_bytes_per_token(config, dtypes, recompute) + chunk_graph
    transient = transient_bytes(config, dtypes, stage, seq_len, longest, 1, batch, "none", longest)
    host = tokens * kept_bytes_per_token(config, dtypes, recompute) * (layers - 1) if offload == "full" else 0
    spilled = 0 if device_tokens is None else max(0, seq_len - device_tokens)  # the running layer's, on host
    host_kv = batch * spilled * 2 * config.n_query_groups * config.head_size * dtypes.compute
    autocast = dtypes.autocast_copy * stage_cast_parameters(config, stage)  # held through the forward only
    return MemoryBreakdown(
        weights=weights + autocast, gradients=gradients, optimizer=optimizer, kv_cache=kv, kv_grad=0,
        activations=max(forward, backward), boundary=0, transient=transient, reserved=profile.reserved_bytes,
        host=host, host_kv=host_kv, autocast_credit=autocast if backward >= forward else 0,
        allocator_slack=profile.allocator_slack_bytes,
    )  # fmt: skip


# -- the solver's side: is the layer order allowed, its fastest step that fits, that step as a plan -------------

LAYER_RECOMPUTE = ("selective", "full")
LAYER_OFFLOAD = ("none", "full")
_SHORTEST_CHUNK = 2048
"""The shortest chunk tried: below it a layer pass's fixed costs outweigh what a shorter chunk saves."""
_MOST_CHUNKS = 64
"""The most chunks tried: more only shrink the one chunk's block graph a backward holds, already small beside the
layer's working set over the whole sequence."""


def layer_order_refusal(request) -> str | None:
    """Why ``request`` cannot run in the layer order (None: it can): one GPU, one stage, no sequence parallelism,
    model state on the device, fp32 dK/dV sums, a recompute mode and an offload policy it runs."""
    if "layer" not in request.order:
        return "not asked for (--order)"
    if request.world_size != 1 or request.pp not in (None, 1) or request.sp not in (None, 1):
        return "it runs on one GPU (one stage, no sequence parallelism)"
    if "device" not in request.model_state or request.kv_grad_dtype != "fp32":
        return "it keeps the model state on the device and sums dK/dV in fp32"
    if not set(request.recompute) & set(LAYER_RECOMPUTE) or not set(request.offload) & set(LAYER_OFFLOAD):
        return "it recomputes (--recompute selective or full) and offloads none or full"
    return None


def best_layer_order(request, costs_for) -> LayerOrderStep | None:
    """The fastest step of the layer order that fits ``request``'s GPU and host memory (None: none fits), over the
    chunk counts, recompute modes, offload policies and K/V placements it allows. ``costs_for(recompute)`` gives the
    cost model (``solver.cost_model``)."""
    from lightning_sppo.partition import spans as to_spans
    from lightning_sppo.partition import split_sequence

    profile, seq_len = request.profile, request.seq_len
    device_limit, host_limit = profile.hbm_bytes, profile.host_bytes_per_gpu
    pinned = request.kv_device_tokens
    places = [pinned] if pinned != "auto" else [None, 0]
    best = None
    for recompute in (r for r in LAYER_RECOMPUTE if r in request.recompute):
        costs = costs_for(recompute)
        for n in _chunk_counts(request):
            lengths = split_sequence(seq_len, n, "length", granularity=max(1, request.granularity))
            for offload in (o for o in LAYER_OFFLOAD if o in request.offload):
                for device_tokens in places:
                    step = layer_order_step(costs, to_spans(lengths), recompute, offload, device_tokens,
                                            request.kv_chunk_tokens, request.batch_size)  # fmt: skip
                    if step.peak_gpu_bytes > device_limit or step.memory.host_bytes > host_limit:
                        continue
                    if best is None or step.step_s < best.step_s:
                        best = step
    return best


def _chunk_counts(request) -> list[int]:
    """The chunk counts tried: the request's, or 1, 2, 4, ... while a chunk is at least 2K tokens."""
    if request.num_subsequences is not None:
        return [request.num_subsequences]
    counts, n = [1], 2
    while request.seq_len // n >= _SHORTEST_CHUNK and n <= _MOST_CHUNKS:
        counts.append(n)
        n *= 2
    return counts


def layer_order_plan(request, step: LayerOrderStep, ac: dict | None, others: list[str]):
    """``step`` as the planner's answer (a ``Plan`` with ``order="layer"``); ``others``: what the subsequence order
    came to, for the report."""
    from lightning_sppo.planner.advice import ac_advice
    from lightning_sppo.planner.flops import sequence_model_flops
    from lightning_sppo.planner.plan import Plan

    profile, config = request.profile, request.config
    lengths = [length for _, length in step.spans]
    model_flops = request.batch_size * sequence_model_flops(config, lengths, request.document_length)
    tokens = request.batch_size * request.seq_len / step.step_s
    return Plan(
        model=config.name, seq_len=request.seq_len, nodes=request.nodes, gpus_per_node=profile.gpus_per_node,
        profile=profile.name, precision=request.precision, sp=1, pp=1, dp=1, num_subsequences=len(lengths),
        num_microbatches=1, schedule="seq1f1b", kv_grad_dtype=request.kv_grad_dtype, layers_per_stage=[config.n_layer],
        partition=lengths, partition_policy="length", document_length=request.document_length, offload=step.offload,
        fsdp_sync="step", recompute=step.recompute, kv_device_tokens=step.device_tokens,
        kv_chunk_tokens=request.kv_chunk_tokens, model_state="device", granularity=max(1, request.granularity),
        alpha=[], alpha_stage=0, alpha_by_stage=[[]], peak_gpu_bytes=step.peak_gpu_bytes,
        peak_host_bytes=step.memory.host_bytes, gpu_bytes=profile.hbm_bytes, host_limit_bytes=profile.host_bytes_per_gpu,
        host_bytes_per_node=profile.host_bytes_per_node, memory=step.memory, step_time_s=step.step_s,
        tokens_per_gpu_per_s=tokens, mfu=model_flops / (step.step_s * profile.peak_bf16_tflops * 1e12),
        bubble_ratio=0.0, time=step.time, pp_cross_node=False, other_schedules=others,
        attention_kernel=resolve_attention(request.attention, profile), plain_ac=ac,
        advice=ac_advice(ac, tokens) if ac else "", order="layer",
    )  # fmt: skip
