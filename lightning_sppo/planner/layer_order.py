"""Bytes of the layer order (``order="layer"``: FPDT's order, ``runtime/layer_major.py``) on one of its dp x sp ranks,
counted from the code and the design it runs (``/work/notes/fpdt-design.md``: Ulysses over sp ranks, FSDP2 over
dp x sp, one stage).

Each of the sp ranks of a replica holds S / sp contiguous tokens of every chunk (its "local" tokens) and, around the
attention, all S tokens of H / sp heads and G / sp K/V groups (Ulysses' all-to-alls). Per local token and layer,
what the forward keeps for the backward (``kept_bytes_per_token``; D hidden, H heads, Dh head size, r residual and c
compute element bytes):

    "full"       r D                   the layer's input
    "selective"  r D + c H Dh + 4 H     also the attention output and its fp32 log-sum-exp (head- or
                                       sequence-sharded: the same bytes per rank either way)

with ``offload="full"`` on host for every layer but the last. In the backward the layer below comes back chunk by
chunk as the running layer's chunk-major loop lets go of its own chunks, so the device holds one layer's worth and
a chunk in flight (``runtime.layer_major._Checkpoints``), never two layers'.

The running layer's working set in its backward, per local token (``working_bytes_per_token``): the input gradient
(r D: the incoming one, replaced chunk by chunk by the residual's share, then by the input gradient), q and the
attention's dout (2 c H Dh: all S tokens of H / sp heads), the fp32 dq sums (4 H Dh), and under "full" the
recomputed output and log-sum-exp (c H Dh + 4 H). The backward's two parts do not overlap: the replay (every chunk
through the block again, one chunk's graph at a time) holds all of it but the dq sums, which the chunk-major loop
makes after the replay's last graph is freed (``attention.chunk_major``); the peak is the larger of the two.

K/V and dK/dV on the device (``kv_peak_bytes``), what ``LayerMajorEngine.meter`` measures on each rank: the cache's
device buffer of min(R, S) tokens of G / sp groups (``kv_device_tokens`` R, tokens of the whole sequence), plus the
most of either
    forward   two chunks of ``kv_chunk_tokens`` of the prefix's host part streamed in (the one attended, the next);
    backward  for key chunk j: its host part fetched (and, when it straddles R, the whole chunk joined), the next
              chunk's host part arriving, and, when a later chunk reads it, its fp32 dK/dV sums.

Model state (``layer_state_bytes``): on one rank without FSDP, the fp32 parameters (the working and master copy),
their gradients, AdamW's moments and autocast's bf16 copies of the blocks' weights (held through the forward, whose
one autocast context caches them; each chunk of the backward makes and drops its own). Over dp x sp > 1 ranks, or
with ``model_state="host"`` (a one-rank FSDP mesh on one GPU), FSDP2 as the layer order runs it
(``parallel/fsdp_layers.py``): each unit gathered for its layer pass with the next one's gather issued ahead, so at
most two units gathered at once (a block and the next, or a block and the root: embedding, final norm and head),
gradients reduce-scattered once per layer pass (one unit's fresh gradients and one reduce-scatter input in flight),
the fp32 master shard, the sharded gradients and AdamW's moments (16 bytes per parameter of the rank's shard, on
host with the model state there).

The step's time is ``planner.layer_time``'s; ``planner.layer_plan`` puts the two together and searches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.activations import layer_saved_bytes_per_token
from lightning_sppo.planner.costs import CostModel
from lightning_sppo.planner.layout import Layout, StageSpec
from lightning_sppo.planner.memory import (
    MemoryBreakdown,
    host_state_bytes,
    loss_transient_bytes,
    model_state_bytes,
    stage_cast_parameters,
    stage_parameter_counts,
)
from lightning_sppo.planner.precision import PrecisionBytes

__all__ = [
    "LayerOrderSetup",
    "kept_bytes_per_token",
    "kv_peak_bytes",
    "layer_order_memory",
    "layer_order_phases",
    "dq_bytes_per_token",
    "layer_state_bytes",
    "local_kv_groups",
    "working_bytes_per_token",
]

_FP32 = 4


def kept_bytes_per_token(config: GPTConfig, dtypes: PrecisionBytes, recompute: str) -> int:
    """What the forward keeps per local token and layer for the backward (module docstring)."""
    kept = dtypes.residual * config.n_embd
    if recompute == "selective":
        kept += dtypes.compute * config.n_head * config.head_size + _FP32 * config.n_head
    return kept


def working_bytes_per_token(config: GPTConfig, dtypes: PrecisionBytes, recompute: str) -> int:
    """The running layer's working set in its backward, per local token (module docstring)."""
    heads = config.n_head * config.head_size
    working = dtypes.residual * config.n_embd + 2 * dtypes.compute * heads + _FP32 * heads
    if recompute == "full":
        working += dtypes.compute * heads + _FP32 * config.n_head
    return working


