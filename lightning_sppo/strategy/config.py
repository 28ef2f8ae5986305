"""The settings of an SPPO run: one typed, checked dataclass shared by the Fabric and Trainer strategies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_sppo.attention.kernels import KERNEL_NAMES
from lightning_sppo.attention.kv_cache import KV_GRAD_DTYPES
from lightning_sppo.offload.policy import OFFLOAD_POLICIES
from lightning_sppo.parallel.dims import ParallelDims
from lightning_sppo.parallel.fsdp import FSDP_SYNC_MODES, FSDPSync
from lightning_sppo.partition import PARTITION_POLICIES
from lightning_sppo.planner.plan import ORDERS
from lightning_sppo.planner.profile import BUILTIN_PROFILES, load_profile
from lightning_sppo.recompute import RECOMPUTE_MODES
from lightning_sppo.schedule import SCHEDULES

__all__ = ["MODEL_STATE_PLACES", "OFFLOAD_POLICIES", "ORDERS", "SPPOConfig"]

MODEL_STATE_PLACES: tuple[str, ...] = ("device", "host")
"""The ``model_state`` setting: where parameters, gradients and optimizer state live."""


@dataclass(kw_only=True)
class SPPOConfig:
    """Every knob of the strategy; the keyword arguments of ``SPPOStrategy`` and the YAML keys."""

    num_subsequences: int | Literal["auto"] = "auto"
    """N, the subsequences each sequence is cut into, or "auto": the planner's N for each batch's length
    (``strategy/autoplan.py``; ~4K-token subsequences where the planner cannot model the run)."""
    partition: str | None = None
    """How the sequence is cut: "length" (equal), "flops" (equal FLOPs, Seq1F1B) or "adaptive" (offload-aware).
    None: the planner's choice under num_subsequences="auto", else "length"."""
    offload: str = "none"
    """Share of each subsequence's saved activations sent to host memory: "none", "full" or "adaptive"."""
    attention: str = "auto"
    """Attention kernel: "auto" (flash-attn on GPU when installed, else PyTorch's fused kernels, with cuDNN attention
    where PyTorch's SDPA would pick it), "flash_attn", "sdpa", "cudnn" or "reference" (pure PyTorch)."""
    kv_grad_dtype: str = "fp32"
    """dtype of the dK/dV accumulators of the K/V cache: "fp32" (exact to rounding) or "bf16" (opt-in: a third
    less level-1 memory, but the sums over later subsequences round in bf16, an error that grows with N)."""
    recompute: str = "none"
    """What each block recomputes in backward instead of saving: "none", "selective" (keeps its input and the
    attention output with its log-sum-exp; recomputes norms, projections and the MLP) or "full" (keeps only its
    input). What is kept still goes through the offloader, so recompute and offload stack."""
    kv_device_tokens: int | None = None
    """Tokens of each layer's K/V (and dK/dV) kept on the device; the rest of the sequence's K/V lives in pinned
    host memory and streams back in chunks of ``kv_chunk_tokens``. None keeps all of it on the device."""
    kv_chunk_tokens: int = 16384
    """Tokens per chunk of host-resident K/V streamed back to the device (two chunks are in flight at a time)."""
    model_state: str = "device"
    """Where parameters, gradients and optimizer state live: "device", or "host" (FSDP2's CPUOffloadPolicy:
    the optimizer steps on the CPU) when the GPUs cannot hold them."""
    order: str = "subsequence"
    """How one device runs a sequence: "subsequence" (every layer for subsequence 0, then 1, ...: what pipelines)
    or "layer" (every chunk through layer 0, then layer 1, ...: FPDT's order; one stage, data and Ulysses sequence
    parallel around it with FSDP2 over dp x sp; recompute "selective" or "full"; a layer's K/V and dK/dV exist only
    while it runs, one chunk's dK/dV at a time; offload "full" sends every layer's checkpoints but the last to host)."""
    loss_chunk_tokens: int | None = None
    """Tokens per loss chunk; None keeps one chunk's fp32 logits near 128 MiB."""
    granularity: int = 1
    """Subsequence boundaries fall on multiples of this (and of sequence_parallel)."""
    pipeline_parallel: int | None = 1
    """Pipeline stages (pp); None lets the planner choose when the model is set up."""
    sequence_parallel: int | None = 1
    """Ulysses sequence-parallel ranks per stage (sp); n_head and n_query_groups must divide by it (under
    order="layer" n_query_groups and sp need only divide one another). None lets the planner choose (with
    pipeline_parallel) when the model is set up; under order="layer" (pipeline_parallel=1) the planner's sp for the
    layer order, and so dp."""
    fsdp_sync: FSDPSync = "step"
    """When a sharded stage (dp * sp > 1) gathers weights and reduce-scatters gradients: "step" (once per
    step; holds the stage's unsharded weights and gradients), "reduce" (gradients after every subsequence's
    backward) or "regather" (also weights before every forward and backward). See ``parallel/fsdp.py``.
    order="layer" gathers per layer pass instead (``parallel/fsdp_layers.py``) and takes "step" only."""
    planner_profile: str | None = None
    """Hardware profile for the planner: a built-in name ("a100-80gb", "h100", "h200") or a JSON file
    (``sppo-plan --calibrate``). None: the CUDA device's built-in profile, or "a100-80gb" without CUDA."""
    num_microbatches: int = 1
    """Micro-batches per step, pipelined (gradient accumulation); the batch must divide by it."""
    schedule: str = "seq1f1b"
    """Pipeline schedule: "seq1f1b", "gpipe" or "sppo" (Seq1F1B with multiplexed sequence partitioning)."""
    layers_per_stage: list[int] | None = None
    """Explicit layer counts per stage; None balances compute."""
    save_distributed_checkpoint: bool = True
    """Sharded checkpoint folder (torch.distributed.checkpoint) if True, else one file on rank 0."""

    def __post_init__(self) -> None:
        if self.partition is not None:
            _check_choice("partition", self.partition, tuple(PARTITION_POLICIES))
        _check_choice("fsdp_sync", self.fsdp_sync, FSDP_SYNC_MODES)
        _check_choice("offload", self.offload, OFFLOAD_POLICIES)
        _check_choice("attention", self.attention, KERNEL_NAMES)
        _check_choice("kv_grad_dtype", self.kv_grad_dtype, tuple(KV_GRAD_DTYPES))
        _check_choice("schedule", self.schedule, tuple(SCHEDULES))
        _check_choice("recompute", self.recompute, RECOMPUTE_MODES)
        _check_choice("model_state", self.model_state, MODEL_STATE_PLACES)
        _check_choice("order", self.order, ORDERS)
        if self.order == "layer":
            self._check_layer_order()
        _check_positive("kv_chunk_tokens", self.kv_chunk_tokens)
        if self.kv_device_tokens is not None and (
            not isinstance(self.kv_device_tokens, int)
            or isinstance(self.kv_device_tokens, bool)
            or self.kv_device_tokens < 0
        ):
            raise ValueError(
                f"kv_device_tokens must be a non-negative integer (0 keeps all K/V on host) or None (all on the"
                f" device), got kv_device_tokens={self.kv_device_tokens!r}."
            )
        if self.num_subsequences != "auto":
            _check_positive("num_subsequences", self.num_subsequences, "or 'auto'")
        for name in ("granularity", "num_microbatches"):
            _check_positive(name, getattr(self, name))
        if self.planner_profile is not None and (
            not isinstance(self.planner_profile, str) or not _is_profile(self.planner_profile)
        ):
            raise ValueError(
                f"planner_profile={self.planner_profile!r} is neither a built-in profile {sorted(BUILTIN_PROFILES)}"
                " nor a profile JSON file (sppo-plan --calibrate writes one)."
            )
        if self.loss_chunk_tokens is not None:
            _check_positive("loss_chunk_tokens", self.loss_chunk_tokens)
        if self.layers_per_stage is not None:
            stages = self.layers_per_stage
            if not isinstance(stages, (list, tuple)) or not stages or not _positive_ints(*stages):
                raise ValueError(
                    "layers_per_stage must be a list of positive layer counts, one per pipeline stage, or None (balanced"
                    f" by compute), got layers_per_stage={stages!r}."
                )
            if _positive_ints(self.pipeline_parallel) and len(stages) != self.pipeline_parallel:
                raise ValueError(
                    f"layers_per_stage must list one layer count per pipeline stage, got {len(stages)} counts"
                    f" (layers_per_stage={list(stages)}) for pipeline_parallel={self.pipeline_parallel}."
                )
        if not isinstance(self.save_distributed_checkpoint, bool):
            raise ValueError(
                "save_distributed_checkpoint must be True (a sharded folder) or False (one file), got"
                f" save_distributed_checkpoint={self.save_distributed_checkpoint!r}."
            )
        # Checks pipeline_parallel and sequence_parallel themselves; the world size is checked at launch.
        pp = 1 if self.pipeline_parallel is None else self.pipeline_parallel
        sp = 1 if self.sequence_parallel is None else self.sequence_parallel
        ParallelDims.from_world(pp * sp if _positive_ints(pp, sp) else 1, pp, sp)

    def _check_layer_order(self) -> None:
        """What order='layer' runs: one stage (data and sequence parallel around it), recomputing, no schedule."""
        if self.pipeline_parallel != 1:
            raise ValueError(
                "order='layer' runs the whole model as one stage: set pipeline_parallel=1 (sequence_parallel a number,"
                f" or None for the planner's), got pipeline_parallel={self.pipeline_parallel}; or use"
                " order='subsequence'."
            )
        if self.recompute not in ("selective", "full"):
            raise ValueError(
                f"order='layer' recomputes each layer in its backward: set recompute='selective' (keeps the attention"
                f" output) or 'full', got recompute={self.recompute!r}."
            )
        if self.offload not in ("none", "full"):
            raise ValueError(
                f"order='layer' sends whole layers' checkpoints to host: set offload='none' or 'full', got"
                f" offload={self.offload!r}."
            )
        if self.kv_grad_dtype != "fp32":
            raise ValueError(
                f"order='layer' sums one chunk's dK/dV at a time, in fp32: remove kv_grad_dtype={self.kv_grad_dtype!r}"
                " (or use order='subsequence')."
            )
        pipelined = {"fsdp_sync": ("step", self.fsdp_sync), "schedule": ("seq1f1b", self.schedule),
                     "num_microbatches": (1, self.num_microbatches)}  # fmt: skip
        for setting, (default, value) in pipelined.items():
            if value != default:
                raise ValueError(
                    f"order='layer' gathers each layer's weights once per layer pass and runs no pipeline schedule:"
                    f" {setting} does not apply, got {setting}={value!r}; remove it (default {default!r}) or use"
                    " order='subsequence'."
                )

    @property
    def plans_layout(self) -> bool:
        """Whether the planner chooses pipeline_parallel and sequence_parallel (one of them is None)."""
        return self.pipeline_parallel is None or self.sequence_parallel is None

    @property
    def boundary_granularity(self) -> int:
        """Granularity of subsequence boundaries: with SP every subsequence splits evenly over sp ranks."""
        return math.lcm(self.granularity, 1 if self.sequence_parallel is None else self.sequence_parallel)


def _check_choice(setting: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {setting}={value!r}; choose one of {list(choices)}.")


def _check_positive(setting: str, value: Any, alternative: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        suffix = f" {alternative}" if alternative else ""
        raise ValueError(f"{setting} must be a positive integer{suffix}, got {setting}={value!r}.")


def _is_profile(spec: str) -> bool:
    """A built-in profile's name, or a profile JSON file that reads (its errors name planner_profile)."""
    if spec in BUILTIN_PROFILES:
        return True
    if not Path(spec).is_file():
        return False
    load_profile(spec, "planner_profile")
    return True


def _positive_ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
