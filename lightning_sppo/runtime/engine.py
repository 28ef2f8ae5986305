"""One batch as N subsequences through a model on one device: forward 0..N-1, backward N-1..0.

Each subsequence is a separate autograd graph. The graphs touch only through the K/V cache
(forward) and its gradient buffer (backward), which is why backward must run last subsequence first.

A step runs as its ``StepPlan`` says (``lightning_sppo.step_plan``): the subsequences, the K/V spill and the packed
documents, which every subsequence's forward is handed (positions and attention pieces, ``lightning_sppo.documents``).
Given no plan, the engine makes one from its own settings and the batch (``plan``).

``evaluate`` runs the forwards alone, without graphs: the K/V cache still fills subsequence by
subsequence, so a sequence is evaluated in the memory of one subsequence's activations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_sppo.attention import apply_subsequence_attention, select_kernel, subsequence_cores
from lightning_sppo.attention.kv_spill import DEFAULT_KV_CHUNK_TOKENS
from lightning_sppo.documents import Documents, check_document_ids
from lightning_sppo.loss import IGNORE_INDEX
from lightning_sppo.runtime.caches import CachePool
from lightning_sppo.runtime.hooks import SubsequenceHooks
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.step_plan import StepPlan, StepSettings, plan_batch

__all__ = ["StepState", "SubsequenceEngine", "check_batch", "check_token_ids", "count_targets"]


@dataclass
class StepState:
    """What one training step on one batch carries between its per-subsequence actions."""

    model: nn.Module
    stage: StageModule
    input_ids: Tensor
    targets: Tensor
    spans: list[tuple[int, int]]
    normalizer: Tensor
    losses: list[Tensor | None] = field(default_factory=list)
    documents: Documents | None = None


class SubsequenceEngine:
    """Runs forward and backward of a ``lightning_sppo.GPT`` one subsequence at a time.

    A step runs on the ``plan`` it is given; ``num_subsequences``, ``partition``, ``granularity`` and the K/V spill
    make the plan of a step given none (``plan``).

    Args:
        num_subsequences: N, or ``"auto"`` for subsequences of about 4K tokens.
        partition: ``"length"``, ``"flops"`` or ``"adaptive"`` (see ``lightning_sppo.partition``).
        attention: kernel backend: ``"auto"``, ``"sdpa"``, ``"flash_attn"``, ``"cudnn"`` or ``"reference"``.
        granularity: subsequence boundaries fall on multiples of this (kernel block, SP size).
        loss_chunk_tokens: tokens per loss chunk; ``None`` keeps one chunk's fp32 logits near 128 MiB.
        strict_order: check the forward/backward order in every layer's cache. Only experiments that
            demonstrate why the order matters turn it off.
        hooks: called around every subsequence's forward and backward (the activation offloader).
        kv_grad_dtype: dtype of the dK/dV accumulators (None: fp32; ``KVCache`` says what bf16 costs).
        kv_device_tokens: tokens of each layer's K/V and dK/dV kept on the device, the rest in host memory
            (None: all on the device). kv_chunk_tokens: tokens per chunk streamed back from host.
    """

    def __init__(
        self,
        num_subsequences: int | Literal["auto"] = 1,
        partition: str = "length",
        attention: str = "auto",
        granularity: int = 1,
        loss_chunk_tokens: int | None = None,
        strict_order: bool = True,
        hooks: SubsequenceHooks | None = None,
        kv_grad_dtype: torch.dtype | None = None,
        kv_device_tokens: int | None = None,
        kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS,
    ) -> None:
        self.settings = StepSettings(
            num_subsequences=num_subsequences, partition=partition, granularity=granularity,
            kv_device_tokens=kv_device_tokens, kv_chunk_tokens=kv_chunk_tokens,
        )  # fmt: skip
        self.attention = attention
        self.loss_chunk_tokens = loss_chunk_tokens
        self.strict_order = strict_order
        self.hooks = hooks
        self.kv_grad_dtype = kv_grad_dtype
        self._pool: CachePool | None = None

    def plan(self, input_ids: Tensor, config, document_ids: Tensor | Documents | None = None) -> StepPlan:
        """The plan of a batch run without one: this engine's settings (``lightning_sppo.step_plan.plan_batch``)."""
        return plan_batch(self.settings, config, input_ids, document_ids)

    # -- one step, as actions -----------------------------------------------------------------------

    def begin(
        self,
        model: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        document_ids: Tensor | Documents | None = None,
        plan: StepPlan | None = None,
    ) -> StepState:
        """Validate the batch against its plan (made here when none is given) and bind fresh K/V caches."""
        # Normalise by the valid targets of the whole batch, so N pieces sum to the plain mean loss.
        state = self._bind(model, input_ids, targets, count_targets(targets).clamp(min=1), document_ids, plan)
        if self.hooks is not None:
            self.hooks.begin_step(state.spans)
        return state

    def _bind(
        self,
        model: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        normalizer: Tensor,
        document_ids: Tensor | Documents | None = None,
        plan: StepPlan | None = None,
    ) -> StepState:
        check_batch(model, input_ids, targets, document_ids)
        plan = plan_batch(self.settings, model.config, input_ids, document_ids, plan)  # may refuse it: before binding
        cores = subsequence_cores(model) or apply_subsequence_attention(
            model, select_kernel(self.attention, input_ids.device)
        )
        pool = self._pool
        if pool is None or pool.cores != cores or pool.grad_dtype != self.kv_grad_dtype:
            pool = self._pool = CachePool(cores, self.kv_grad_dtype)  # allocation kept across steps from here on
        pool.use_spill(*plan.spill)
        spans = plan.spans
        pool.begin_step(plan.seq_len, strict=self.strict_order, last_offset=spans[-1][0])
        pool.bind(0)
        stage = StageModule(model, self.loss_chunk_tokens)
        return StepState(model, stage, input_ids, targets, spans, normalizer, [None] * len(spans), plan.documents)

    def forward(self, state: StepState, index: int) -> Tensor:
        """Forward of subsequence ``index``; returns its share of the loss (with its graph)."""
        offset, length = state.spans[index]
        rows = slice(offset, offset + length)
        key = (0, index)
        with self.hooks.forward_context(key) if self.hooks else nullcontext():
            loss = state.stage(
                state.input_ids[:, rows], offset, state.targets[:, rows], state.normalizer, state.documents
            )
        if self.hooks:
            self.hooks.after_forward(key)
        state.losses[index] = loss
        return loss

    def backward(self, state: StepState, index: int, backward: Callable[[Tensor], None] | None = None) -> Tensor:
        """Backward of subsequence ``index``; frees its graph. Returns the detached loss share."""
        loss = state.losses[index]
        if loss is None:
            raise RuntimeError(f"Backward of subsequence {index} before its forward.")
        if self.hooks:
            self.hooks.before_backward((0, index))
        (backward or Tensor.backward)(loss)
        state.losses[index] = None
        if self.hooks:
            self.hooks.after_backward((0, index))
        return loss.detach()

    def end(self, state: StepState) -> None:
        """Unbind the caches so the model runs plain full-sequence attention outside a step."""
        self._pool.unbind()
        if self.hooks is not None:
            self.hooks.end_step()

    # -- the whole step ---------------------------------------------------------------------------

    def forward_backward(
        self,
        model: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        document_ids: Tensor | Documents | None = None,
        *,
        plan: StepPlan | None = None,
        backward: Callable[[Tensor], None] | None = None,
        forward_context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> Tensor:
        """Forward 0..N-1, backward N-1..0; gradients land in ``.grad``. Returns the detached mean loss.

        ``document_ids`` [B, S] (integer, non-decreasing along each row) marks packed documents: each token
        attends only to its own document, positions restart per document (``lightning_sppo.documents``).
        ``plan``: how the step runs (its documents instead of ``document_ids``); None: this engine's ``plan``."""
        with self._step(model, input_ids, targets, document_ids, plan) as state:
            # One context around all forwards: autocast caches its low-precision weight copies until the
            # context exits, so entering it per subsequence would keep N copies alive until backward.
            with forward_context():
                for i in range(len(state.spans)):
                    self.forward(state, i)
            return sum(self.backward(state, i, backward) for i in reversed(range(len(state.spans))))

    def evaluate(
        self,
        model: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        document_ids: Tensor | Documents | None = None,
        *,
        plan: StepPlan | None = None,
        forward_context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> tuple[Tensor, Tensor]:
        """Forward-only pass over subsequences 0..N-1: ``(sum of the token losses, number of valid targets)``.

        No autograd graph, no dK/dV buffers and no saved activations (the offload hooks are not involved);
        the K/V cache fills as in training. The mean loss is ``sum / count``; both are fp32 scalars.
        """
        # inference_mode(False): Lightning may call this under inference mode, and K/V buffers allocated there
        # would become inference tensors that the next training step could not write into.
        with torch.inference_mode(False), torch.no_grad():
            one = torch.ones((), device=input_ids.device)
            state = self._bind(model, input_ids, targets, one, document_ids, plan)
            try:
                with forward_context():
                    total = sum(
                        state.stage(
                            input_ids[:, o : o + s], o, targets[:, o : o + s], state.normalizer, state.documents
                        ).float()
                        for o, s in state.spans
                    )
            finally:
                self._pool.unbind()
        return total, count_targets(targets)

    @contextmanager
    def _step(
        self, model: nn.Module, input_ids: Tensor, targets: Tensor, document_ids, plan: StepPlan | None
    ) -> Iterator[StepState]:
        state = self.begin(model, input_ids, targets, document_ids, plan)
        try:
            yield state
        finally:
            self.end(state)

    def cache_nbytes(self) -> int:
        """Device bytes the K/V caches and their gradient buffers hold now (level-1 activations). After a step's
        backward that is the K/V of [0, o_last): the last subsequence's K/V and every dK/dV are let go."""
        return self._pool.nbytes() if self._pool else 0

    def cache_peak_nbytes(self) -> int:
        """The most the K/V caches held during the last step, per layer K/V of the whole sequence plus the dK/dV
        accumulators of [0, o_last) (none at N = 1): what the planner counts as level 1."""
        return self._pool.peak_nbytes() if self._pool else 0

    def cache_host_nbytes(self) -> int:
        """Host bytes held by the K/V caches' spilled part (``kv_device_tokens``)."""
        return self._pool.host_nbytes() if self._pool else 0

    def release(self) -> None:
        """Free the K/V caches (they are allocated again by the next step)."""
        if self._pool is not None:
            self._pool.free_memory()


def count_targets(targets: Tensor) -> Tensor:
    """Valid (not ignored) targets of a batch, as an fp32 scalar."""
    return (targets != IGNORE_INDEX).sum().to(torch.float32)


def check_token_ids(vocab_size: int, input_ids: Tensor, targets: Tensor) -> None:
    """Ids outside the vocabulary, as one error naming ``vocab_size``: the embedding and the loss would otherwise
    fail deep inside (on a GPU, a device-side assert that ends the process). One synchronisation per step."""
    if input_ids.numel() == 0:
        return
    kept = targets.masked_fill(targets == IGNORE_INDEX, 0)
    bounds = [bound.to(torch.int64) for bound in (*torch.aminmax(input_ids), *torch.aminmax(kept))]
    lowest, highest, lowest_target, highest_target = torch.stack(bounds).tolist()
    if lowest < 0 or highest >= vocab_size:
        bad = lowest if lowest < 0 else highest
        raise ValueError(
            f"input_ids hold token id {bad}, outside the model's vocabulary [0, vocab_size={vocab_size}): the data's"
            " tokenizer and the model must agree (GPTConfig.vocab_size, or data prepared with the model's tokenizer)."
        )
    if lowest_target < 0 or highest_target >= vocab_size:
        bad = lowest_target if lowest_target < 0 else highest_target
        raise ValueError(
            f"targets hold {bad}: a target is a token id in [0, vocab_size={vocab_size}) or {IGNORE_INDEX} (no loss)."
        )


def check_batch(
    model: nn.Module,
    input_ids: Tensor,
    targets: Tensor,
    document_ids: Tensor | Documents | None = None,
    token_ids: bool = False,
) -> None:
    """Errors for a batch the model cannot take, naming what to change; with ``token_ids`` its ids against the
    vocabulary too (``check_token_ids``: one synchronisation, which a strategy spends before it plans the step)."""
    if not (hasattr(model, "hidden_states") and hasattr(model, "lm_head") and hasattr(model, "config")):
        raise TypeError(
            f"Subsequence training needs a lightning_sppo.GPT (hidden_states, lm_head, config), got"
            f" {type(model).__name__}."
        )
    for name, value in (("input_ids", input_ids), ("targets", targets)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be an integer tensor [batch, seq_len], got {type(value).__name__}.")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"input_ids must be an integer tensor [batch, seq_len], got shape {tuple(input_ids.shape)}"
            f" and dtype {input_ids.dtype}."
        )
    if input_ids.shape[0] == 0:
        raise ValueError(
            f"The batch holds no sequence (input_ids of shape {tuple(input_ids.shape)}): give every step at least one"
            " row (a data loader with batch_size >= 1)."
        )
    if targets.shape != input_ids.shape:
        raise ValueError(
            f"targets must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(targets.shape)}."
            " Shift the targets yourself (targets[:, t] is the token after input_ids[:, t]) and pad with -100."
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must hold integer token ids (or -100), got dtype {targets.dtype}.")
    block_size = model.config.block_size
    if input_ids.shape[1] > block_size:
        raise ValueError(
            f"The sequence has {input_ids.shape[1]} tokens but the model's block_size={block_size};"
            " raise GPTConfig.block_size or shorten the sequence."
        )
    if isinstance(document_ids, Documents):
        if document_ids.shape != tuple(input_ids.shape):
            raise ValueError(
                f"document_ids must describe input_ids {tuple(input_ids.shape)}, got documents of {document_ids.shape}."
            )
    elif document_ids is not None:
        check_document_ids(document_ids, tuple(input_ids.shape), ordered=False)  # the order: Documents.from_ids
    if token_ids:
        check_token_ids(model.config.vocab_size, input_ids, targets)
