"""Language-model loss computed in token chunks, so no fp32 [S, vocab] logits tensor ever exists."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy", "default_chunk_tokens"]

IGNORE_INDEX = -100
_CHUNK_ELEMENTS = 2**25  # fp32 logits per chunk: 128 MiB


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per loss chunk so that one chunk's fp32 logits stay near 128 MiB."""
    return max(1, _CHUNK_ELEMENTS // vocab_size)


def _chunk_loss_sum(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    logits = F.linear(hidden, weight).float()  # [c, V]
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, normalizer: Tensor | float, chunk_tokens: int | None = None
) -> Tensor:
    """sum over valid targets of CE(hidden @ weight.T, targets) / normalizer.

    hidden [B, S, D], weight [V, D], targets [B, S] (``IGNORE_INDEX`` skipped). Each chunk's logits are
    recomputed in backward (activation checkpointing), so only ``hidden`` is kept for backward.
    """
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [B*S, D]
    flat_targets = targets.reshape(-1).long()  # int32 ids (a token file's) too: cross_entropy takes int64 only
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_targets.numel(), chunk):
        rows = slice(start, start + chunk)
        total = total + checkpoint(_chunk_loss_sum, flat_hidden[rows], weight, flat_targets[rows], use_reentrant=False)
    return total / normalizer