def dq_bytes_per_token(config: GPTConfig) -> int:
    """Of the working set, the fp32 dq sums: the chunk-major loop makes them, once the replay is over."""
    return _FP32 * config.n_head * config.head_size


def local_kv_groups(config: GPTConfig, sp: int) -> int:
    """K/V groups one of ``sp`` ranks holds of every token around the attention (Ulysses shards whole groups)."""
    return max(1, config.n_query_groups // sp)


def kv_peak_bytes(
    config: GPTConfig,
    dtypes: PrecisionBytes,
    spans: list[tuple[int, int]],
    device_tokens: int | None,
    chunk_tokens: int,
    batch: int = 1,
    sp: int = 1,
) -> int:
    """The most K/V and dK/dV bytes one of ``sp`` ranks holds on the device at once during a step (module docstring);
    ``spans``: the chunks of the whole sequence, ``device_tokens``: R, tokens of the whole sequence."""
    seq_len = spans[-1][0] + spans[-1][1]
    R = seq_len if device_tokens is None else min(device_tokens, seq_len)
    per_token = 2 * batch * local_kv_groups(config, sp) * config.head_size  # K and V elements of one token
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


def layer_state_bytes(costs: CostModel, shards: int) -> tuple[int, int, int, int]:
    """(weights, gradients, AdamW, host) bytes of the model state on one of ``shards`` = dp x sp ranks (module
    docstring); the weights count autocast's copies where there are any."""
    config, dtypes = costs.config, costs.dtypes
    params = stage_parameter_counts(config, StageSpec(0, config.n_layer, first=True, last=True))
    host = costs.model_state == "host"
    if shards == 1 and not host:  # no FSDP
        weights, gradients, optimizer = model_state_bytes(params, dtypes, 1, "step", False)
        return weights, gradients, optimizer if costs.optimizer else 0, 0
    gathered = dtypes.working * min(params.total, params.block + max(params.root, params.block))  # two units at once
    in_flight = dtypes.fresh_grad * (params.root + params.block) + dtypes.reduce * max(params.root, params.block)
    if host:
        return gathered, in_flight, 0, host_state_bytes(params, shards)
    optimizer = dtypes.optimizer * params.total // shards if costs.optimizer else 0
    master = dtypes.master * params.total // shards
    return master + gathered, dtypes.reduce * params.total // shards + in_flight, optimizer, 0


# -- a step's memory ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerOrderSetup:
    """What one step of the layer order runs with besides the model, its precision and the chunks."""

    recompute: str
    """"selective" or "full" (``runtime.layer_major.LAYER_MAJOR_RECOMPUTE``)."""
    offload: str
    """"none" or "full": every layer's checkpoints but the last's on host."""
    device_tokens: int | None
    """R: tokens of the running layer's K/V kept on the device (of the whole sequence), the rest on host."""
    chunk_tokens: int
    """Tokens per K/V chunk streamed from host."""
    batch: int = 1
    layout: Layout = Layout(1, 1, 1)
    """dp x sp ranks, one stage (pp = 1)."""
    sp_cross_node: bool = False
    """The SP group spans nodes: its all-to-alls send the share bound for other nodes over the network."""
    fsdp_cross_node: bool = False
    """The dp x sp FSDP group spans nodes."""

    @property
    def shards(self) -> int:
        return self.layout.dp * self.layout.sp


def layer_order_memory(costs: CostModel, spans: Sequence[tuple[int, int]], setup: LayerOrderSetup) -> MemoryBreakdown:
    """The device peak of one rank: model state, K/V at their peak, and the phase whose resident bytes and
    temporaries are the most (``layer_order_phases``), with its host bytes."""
    config, dtypes, profile = costs.config, costs.dtypes, costs.profile
    sp, batch, seq_len = setup.layout.sp, setup.batch, spans[-1][0] + spans[-1][1]
    stage = StageSpec(0, config.n_layer, first=True, last=True)
    weights, gradients, optimizer, host_state = layer_state_bytes(costs, setup.layout.dp * sp)
    kv = kv_peak_bytes(config, dtypes, list(spans), setup.device_tokens, setup.chunk_tokens, batch, sp)
    phases = layer_order_phases(config, dtypes, spans, setup)
    peak = max(phases, key=lambda name: sum(phases[name]))
    activations, transient = phases[peak]
    kept = batch * seq_len // sp * kept_bytes_per_token(config, dtypes, setup.recompute)
    host = kept * (config.n_layer - 1) if setup.offload == "full" else 0
    spilled = 0 if setup.device_tokens is None else max(0, seq_len - setup.device_tokens)  # the running layer's
    host_kv = batch * spilled * 2 * local_kv_groups(config, sp) * config.head_size * dtypes.compute
    autocast = dtypes.autocast_copy * stage_cast_parameters(config, stage)  # in ``weights``; the forward's only
    return MemoryBreakdown(
        weights=weights, gradients=gradients, optimizer=optimizer, kv_cache=kv, kv_grad=0, activations=activations,
        boundary=0, transient=transient, reserved=profile.reserved_bytes, host=host, host_kv=host_kv,
        host_state=host_state, autocast_credit=autocast if peak != "forward" else 0,
        allocator_slack=profile.allocator_slack_bytes,
    )  # fmt: skip


def layer_order_phases(
    config: GPTConfig, dtypes: PrecisionBytes, spans: Sequence[tuple[int, int]], setup: LayerOrderSetup
) -> dict[str, tuple[int, int]]:
    """(resident, temporaries) bytes of one rank besides the model state and K/V, at the most of each phase of a step:

    forward      the kept checkpoints (every layer's, or with offload "full" the running one's being copied out) and
                 the running layer's input and output of every chunk; one chunk's block (its MLP's three
                 intermediates and an output), or the loss chunk's logits and the head's cast (``transient_bytes``)
    replay       the running layer's checkpoints (every layer's without offload: nothing of the layer below has
                 come back yet), the working set but the dq sums, one chunk's block graph; its backward's activation
                 gradients
    chunk-major  the checkpoints (as each chunk finishes, the same chunk of the layer below takes its place) and the
                 whole working set; one chunk's projection replayed for its gradients (the norm's output, q, k, v, the
                 rotated q and k and their gradients' pieces; then the gradient of the projection's input through the
                 norm's fp32 backward), or the chunk of the layer below in flight while the finished one is let go of
    """
    d, i, c, r = config.n_embd, config.intermediate_size, dtypes.compute, dtypes.residual
    heads, groups = config.n_head * config.head_size, config.n_query_groups * config.head_size
    sp, batch, layers = setup.layout.sp, setup.batch, config.n_layer
    seq_len, longest = spans[-1][0] + spans[-1][1], max(s for _, s in spans)
    local, chunk = batch * seq_len // sp, batch * longest // sp
    kept = local * kept_bytes_per_token(config, dtypes, setup.recompute)
    working = local * working_bytes_per_token(config, dtypes, setup.recompute)
    sums = local * dq_bytes_per_token(config)  # made by the chunk-major loop, after the replay's last graph is gone
    hidden = 2 * local * r * d  # a layer's input and output, every chunk
    mlp = 3 if config.mlp == "swiglu" else 2
    loss = loss_transient_bytes(config, dtypes, chunk)  # the loss runs chunk by chunk of the layer chunks
    block = chunk * (mlp * c * i + r * d)
    graph = chunk * layer_saved_bytes_per_token(config, dtypes, sp)
    gradients = chunk * (2 * c * i + 2 * r * d)
    rotated = c * (5 * heads + 5 * groups) + c * d  # q, k, v, the rotated q and k, their gradients' pieces
    normed = c * (heads + 2 * groups) + c * d + 5 * _FP32 * d  # the qkv input's gradient through the fp32 norm
    projection = chunk * max(rotated, normed)
    on_device = layers * kept if setup.offload == "none" else kept
    in_flight = chunk * kept_bytes_per_token(config, dtypes, setup.recompute) if setup.offload == "full" else 0
    return {
        "forward": (on_device + hidden, max(block, loss)),
        "replay": (on_device + working - sums + graph, gradients),
        "chunk-major": (on_device + working, max(projection, in_flight)),
    }
