"""What the planner is asked (``PlanRequest``) and what it answers (``Plan`` or ``NoFeasiblePlan``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.parallel.fsdp import FSDP_SYNC_MODES
from lightning_sppo.planner.evaluate import OFFLOAD_ORDER, SCHEDULE_ORDER
from lightning_sppo.planner.memory import MemoryBreakdown
from lightning_sppo.planner.options import (
    DEFAULT_KV_CHUNK_TOKENS,
    KV_AUTO,
    MODEL_STATE_ORDER,
    RECOMPUTE_ORDER,
    KVDeviceTokens,
)
from lightning_sppo.planner.precision import KV_GRAD_DTYPES, PRECISIONS, KVGradDtype, Precision
from lightning_sppo.planner.profile import HardwareProfile
from lightning_sppo.planner.step_time import TimeBreakdown

__all__ = ["ORDERS", "PARTITION_ORDER", "NoFeasiblePlan", "Plan", "PlanRequest", "RunnerUp"]

ORDERS = ("subsequence", "layer")
"""How the GPUs may run a sequence (``SPPOConfig.order``)."""

PARTITION_ORDER = ("flops", "length")
"""Partition policies the solver tries per (layout, N), in order, until one fits."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """A model, a sequence length and a cluster; the CLI flag of each field is named in its errors."""

    config: GPTConfig
    """The model (``--model``)."""
    seq_len: int
    """Tokens per sequence (``--seq-len``)."""
    nodes: int
    """Number of nodes (``--nodes``); GPUs per node come from the profile."""
    profile: HardwareProfile
    """The GPU and node (``--gpu``, ``--gpus-per-node``)."""
    precision: Precision = "bf16-mixed"
    """Parameter and compute dtypes (``--precision``)."""
    batch_size: int = 1
    """Sequences per micro-batch on one data-parallel rank; one micro-batch per step."""
    min_tokens_per_device: int | None = None
    """Shortest mean subsequence per device the search tries; None: the cost model's (``solver.shortest_tokens``:
    where a layer's fixed cost per pass reaches a quarter of its matmul time), or 2K where that is longer. Not a fixed
    2K floor: the SPPO paper's own Table 4 goes below it (GPT-65B at 768K, SP=16, N=96: 512 tokens per device)."""
    max_tokens_per_device: int = 16384
    """Longest mean subsequence per device the search tries."""
    num_subsequences: int | None = None
    """Subsequences per sequence to use (``--num-subsequences``); None lets the solver choose."""
    sp: int | None = None
    """Sequence-parallel size to use (``--sp``); None lets the solver choose."""
    pp: int | None = None
    """Pipeline stages to use (``--pp``); None lets the solver choose."""
    offload: tuple[str, ...] = OFFLOAD_ORDER
    """Offload policies the solver may pick (``--offload``), tried in this order."""
    fsdp_sync: tuple[str, ...] = FSDP_SYNC_MODES
    """FSDP sync modes the solver may pick (``--fsdp-sync``); the fastest that fits wins."""
    partition: tuple[str, ...] = PARTITION_ORDER
    """Partition policies the solver may pick, tried in this order."""
    granularity: int = 1
    """Subsequence boundaries also fall on multiples of this (besides sp * 128 tokens)."""
    schedule: tuple[str, ...] = SCHEDULE_ORDER
    """Pipeline schedules the solver may pick (``--schedule``); the fastest that fits wins."""
    kv_grad_dtype: KVGradDtype = "fp32"
    """dK/dV accumulators of the K/V cache (``--kv-grad-dtype``): "fp32", or the lossy opt-in "bf16"."""
    document_length: int | None = None
    """Mean length of packed, document-masked documents (``--document-length``): attention only inside them, so
    a sequence of short documents costs far less than one long one (``planner.flops`` says how it is counted).
    None: every sequence is one document."""
    recompute: tuple[str, ...] = RECOMPUTE_ORDER
    """Recompute modes the solver may pick (``--recompute``), least recomputed first (``planner.options``)."""
    model_state: tuple[str, ...] = MODEL_STATE_ORDER
    """Where model state may live (``--model-state``): "device" first, "host" when needed."""
    kv_device_tokens: KVDeviceTokens = KV_AUTO
    """Tokens of each layer's K/V kept on the device (``--kv-device-tokens``): "auto" (all when they fit, else the
    largest prefix that fits), None (all), or a pinned R; under both schedules."""
    kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS
    """Tokens per chunk of spilled K/V streamed back (``--kv-chunk-tokens``)."""
    attention: str = "auto"
    """The engine's attention backend (``SPPOConfig.attention``): "auto" runs the profile's ``auto_attention`` where
    the runtime has it (``costs.resolve_attention``)."""
    compare_ac: bool = True
    """Score the plain model with full activation checkpointing beside the plan (``planner.plain``)."""
    order: tuple[str, ...] = ORDERS
    """How the GPUs may run the sequence (``--order``): "subsequence", and "layer" (``runtime.layer_major``: one stage,
    Ulysses over sp ranks, FSDP2 over dp x sp); the faster per sequence that fits wins."""

    def __post_init__(self) -> None:
        for flag, value in (("--seq-len", self.seq_len), ("--nodes", self.nodes), ("batch_size", self.batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {flag}={value!r}.")
        if self.seq_len > self.config.block_size:
            raise ValueError(
                f"--seq-len={self.seq_len} exceeds the model's block_size={self.config.block_size};"
                f" use --seq-len<={self.config.block_size} or raise --block-size (model_overrides.block_size)."
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision={self.precision!r} is not one of {list(PRECISIONS)}.")
        for flag, value in (("--sp", self.sp), ("--pp", self.pp), ("--num-subsequences", self.num_subsequences)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag} must be a positive integer, got {flag}={value!r}.")
        for flag, values, choices in (
            ("--offload", self.offload, OFFLOAD_ORDER),
            ("--fsdp-sync", self.fsdp_sync, FSDP_SYNC_MODES),
            ("partition", self.partition, PARTITION_ORDER),
            ("--schedule", self.schedule, SCHEDULE_ORDER),
            ("--recompute", self.recompute, RECOMPUTE_ORDER),
            ("--model-state", self.model_state, MODEL_STATE_ORDER),
            ("--order", self.order, ORDERS),
        ):
            if not values or any(v not in choices for v in values):
                raise ValueError(f"{flag}={list(values)} must name one or more of {list(choices)}.")
        value = self.document_length
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"--document-length must be a positive number of tokens, got --document-length={value!r}; e.g. 8K."
            )
        tokens = self.kv_device_tokens
        if tokens not in (None, KV_AUTO) and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
            raise ValueError(
                f"--kv-device-tokens must be 'auto', 'all' or a number of tokens >= 0, got {tokens!r}; e.g. 256K."
            )
        chunk = self.kv_chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"--kv-chunk-tokens must be a positive number of tokens, got {chunk!r}; e.g. 16K.")
        if self.kv_grad_dtype not in KV_GRAD_DTYPES:
            raise ValueError(f"--kv-grad-dtype={self.kv_grad_dtype!r} is not one of {list(KV_GRAD_DTYPES)}.")
        if self.granularity < 1:
            raise ValueError(f"granularity must be >= 1, got granularity={self.granularity}.")
        if not 0 < (self.min_tokens_per_device or 1) <= self.max_tokens_per_device:
            raise ValueError(
                "min_tokens_per_device must be positive and <= max_tokens_per_device, got"
                f" {self.min_tokens_per_device} and {self.max_tokens_per_device}."
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.profile.gpus_per_node


@dataclass(frozen=True)
class RunnerUp:
    """A layout that fits but lost, with its best N and the reason it lost."""

    schedule: str
    sp: int
    pp: int
    dp: int
    num_subsequences: int
    partition_policy: str
    offload: str
    fsdp_sync: str
    recompute: str
    kv_device_tokens: int | None
    model_state: str
    step_time_s: float
    tokens_per_gpu_per_s: float
    bubble_ratio: float
    peak_gpu_bytes: int
    why: str


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The chosen layout and its predictions. Memory is per GPU, for the stage with the highest peak."""

    model: str
    seq_len: int
    nodes: int
    gpus_per_node: int
    profile: str
    precision: str
    sp: int
    pp: int
    dp: int
    num_subsequences: int
    num_microbatches: int
    schedule: str
    """"seq1f1b", or "sppo" (Seq1F1B with multiplexed sequence partitioning: helpers stream other stages' weights and
    K/V piece by piece, ``planner.multiplexed``)."""
    kv_grad_dtype: str
    """dK/dV accumulators: "fp32", or "bf16" (lossy opt-in)."""
    layers_per_stage: list[int]
    partition: list[int]
    """Subsequence lengths (tokens of the whole sequence; each SP rank takes 1/sp of each)."""
    partition_policy: str
    """``lightning_sppo.partition`` policy of ``partition``: "flops", or "length" when flops does not fit."""
    document_length: int | None
    """Packed documents of this mean length (attention counted inside them), or None (one document)."""
    offload: str
    """Offload policy of the offloader: "none", "adaptive" or "full"."""
    fsdp_sync: str
    """FSDP sync mode (``parallel/fsdp.py``): "step", "reduce" or "regather"; "step" when dp * sp = 1 (and model
    state on the device)."""
    recompute: str
    """What each block recomputes in backward: "none", "selective" or "full" (``planner.options``)."""
    kv_device_tokens: int | None
    """R: tokens of each layer's K/V kept on the device, the rest on host; None: all on the device."""
    kv_chunk_tokens: int
    model_state: str
    """Where parameters, gradients and AdamW live: "device", or "host" (FSDP2's CPUOffloadPolicy)."""
    granularity: int
    """Subsequence boundaries of ``partition`` fall on multiples of this."""
    alpha: list[float]
    """alpha_i of the stage with the highest device peak (``alpha_stage``)."""
    alpha_stage: int
    alpha_by_stage: list[list[float]]
    peak_gpu_bytes: int
    peak_host_bytes: int
    """Host bytes of the stage that keeps the most there: offloaded activations, spilled K/V, model state."""
    gpu_bytes: int
    """The profile's device memory (HBM), for comparison."""
    host_limit_bytes: int
    """Host bytes one GPU may use: 7/8 of ``host_bytes_per_node`` over the node's GPUs."""
    host_bytes_per_node: int
    """The host memory per node assumed (``--host-memory``; 0 when a profile file gives only the per-GPU share)."""
    memory: MemoryBreakdown
    step_time_s: float
    tokens_per_gpu_per_s: float
    mfu: float
    bubble_ratio: float
    time: TimeBreakdown
    pp_cross_node: bool
    runner_ups: list[RunnerUp] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    """One line per layout and schedule that fits at no N, with the limit it exceeds and by how much."""
    pruned: int = 0
    """Layouts (per schedule) the search left before fitting one of their N: by the cost model's lower bound, none of
    the N left could beat the fastest few found."""
    other_schedules: list[str] = field(default_factory=list)
    """Per other schedule the request allowed: its fastest plan and why it lost, or why nothing fits with it."""
    attention_kernel: str = "flash"
    """The attention kernel the plan's step time assumes (``planner.kernels.ATTENTION_KERNELS``)."""
    plain_ac: dict[str, Any] | None = None
    """The plain model with full activation checkpointing on the same GPUs (each trains its own sequence): its
    ``step_time_s``, ``tokens_per_gpu_per_s``, ``peak_gpu_bytes``, ``fits`` and ``kernel`` (``planner.plain``)."""
    advice: str = ""
    """One line when the plain model with full activation checkpointing is faster than this plan, with both figures."""
    order: str = "subsequence"
    """How the GPUs run the sequence: "subsequence" (every layer for one subsequence, then the next), or "layer" (every
    chunk through one layer, then the next; ``num_subsequences`` chunks, ``runtime.layer_major``)."""
    mfu_terms: dict[str, float] = field(default_factory=dict)
    """Order "layer": seconds of the step beyond its model FLOPs at the peak rate, by cause (``layer_time.GAP_TERMS``);
    each over ``step_time_s`` is the share of the peak it costs, and with ``mfu`` they sum to 1."""

    @property
    def seconds_per_sequence(self) -> float:
        """Step time over the dp sequences a step trains (one per data-parallel replica)."""
        return self.step_time_s / self.dp

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["seconds_per_sequence"] = self.seconds_per_sequence
        data["memory"] = self.memory.to_dict()
        data["time"] = self.time.as_dict()
        return data


class NoFeasiblePlan(ValueError):
    """No layout fits; ``limit`` is "gpu" or "host", and the message says by how much and what to change."""

    def __init__(self, message: str, limit: str, overflow_bytes: int, before_activations: bool = False) -> None:
        super().__init__(message)
        self.limit = limit
        self.overflow_bytes = overflow_bytes
        self.before_activations = before_activations
        """Whether ``overflow_bytes`` counts only what is held before any activation (the layout was not tried)."""
