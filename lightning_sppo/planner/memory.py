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
                under recompute also one layer's recomputed level 2 of the longest subsequence
                (``activations.recompute_transient_bytes_per_token``); with K/V spilled, the prefix's dK/dV come
                back one chunk at a time, so the kernel returns one chunk's
    reserved    what the profile leaves free (CUDA context, NCCL, fragmentation)
    stream_*    under the "sppo" schedule only: the weight pieces and K/V layers shared units stream (``planner.multiplexed``)

K/V spilled to host (``kv_device_tokens`` R < S, ``attention/kv_cache.py``): each layer keeps K/V and dK/dV of
tokens [0, R) on the device, [R, S) in pinned host memory; chunks of ``kv_chunk_tokens`` are in flight on the
device for the layer computing: in backward two of K/V (the one attended, the next arriving) and three of dK/dV
(the one being added to, the next arriving, the last being written back):

    kv_cache, kv_grad   layers * 2 B (G / sp) R Dh * (c, a)
    kv_in_flight        2 B (G / sp) chunk Dh * (2 c + 3 a)
    host_kv             layers * 2 B (G / sp) (S - R) Dh * (c + a)

Model state on host (``model_state="host"``, FSDP2's CPUOffloadPolicy; one GPU is a one-rank FSDP mesh, so the
sharded precision applies): the fp32 parameter shard, its gradient and AdamW's two moments live on host,
16 P / ds bytes (``host_state``); the device holds the gathered working weights of the units in use, by sync mode
as above without the master shards, and the gradients in flight; under "step" the unsharded fp32 gradients
accumulate on the device until the step's last backward reduces them (as without offload).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from lightning_sppo.loss import default_chunk_tokens
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.activations import (
    kv_cache_bytes_per_layer,
    received_input_saved_bytes,
    recompute_transient_bytes_per_token,
    stage_saved_bytes_per_token,
    step_constant_bytes,
)
from lightning_sppo.planner.layout import StageSpec
from lightning_sppo.planner.precision import PrecisionBytes

__all__ = [
    "MemoryBreakdown",
    "StageParameters",
    "boundary_bytes",
    "host_state_bytes",
    "kv_spill_bytes",
    "level1_bytes",
    "level2_bytes",
    "loss_transient_bytes",
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
    kv_in_flight: int = 0
    """K/V spilled to host: the two chunks (K/V and dK/dV) streamed in for the layer computing."""
    host_kv: int = 0
    """K/V spilled to host: K/V and dK/dV of tokens [R, S) of every layer of the stage, pinned."""
    host_state: int = 0
    """Model state on host: the fp32 parameter shard, its gradient and AdamW's moments."""
    gradient_credit: int = 0
    """Gradient bytes not yet built at the peak: a step starts without gradients (``zero_grad(set_to_none=True)``)
    and builds them in its first backward while that subsequence's activations are freed, so at the peak at most
    the gradients beyond those activations exist (``gradients`` counts all of them)."""
    autocast_credit: int = 0
    """Autocast's weight copies not held at the peak: under recompute the forward saves none of them, so they are
    dropped when the forward's autocast context exits; a peak in backward does not hold them (``weights`` counts
    them)."""
    allocator_slack: int = 0
    """Device bytes the caching allocator holds beyond the live tensors at the peak (``HardwareProfile
    .allocator_slack_bytes``): what ``torch.cuda.max_memory_reserved`` shows above ``max_memory_allocated``."""

    @property
    def host_bytes(self) -> int:
        """Everything this rank keeps in host memory: offloaded activations, spilled K/V, model state."""
        return self.host + self.host_kv + self.host_state

    @property
    def peak_gpu_bytes(self) -> int:
        """What the device must hold: live tensors and temporaries, the allocator's slack and the profile's reserve."""
        return self.allocated_bytes + self.allocator_slack + self.reserved

    @property
    def allocated_bytes(self) -> int:
        """Live tensors and temporaries at the peak (``torch.cuda.max_memory_allocated``)."""
        return self.resident_bytes + self.transient

    @property
    def resident_bytes(self) -> int:
        """Everything held by tensors at the peak: the peak without temporaries and the reserve."""
        return (
            (self.weights + self.gradients + self.optimizer + self.kv_cache + self.kv_grad + self.activations)
            + self.boundary
            + self.stream_bytes
            + self.kv_in_flight
            - self.gradient_credit
            - self.autocast_credit
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
        return asdict(self) | {
            "peak_gpu_bytes": self.peak_gpu_bytes, "allocated_bytes": self.allocated_bytes, "host_bytes": self.host_bytes,
        }  # fmt: skip


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
    params: StageParameters, dtypes: PrecisionBytes, shards: int, sync: str = "step", host: bool = False
) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) device bytes of a stage sharded over ``shards`` FSDP ranks in ``sync`` mode;
    ``host``: model state on host (module docstring), whose host bytes are ``host_state_bytes``."""
    p = params.total
    if host:
        return _host_state_device_bytes(params, dtypes, sync)
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


def _host_state_device_bytes(params: StageParameters, dtypes: PrecisionBytes, sync: str) -> tuple[int, int, int]:
    """What the device holds of a stage whose model state lives on host: gathered weights and gradients in flight."""
    p = params.total
    gathered = p if sync != "regather" else min(p, params.root + 2 * params.block)
    fresh = dtypes.fresh_grad * (params.root + params.block)
    if sync == "step":
        fresh = 0 if dtypes.fresh_grad == dtypes.working_grad else fresh
        return dtypes.working * gathered, dtypes.working_grad * p + fresh, 0
    return dtypes.working * gathered, fresh + dtypes.reduce * max(params.root, params.block), 0


_HOST_STATE_BYTES_PER_PARAM = 16
"""fp32 parameter, fp32 gradient and AdamW's two fp32 moments."""


