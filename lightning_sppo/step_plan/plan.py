"""``StepPlan``: what one step does, as a value the runtime reads; ``StepSettings``: what a run fixes about it.

Shape legend: B rows of the batch, S tokens of a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

from torch import Tensor

from lightning_sppo.attention.kv_spill import DEFAULT_KV_CHUNK_TOKENS
from lightning_sppo.documents import Documents

__all__ = ["Order", "StepPlan", "StepSettings"]

Order = Literal["subsequence", "layer"]
"""How a device runs a sequence: every layer for one subsequence, then the next (SPPO's order, which pipelines), or
every chunk through one layer, then the next (FPDT's order)."""


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step, decided before it runs: the engines and the pipeline runtime take it and decide nothing.

    ``lengths``: the subsequences (or, in the layer order, the chunks) every sequence of the batch is cut into; they
    sum to S and, with sequence parallelism, each splits evenly over the sp ranks (``shard``). Their ``spans`` are also
    what the offloader is told at the start of the step (``SubsequenceHooks.begin_step``). ``num_microbatches``: the
    batch's B rows split into that many micro-batches, pipelined. ``documents``: this rank's packed documents (None
    without); the cut may follow rank 0's. ``kv_device_tokens`` / ``kv_chunk_tokens``: each layer's K/V beyond that
    many tokens lives in host memory and streams back in chunks (None: all on the device).
    """

    lengths: tuple[int, ...]
    order: Order = "subsequence"
    num_microbatches: int = 1
    documents: Documents | None = None
    kv_device_tokens: int | None = None
    kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(self.lengths))

    @property
    def seq_len(self) -> int:
        return sum(self.lengths)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(offset, length) of each subsequence or chunk."""
        return list(zip([0, *accumulate(self.lengths)][:-1], self.lengths, strict=True))

    @property
    def spill(self) -> tuple[int | None, int | None]:
        """(kv_device_tokens, kv_chunk_tokens), or (None, None) with every K/V on the device."""
        return (None, None) if self.kv_device_tokens is None else (self.kv_device_tokens, self.kv_chunk_tokens)

    def shard(self, sp: int, rank: int) -> list[tuple[int, int]]:
        """(offset, length) of sequence-parallel rank ``rank``'s contiguous share of each span (of ``sp`` equal ones)."""
        return [(offset + rank * (length // sp), length // sp) for offset, length in self.spans]

    def check(self, input_ids: Tensor, order: Order) -> None:
        """Errors for a plan made for another batch or another order than the one about to run it."""
        rows, seq_len = input_ids.shape
        if order != self.order or seq_len != self.seq_len or rows % self.num_microbatches:
            raise ValueError(
                f"A plan for order={self.order!r}, {self.num_microbatches} micro-batch(es) of {self.seq_len} tokens"
                f" cannot run order={order!r} on a batch of {rows} x {seq_len}: make the plan from this batch."
            )
        if self.documents is not None and self.documents.shape != (rows, seq_len):
            raise ValueError(f"The plan's documents describe {self.documents.shape}, not the batch {(rows, seq_len)}.")


@dataclass(frozen=True)
class StepSettings:
    """What a run fixes about its steps (the strategy's settings, or an engine's own); with a batch, and under
    ``num_subsequences="auto"`` the planner, it gives each ``StepPlan`` (``step_plan.decide``)."""

    order: Order = "subsequence"
    num_subsequences: int | Literal["auto"] = 1
    partition: str = "length"
    granularity: int = 1
    """Boundaries fall on multiples of this (the kernel's block; a multiple of ``sequence_parallel``)."""
    num_microbatches: int = 1
    sequence_parallel: int = 1
    kv_device_tokens: int | None = None
    kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS

    def __post_init__(self) -> None:
        n = self.num_subsequences
        if n != "auto" and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"num_subsequences must be a positive integer or 'auto', got num_subsequences={n!r}.")

    def plan(self, lengths: list[int], documents: Documents | None = None) -> StepPlan:
        """The plan of a batch cut into ``lengths``."""
        return StepPlan(tuple(lengths), self.order, self.num_microbatches, documents, self.kv_device_tokens,
                        self.kv_chunk_tokens)  # fmt: skip
