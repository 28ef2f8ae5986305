"""The plain model, with or without full activation checkpointing ("AC"), under the same cost model as the engine.

Training the plain model on the whole sequence at once is what a user would do without this project; with every
block checkpointed (``torch.utils.checkpoint`` per block, the ``plain + AC`` row of ``benchmarks/gpu_suite.py``) it
keeps only each block's input and runs each block's forward again in its backward. The planner scores it beside
every plan (``solver.solve``), so its advice says when AC is faster than anything it found.

Each GPU trains its own sequence (data parallel over the world, model state sharded by FSDP2 when there are several
GPUs, gathered once per step and reduced once: sync "step"). Time, per layer: the block's GEMMs (3 passes, 4 with
AC), one causal attention call over the sequence forward and backward (again forward under AC) with the kernel
PyTorch's SDPA picks on this GPU (``HardwareProfile.sdpa_attention``), the census's elementwise bytes and ops
(``planner.census``, the plain passes), the larger of device and host time; plus the head and loss, the FSDP
traffic the passes do not hide, and the optimizer's step. Memory at the peak of backward:

    plain    model state, everything the blocks save for backward (``census.Counts.plain_saved``, measured with
             ``saved_tensors_hooks``), the stage's extras, and one layer's backward temporaries
    AC       model state, every block's input (the residual stream), and the recomputed layer's saved tensors
             and temporaries; its peak is at the last layer's backward, where the inputs of every layer are still
             held (the gradients are built as the inputs are freed)

The gradients are built during backward while the activations are freed (``zero_grad(set_to_none=True)`` leaves
none at the step's start): at the peak they are not all there (the peak of AC is in its first backward layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sppo.loss import default_chunk_tokens
from lightning_sppo.planner.activations import kv_cache_bytes_per_layer, stage_extra_bytes_per_token
from lightning_sppo.planner.costs import CostModel, block_params
from lightning_sppo.planner.layout import StageSpec
from lightning_sppo.planner.memory import model_state_bytes, stage_parameter_counts, step_constant_bytes
from lightning_sppo.planner.precision import precision_bytes

__all__ = ["PlainStep", "plain_step"]

_FP32 = 4


@dataclass(frozen=True)
class PlainStep:
    """The plain model's step on one GPU, predicted."""

    checkpointed: bool
    seq_len: int
    step_s: float
    peak_bytes: int
    """Device bytes at the step's peak (allocated: live tensors and temporaries), without the profile's reserve."""
    kernel: str
    """The attention kernel it runs (PyTorch's SDPA pick on this GPU)."""

    @property
    def tokens_per_s(self) -> float:
        return self.seq_len / self.step_s

    @property
    def name(self) -> str:
        return "plain + AC" if self.checkpointed else "plain"


def plain_step(
    costs: CostModel, seq_len: int, checkpointed: bool, *, world: int = 1, kernel: str | None = None
) -> PlainStep:
    """The plain model on ``seq_len`` tokens per GPU (``checkpointed``: full activation checkpointing), model state
    sharded over ``world`` GPUs; ``costs`` gives the model, precision (its ``dtypes`` are re-derived for the
    sharding), profile and whether the step has an optimizer."""
    config, profile = costs.config, costs.profile
    sharded = world > 1
    dtypes = precision_bytes(_precision(costs), sharded, costs.dtypes.kv_grad_dtype)
    costs = CostModel(config, dtypes, profile, costs.document_length, "none", "device", optimizer=costs.optimizer)
    name = kernel or profile.sdpa_attention
    device, host = costs.plain_layer_seconds(seq_len, checkpointed, name)
    compute = config.n_layer * max(device, host)
    forward_head, forward_host = costs.head_seconds(seq_len, backward=False)
    backward_head, backward_host = costs.head_seconds(seq_len, backward=True)
    compute += max(forward_head, forward_host) + max(backward_head, backward_host)
    stage = StageSpec(0, config.n_layer, first=True, last=True)
    params = stage_parameter_counts(config, stage).total
    comm = costs.fsdp_gather(params, world, False) + costs.fsdp_reduce(params, world, False) if sharded else 0.0
    seconds = max(compute, comm) + costs.optimizer_seconds(params, world)
    return PlainStep(checkpointed, seq_len, seconds, _peak_bytes(costs, seq_len, checkpointed, world), name)


def _precision(costs: CostModel) -> str:
    return "fp32" if costs.dtypes.compute == 4 else "bf16-mixed"


def _peak_bytes(costs: CostModel, seq_len: int, checkpointed: bool, world: int) -> int:
    """Device bytes at the peak of backward (module docstring)."""
    config, dtypes = costs.config, costs.dtypes
    stage = StageSpec(0, config.n_layer, first=True, last=True)
    params = stage_parameter_counts(config, stage)
    weights, grads, optimizer = model_state_bytes(params, dtypes, world, "step")
    if not costs.optimizer:
        optimizer = 0
    saved = costs.census.plain_saved
    widths = costs._widths
    layer = saved.bytes(widths, seq_len)  # what one block saves for backward (its weights' copies are model state)
    extras = stage_extra_bytes_per_token(config, dtypes, last=True) * seq_len + step_constant_bytes(
        seq_len, 1, first=True, last=True
    )
    transient = _layer_transient(costs, seq_len)
    per_layer_grads = grads * block_params(config) // max(1, params.total)
    if (
        checkpointed
    ):  # the recomputed layer's saved tensors are freed as its backward uses them: not with its temporaries
        kept = dtypes.residual * config.n_embd * seq_len  # each block's input
        peak = weights + optimizer + config.n_layer * kept + max(layer, transient) + per_layer_grads + extras
    else:
        peak = weights + optimizer + config.n_layer * layer + extras + transient
    return int(peak)


def _layer_transient(costs: CostModel, seq_len: int) -> int:
    """The temporaries of one layer's backward at its peak: the attention backward's output gradients and its fp32
    dq accumulator, and the loss chunk's logits (their fp32 copy and gradient)."""
    config, dtypes = costs.config, costs.dtypes
    kv, _ = kv_cache_bytes_per_layer(config, dtypes, seq_len)
    dq = _FP32 * seq_len * config.n_head * config.head_size
    chunk = min(default_chunk_tokens(config.vocab_size), seq_len)
    loss = chunk * config.vocab_size * (2 * _FP32 + dtypes.compute)
    return kv + dq + loss