def host_state_bytes(params: StageParameters, shards: int) -> int:
    """Host bytes of one rank's share of a stage's model state on host: 16 bytes per parameter of its shard."""
    return _HOST_STATE_BYTES_PER_PARAM * params.total // shards


def kv_spill_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, seq_len: int, sp: int, batch: int,
    device_tokens: int | None, chunk_tokens: int, grad_tokens: int | None = None,
) -> tuple[int, int, int, int]:  # fmt: skip
    """(K/V cache, dK/dV buffers, chunks in flight, host bytes) of a stage's layers when each keeps ``device_tokens``
    tokens of K/V on the device (None: all of them, nothing in flight or on host; module docstring).

    ``grad_tokens``: the tokens later subsequences can add dK/dV to, the last subsequence's offset (the cache holds
    dK/dV for those only; 0 at N = 1); None: the whole sequence."""
    kv, grad = kv_cache_bytes_per_layer(config, dtypes, 1, sp, batch)  # per token of one layer
    summed = seq_len if grad_tokens is None else grad_tokens
    if device_tokens is None or device_tokens >= seq_len:
        return stage.layers * seq_len * kv, stage.layers * summed * grad, 0, 0
    on_host, summed_on_host = seq_len - device_tokens, max(0, summed - device_tokens)
    # K/V: attended + arriving; dK/dV: + written back
    in_flight = 2 * min(chunk_tokens, on_host) * kv + 3 * min(chunk_tokens, summed_on_host) * grad
    return (
        stage.layers * device_tokens * kv, stage.layers * min(device_tokens, summed) * grad, in_flight,
        stage.layers * (on_host * kv + summed_on_host * grad),
    )  # fmt: skip


def level1_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, seq_len: int, sp: int, batch: int = 1
) -> tuple[int, int]:
    """(K/V cache, dK/dV buffers) of a stage's layers for the whole sequence, head-sharded over sp."""
    kv, grad = kv_cache_bytes_per_layer(config, dtypes, seq_len, sp, batch)
    return stage.layers * kv, stage.layers * grad


def level2_bytes(
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, lengths: Sequence[int], sp: int, batch: int = 1,
    recompute: str = "none",
) -> list[int]:  # fmt: skip
    """A_i: offloadable level-2 bytes of each subsequence on one rank of ``stage`` (what ``recompute`` keeps).

    On all but the first stage the received hidden states are a leaf that requires grad: the offloader
    treats it like a parameter and keeps it, so it is counted in ``boundary_bytes`` instead.
    """
    per_token = stage_saved_bytes_per_token(config, dtypes, stage.layers, last=stage.last, sp=sp, recompute=recompute)
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
    config: GPTConfig, dtypes: PrecisionBytes, stage: StageSpec, seq_len: int, longest: int, sp: int, batch: int = 1,
    recompute: str = "none", kv_window: int | None = None,
) -> int:  # fmt: skip
    """Largest temporaries at the step's peak (the start of backward): the loss chunk's, or one layer's backward's,
    whichever is larger (they do not coexist: the loss's backward runs before the layers').

    A layer's backward over the longest subsequence holds its activations' gradients (the MLP's two intermediate
    gradients and the residual stream's), the attention backward's fp32 dq accumulator and dK/dV sums over its own
    tokens, the prefix's dK/dV the kernel returns before they are added into the fp32 buffers (over at most
    ``kv_window`` tokens: a chunk when K/V are spilled; with B > 1 flash-attn also copies the prefix K/V), and under
    recompute the layer's recomputed level 2. The loss chunk: its fp32 logits, their gradient, the compute-dtype
    logits, and the head's weight cast to the compute dtype."""
    local = batch * (longest // sp)
    kv_layer, grad_layer = kv_cache_bytes_per_layer(config, dtypes, min(seq_len, kv_window or seq_len), sp, batch)
    prefix = kv_layer * (2 if batch > 1 else 1)
    own_kv, own_grad = kv_cache_bytes_per_layer(config, dtypes, local, sp)
    dq = _FP32 * local * (config.n_head // sp) * config.head_size
    gradients = local * (2 * dtypes.compute * config.intermediate_size + 2 * dtypes.residual * config.n_embd)
    layer = prefix + own_kv + own_grad + dq + gradients
    layer += local * recompute_transient_bytes_per_token(config, dtypes, sp, recompute)
    loss = loss_transient_bytes(config, dtypes, local) if stage.last else 0
    return max(layer, loss)


def loss_transient_bytes(config: GPTConfig, dtypes: PrecisionBytes, tokens: int) -> int:
    """The chunked loss's temporaries over ``tokens`` local tokens: one loss chunk's fp32 logits, their gradient, the
    compute-dtype logits, and the head's weight cast to the compute dtype."""
    chunk = min(default_chunk_tokens(config.vocab_size), tokens)
    return chunk * config.vocab_size * (2 * _FP32 + dtypes.compute) + dtypes.compute * config.vocab_size * config.n_embd
