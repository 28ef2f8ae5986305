"""Bytes one GPU holds at its step's peak, and the pinned host bytes behind it, for one pipeline stage.

The peak sits at the start of backward: the whole step's K/V cache, the fp32 dK/dV buffers that the
first backward allocates, the level-2 activations still on the device after offloading, and the model
state. Terms, per stage of P parameters over ds = dp * sp FSDP shards (``parallel/fsdp.py``); an FSDP
unit is one block, or the stage's root (embedding, final norm, head); w is the working (gathered) dtype
and g the dtype one backward produces gradients in (``planner.precision``):

    weights     ds = 1 (no FSDP): the fp32 parameters, + 2 P_linear autocast copies under bf16-mixed.
                ds > 1: 4 P / ds fp32 master shards + gathered weights: w P for sync "step" and "reduce"
                (gathered once, held for the step), w (root + 2 blocks) for "regather" (the block being
                computed and the one FSDP prefetches; the root is used at both ends of every pass)
    gradients   ds = 1: 4 P. ds > 1, "step": 4 P unsharded, accumulated over the step's backwards, in fp32
                (FSDP2 upcasts bf16 gradients to its reduce dtype); "reduce"/"regather": 4 P / ds sharded.
                Plus gradients in flight: g (root + block) not yet accumulated or reduced (the root's wait
                for the end of each backward; none for fp32 "step"), and for "reduce"/"regather" one unit's
                fp32 reduce-scatter input
    optimizer   8 P / ds: AdamW's two fp32 moments
    kv_cache    layers * 2 B (G / sp) S Dh * c          level 1 (SPPO section 5.1)
    kv_grad     layers * 2 B (G / sp) S Dh * a          dK/dV, held through backward (a = 4: fp32; 2 under the
                                                        opt-in kv_grad_dtype="bf16")
    activations level 2 on the device at its peak, max_i (M_{i-1} + A_i) (SPPO section 5.2)
    boundary    pipeline messages the runtime holds for the step: the received inputs (leaves, never
                offloaded) and, on all but the last stage, the outputs kept for backward and sends
    transient   largest temporaries of one layer: the prefix's dK/dV that the attention kernel returns
                before they are added into the fp32 buffers (one layer's K/V; with B > 1 flash-attn also
                copies the prefix K/V, which the cache's sequence-major layout spares it at B = 1), twice
                one layer's level 2 of the longest subsequence for the gradients of its activations, and
                the loss chunk's logits
    reserved    what the profile leaves free (CUDA context, NCCL, fragmentation)
    stream_*    under the "sppo" schedule only: the weight pieces and K/V layers shared units stream (``planner.multiplexed``)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from lightning_sppo.loss import default_chunk_tokens
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.activations import (
    kv_cache_bytes_per_layer,
    layer_saved_bytes_per_token,
    received_input_saved_bytes,
    stage_saved_bytes_per_token,
    step_constant_bytes,
)
from lightning_sppo.planner.layout import StageSpec
from lightning_sppo.planner.precision import PrecisionBytes

__all__ = [
    "MemoryBreakdown",
    "StageParameters",
    "boundary_bytes",
    "level1_bytes",
    "level2_bytes",
    "model_state_bytes",
    "stage_cast_parameters",
    "stage_parameter_counts",
    "stage_parameters",
    "transient_bytes",
]

_FP32 = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Device bytes of one rank at its peak, by owner, and the pinned host bytes of its offloaded activations."""

    weights: int
    gradients: int
    optimizer: int
    kv_cache: int
    kv_grad: int
    activations: int
    boundary: int
    transient: int
    reserved: int
    host: int
    stream_weights: int = 0
    """"sppo": the most any shared unit's weights take on this rank at once (pieces in flight, their gradients)."""
    stream_kv: int = 0
    """"sppo": the K/V a helper receives for one layer of that unit (0 under seq1f1b)."""

    @property
    def peak_gpu_bytes(self) -> int:
        return self.resident_bytes + self.transient + self.reserved

    @property
    def resident_bytes(self) -> int:
        """Everything held by tensors at the peak: the peak without temporaries and the reserve."""
        return (
            (self.weights + self.gradients + self.optimizer + self.kv_cache + self.kv_grad + self.activations)
            + self.boundary
            + self.stream_bytes
        )

    @property
    def stream_bytes(self) -> int:
        """What the "sppo" schedule's shared units stream through this rank at their peak: weights and K/V."""
        return self.stream_weights + self.stream_kv

    @property
    def model_state_bytes(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def level1_bytes(self) -> int:
        return self.kv_cache + self.kv_grad

    def to_dict(self) -> dict[str, int]:
        return asdict(self) | {"peak_gpu_bytes": self.peak_gpu_bytes}


def stage_parameters(config: GPTConfig, stage: StageSpec) -> int:
    """Parameters a stage owns (``parallel/stages.split_stage``): its blocks, the embedding, the final norm and head."""
    d = config.n_embd
    norm = d + (d if config.norm == "layernorm" and config.bias else 0)
    hidden = config.n_head * config.head_size
    qkv_out = (config.n_head + 2 * config.n_query_groups) * config.head_size
    mlp_in = 2 if config.mlp == "swiglu" else 1
    bias, qkv_bias = int(config.bias), int(config.bias or config.attn_bias)
    block = 2 * norm + d * qkv_out + qkv_bias * qkv_out + hidden * d + bias * d
    block += mlp_in * (d * config.intermediate_size + bias * config.intermediate_size)
    block += config.intermediate_size * d + bias * d
    if config.norm_qk:  # one norm over the head size for q, one for k
        block += 2 * config.norm_parameters(config.head_size)
    total = stage.layers * block
    if stage.first:
        total += config.vocab_size * d
    if stage.last:
        total += norm
        # A tied head is the embedding itself on a stage that has both; with a pipeline each end holds a copy.
        total += 0 if stage.first and config.tie_embeddings else config.vocab_size * d
    return total


def stage_cast_parameters(config: GPTConfig, stage: StageSpec) -> int:
    """Parameters autocast copies and keeps for backward: the blocks' linear layers.

    The embedding is a lookup (not autocast), norms compute in fp32, and the head's copies live inside the
    loss chunks' checkpoints (made again in backward), so none of those is held.
    """
    d, bias = config.n_embd, int(config.bias)
    qkv_out = (config.n_head + 2 * config.n_query_groups) * config.head_size
    hidden = config.n_head * config.head_size
    mlp_in = 2 if config.mlp == "swiglu" else 1
    linear = (d + int(config.bias or config.attn_bias)) * qkv_out + (hidden + bias) * d
    linear += mlp_in * (d + bias) * config.intermediate_size + (config.intermediate_size + bias) * d
    return stage.layers * linear


@dataclass(frozen=True)
class StageParameters:
    """A stage's parameters, as FSDP units: what model-state bytes are counted from."""

    total: int
    root: int
    """The stage's own parameters outside its blocks: embedding (first stage), final norm and head (last)."""
    block: int
    """One block (every block is its own FSDP unit)."""
    cast: int
    """Parameters autocast copies (``stage_cast_parameters``)."""


def stage_parameter_counts(config: GPTConfig, stage: StageSpec) -> StageParameters:
    total = stage_parameters(config, stage)
    block = stage_parameters(config, StageSpec(0, 1, first=False, last=False))
    return StageParameters(total, total - stage.layers * block, block, stage_cast_parameters(config, stage))


def model_state_bytes(
    params: StageParameters, dtypes: PrecisionBytes, shards: int, sync: str = "step"
) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes of a stage sharded over ``shards`` FSDP ranks in ``sync`` mode."""
    p = params.total
    if shards == 1:  # no FSDP: the fp32 parameters are working copy and master, their .grad accumulates
        return dtypes.working * p + dtypes.autocast_copy * params.cast, dtypes.working_grad * p, dtypes.optimizer * p
    gathered = p if sync != "regather" else min(p, params.root + 2 * params.block)
    weights = dtypes.master * p // shards + dtypes.working * gathered + dtypes.autocast_copy * params.cast
    fresh = dtypes.fresh_grad * (params.root + params.block)  # produced, not yet accumulated or reduced
    if sync == "step":
        # Autograd accumulates fp32 gradients into the unsharded .grad in place; the one reduce-scatter comes
        # in the step's last backward, when the activations it could coincide with are gone.
        fresh = 0 if dtypes.fresh_grad == dtypes.working_grad else fresh
        return weights, dtypes.working_grad * p + fresh, dtypes.optimizer * p // shards
    in_flight = fresh + dtypes.reduce * max(params.root, params.block)  # one unit's reduce-scatter input
    return weights, dtypes.reduce * p // shards + in_flight, dtypes.optimizer * p // shards


def level1_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, seq_len: int, sp: int, batch: int = 1
) -> tuple[int, int]:
    """(K/V cache, dK/dV buffers) of a stage's layers for the whole sequence, head-sharded over sp."""
    kv, grad = kv_cache_bytes_per_layer(config, dtypes, seq_len, sp, batch)
    return stage.layers * kv, stage.layers * grad


def level2_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, lengths: Sequence[int], sp: int, batch: int = 1
) -> list[int]:
    """A_i: offloadable level-2 bytes of each subsequence on one rank of ``stage``.

    On all but the first stage the received hidden states are a leaf that requires grad: the offloader
    treats it like a parameter and keeps it, so it is counted in ``boundary_bytes`` instead.
    """
    per_token = stage_saved_bytes_per_token(config, dtypes, stage.layers, last=stage.last, sp=sp)
    if not stage.first:
        per_token -= received_input_saved_bytes(config, dtypes)
    return [batch * (n // sp) * per_token for n in lengths]


def boundary_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, seq_len: int, sp: int, batch: int = 1
) -> int:
    """Pipeline messages held for the whole step (``runtime/pipeline.py``) plus the int64 ids and targets."""
    per_token = dtypes.message * config.n_embd * ((not stage.first) + (not stage.last))
    constants = step_constant_bytes(seq_len, batch, first=stage.first, last=stage.last)
    return batch * (seq_len // sp) * per_token + constants


def transient_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, seq_len: int, longest: int, sp: int, batch: int = 1
) -> int:
    """Largest temporaries of one layer's backward (see the module docstring); an estimate, not a count."""
    kv_layer, _ = kv_cache_bytes_per_layer(config, dtypes, seq_len, sp, batch)
    attention = kv_layer * (2 if batch > 1 else 1)
    activations = 2 * batch * (longest // sp) * layer_saved_bytes_per_token(config, dtypes, sp)
    loss = 0
    if stage.last:  # one chunk's fp32 logits, their gradient and the compute-dtype logits
        chunk = min(default_chunk_tokens(config.vocab_size), batch * (longest // sp))
        loss = chunk * config.vocab_size * (2 * _FP32 + dtypes.compute)
    return attention + activations + loss
