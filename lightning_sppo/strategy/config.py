"""The settings of an SPPO run: one typed, checked dataclass shared by the Fabric and Trainer strategies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from lightning_sppo.attention.kernels import KERNEL_NAMES
from lightning_sppo.parallel.dims import ParallelDims
from lightning_sppo.partition import PARTITION_POLICIES
from lightning_sppo.schedule import SCHEDULES

__all__ = ["OFFLOAD_POLICIES", "SPPOConfig"]

OFFLOAD_POLICIES = ("none", "full", "adaptive")


@dataclass(kw_only=True)
class SPPOConfig:
    """Every knob of the strategy; the keyword arguments of ``SPPOStrategy`` and the YAML keys."""

    num_subsequences: int | Literal["auto"] = "auto"
    """N, the subsequences each sequence is cut into, or "auto" (about 4K tokens each)."""
    partition: str = "length"
    """How the sequence is cut: "length" (equal), "flops" (equal FLOPs, Seq1F1B) or "adaptive" (offload-aware)."""
    offload: str = "none"
    """Share of each subsequence's saved activations sent to host memory: "none", "full" or "adaptive"."""
    attention: str = "auto"
    """Attention kernel: "auto", "flash_attn", "sdpa" or "reference"."""
    loss_chunk_tokens: int | None = None
    """Tokens per loss chunk; None keeps one chunk's fp32 logits near 128 MiB."""
    granularity: int = 1
    """Subsequence boundaries fall on multiples of this (and of sequence_parallel)."""
    pipeline_parallel: int = 1
    """Pipeline stages (pp)."""
    sequence_parallel: int = 1
    """Ulysses sequence-parallel ranks per stage (sp); n_head and n_query_groups must divide by it."""
    num_microbatches: int = 1
    """Micro-batches per step, pipelined (gradient accumulation); the batch must divide by it."""
    schedule: str = "seq1f1b"
    """Pipeline schedule: "seq1f1b" or "gpipe"."""
    layers_per_stage: list[int] | None = None
    """Explicit layer counts per stage; None balances compute."""
    save_distributed_checkpoint: bool = True
    """Sharded checkpoint folder (torch.distributed.checkpoint) if True, else one file on rank 0."""

    def __post_init__(self) -> None:
        _check_choice("partition", self.partition, tuple(PARTITION_POLICIES))
        _check_choice("offload", self.offload, OFFLOAD_POLICIES)
        _check_choice("attention", self.attention, KERNEL_NAMES)
        _check_choice("schedule", self.schedule, tuple(SCHEDULES))
        if self.num_subsequences != "auto":
            _check_positive("num_subsequences", self.num_subsequences, "or 'auto'")
        for name in ("granularity", "num_microbatches"):
            _check_positive(name, getattr(self, name))
        if self.loss_chunk_tokens is not None:
            _check_positive("loss_chunk_tokens", self.loss_chunk_tokens)
        # Checks pipeline_parallel and sequence_parallel themselves; the world size is checked at launch.
        ParallelDims.from_world(self.pipeline_parallel * self.sequence_parallel, self.pipeline_parallel,
                                self.sequence_parallel)  # fmt: skip

    @property
    def boundary_granularity(self) -> int:
        """Granularity of subsequence boundaries: with SP every subsequence splits evenly over sp ranks."""
        return self.granularity * self.sequence_parallel // math.gcd(self.granularity, self.sequence_parallel)


def _check_choice(setting: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {setting}={value!r}; choose one of {list(choices)}.")


def _check_positive(setting: str, value: Any, alternative: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        suffix = f" {alternative}" if alternative else ""
        raise ValueError(f"{setting} must be a positive integer{suffix}, got {setting}={value!r}.")
