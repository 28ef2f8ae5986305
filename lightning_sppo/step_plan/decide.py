"""Where a step's cut is decided: ``decide_cut``, run once per batch shape (per batch when the cut follows its
documents) by ``StepPlans`` on rank 0 and shared with every rank (``step_plan.agree``).

N and the partition: a fixed ``num_subsequences`` is cut by ``partition``; under "auto" the subsequence order takes
the planner's (N, policy, granularity) for the batch's length and rows (the strategy's ``AutoPlanner``; without one,
~4K-token subsequences) and the layer order chunks of at most ``LAYER_CHUNK_TOKENS`` per sequence-parallel rank. A choice is final (kept for
its batch shape, never made again) unless it follows the batch's documents ("flops", "adaptive") or is "adaptive"
lengths the offloader has not settled yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from lightning_sppo.documents import Documents
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.parallel.dims import ParallelDims
from lightning_sppo.partition import DOCUMENT_AWARE_POLICIES, auto_num_subsequences, split_sequence
from lightning_sppo.step_plan.agree import LengthChoice, SharedLengths
from lightning_sppo.step_plan.plan import StepPlan, StepSettings

__all__ = ["LAYER_CHUNK_TOKENS", "StepPlans", "SubsequencePlanner", "decide_cut", "plan_batch"]

LAYER_CHUNK_TOKENS = 16384
"""Tokens per chunk and sequence-parallel rank of order="layer" under num_subsequences="auto": long enough for the
kernels' efficiency (a chunk of the whole sequence holds ``sequence_parallel`` times as many)."""

Choose = Callable[[int, int, int], tuple[int, str, int]]
"""(seq_len, rows, granularity) -> (N, partition policy, granularity): the planner's choice for a batch."""
Settled = Callable[[int, int, int], bool]
"""(seq_len, N, granularity) -> whether "adaptive" lengths stay the same from now on (``Offloader.partition_settled``)."""


class SubsequencePlanner(Protocol):
    """What ``StepPlans`` asks under num_subsequences="auto" (``strategy.autoplan.AutoPlanner``)."""

    def subsequences(
        self, model: nn.Module, seq_len: int, batch: int, dims: ParallelDims, device: torch.device, granularity: int
    ) -> tuple[int, str, int]: ...


def decide_cut(
    seq_len: int,
    rows: int,
    settings: StepSettings,
    config: GPTConfig | None,
    documents: Documents | None = None,
    planner: Choose | None = None,
    settled: Settled | None = None,
) -> LengthChoice:
    """The lengths a micro-batch of ``rows`` x ``seq_len`` tokens (of these ``documents``) is cut into, and whether
    the same batch shape will be cut the same way from now on (module docstring)."""
    n, policy, granularity = settings.num_subsequences, settings.partition, settings.granularity
    if n == "auto" and settings.order == "layer":
        n = auto_num_subsequences(seq_len, granularity, LAYER_CHUNK_TOKENS * settings.sequence_parallel)
    elif n == "auto" and planner is not None:
        n, policy, granularity = planner(seq_len, rows, granularity)
    elif n == "auto":
        n = auto_num_subsequences(seq_len, granularity)
    lengths = split_sequence(seq_len, n, policy, granularity=granularity, config=config, documents=documents)
    if documents is not None and policy in DOCUMENT_AWARE_POLICIES:
        return LengthChoice(lengths, final=False)  # the next batch's documents cut it differently
    return LengthChoice(lengths, policy != "adaptive" or settled is None or settled(seq_len, n, granularity))


def plan_batch(
    settings: StepSettings,
    config: GPTConfig | None,
    input_ids: Tensor,
    document_ids: Tensor | Documents | None = None,
    plan: StepPlan | None = None,
) -> StepPlan:
    """The plan an engine runs a batch on: ``plan``, checked against the batch and the engine's order, or, given
    none, one made on this process alone from the engine's ``settings`` (no planner, no other rank)."""
    if plan is None:
        documents = _documents(document_ids, input_ids.device)
        rows, seq_len = input_ids.shape
        plan = settings.plan(decide_cut(seq_len, rows, settings, config, documents).lengths, documents)
    elif document_ids is not None:
        raise ValueError("Give the documents in the plan (StepPlan.documents) or as document_ids, not both.")
    plan.check(input_ids, settings.order)
    return plan


class StepPlans:
    """Every step's ``StepPlan`` in a run: the cut decided on rank 0 (``decide_cut``, with ``planner`` under
    num_subsequences="auto" and the offloader's ``settled``), sent to every rank, and kept per batch shape once
    final. Every rank calls ``plan`` at the same step with the same batch shape (a pipeline needs that anyway)."""

    def __init__(
        self,
        settings: StepSettings,
        dims: ParallelDims,
        planner: SubsequencePlanner | None = None,
        settled: Settled | None = None,
    ) -> None:
        self.settings, self.dims, self.planner, self.settled = settings, dims, planner, settled
        self.shared = SharedLengths()

    def plan(self, model: nn.Module, input_ids: Tensor, document_ids: Tensor | Documents | None = None) -> StepPlan:
        """This batch's plan (``model``: the whole GPT, or the stage's part of it, whose config sizes the cut)."""
        rows, seq_len = input_ids.shape
        m, sp = self.settings.num_microbatches, self.settings.sequence_parallel
        if rows % m:
            raise ValueError(
                f"The batch of {rows} sequences does not split into num_microbatches={m};"
                " use a batch size that is a multiple of it."
            )
        if seq_len % sp:
            raise ValueError(
                f"With sequence_parallel={sp} every subsequence is split over {sp} ranks: the sequence length"
                f" {seq_len} must be a multiple of {sp}."
            )
        documents = _documents(document_ids, input_ids.device)
        device, planner = input_ids.device, self.planner
        choose = None if planner is None else lambda s, b, g: planner.subsequences(model, s, b, self.dims, device, g)

        def cut() -> LengthChoice:  # on rank 0 only: with documents, rank 0's batch cuts every rank's
            return decide_cut(seq_len, rows // m, self.settings, model.config, documents, choose, self.settled)

        lengths = self.shared.decide((seq_len, rows // m), cut, device, documents=documents is not None)
        return self.settings.plan(lengths, documents)


def _documents(document_ids: Tensor | Documents | None, device: torch.device) -> Documents | None:
    """The batch's ``Documents`` (built from ``document_ids``, or passed through when already built)."""
    if document_ids is None or isinstance(document_ids, Documents):
        return document_ids
    return Documents.from_ids(document_ids, device)
