"""Model FLOPs per trained token and the devices' peak FLOP/s: what MFU divides.

MFU = model FLOPs of the tokens trained per second / (peak FLOP/s of one device x devices). Model FLOPs count
forward + backward as 3x the forward and no recomputation (``planner.flops``: matmuls 2 P per token and layer,
the output head 2 V D, embedding lookups free). Two conventions differ only in attention, per layer and token of
an S-token sequence:

- ``"causal"`` (``perf/mfu``): the query-key pairs a causal kernel computes, S^2 / 2 of the square: 6 S H Dh
  for training. The planner's count, so ``perf/mfu`` compares with ``sppo-plan``'s MFU.
- ``"full"`` (``perf/mfu_full_attention``): the whole S x S square, 12 S H Dh, as torchtitan, Megatron-LM and
  the PaLM paper (appendix B) count it. At long sequences attention dominates: GPT-7B at 1M tokens reads
  1.95x higher under this convention.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_sppo.model import GPTConfig
from lightning_sppo.planner.flops import attention_flops, sequence_model_flops

__all__ = [
    "ATTENTION_CONVENTIONS",
    "AttentionConvention",
    "batch_training_flops",
    "peak_flops_per_second",
    "training_flops_per_token",
]

AttentionConvention = Literal["causal", "full"]
ATTENTION_CONVENTIONS: tuple[AttentionConvention, ...] = ("causal", "full")

# Dense bf16 peaks. H200's datasheet "3958 TFLOPS" (and Lightning's Throughput table) is the sparse figure.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def training_flops_per_token(config: GPTConfig, seq_len: int, attention: AttentionConvention = "causal") -> float:
    """Model FLOPs of training one token of a ``seq_len``-token sequence, attention counted per ``attention``.

    ``"causal"``: 6 (L P_block + V D) + 6 L S H Dh; ``"full"``: 6 (L P_block + V D) + 12 L S H Dh.
    """
    if attention not in ATTENTION_CONVENTIONS:
        raise ValueError(f"attention must be one of {list(ATTENTION_CONVENTIONS)}, got attention={attention!r}.")
    causal = sequence_model_flops(config, [seq_len]) / seq_len
    if attention == "causal":
        return causal
    masked_half = 3.0 * config.n_layer * attention_flops(config, seq_len, 0) / seq_len  # the other S^2 / 2 pairs
    return causal + masked_half


def batch_training_flops(
    config: GPTConfig, input_ids: Tensor, document_ids: Tensor | None = None, attention: AttentionConvention = "causal"
) -> float:
    """Model FLOPs of training one batch [B, S], attention counted per ``attention`` and, with packed
    ``document_ids``, inside each document only (the work the masked kernels do): a document of n tokens counts
    n^2 / 2 query-key pairs ("causal") or n^2 ("full") instead of the sequence's."""
    batch, seq_len = input_ids.shape
    per_token = training_flops_per_token(config, seq_len, attention)
    if document_ids is None:
        return batch * seq_len * per_token
    share = 0.5 if attention == "causal" else 1.0  # of the square of query-key pairs
    pairs = share * sum(float((counts.double() ** 2).sum()) for counts in _document_lengths(document_ids))
    sequence_pairs = share * batch * float(seq_len) ** 2  # what per_token counts
    per_pair = 3.0 * config.n_layer * 4.0 * config.n_head * config.head_size  # 4 H Dh forward (planner.flops), x3
    return batch * seq_len * per_token - (sequence_pairs - pairs) * per_pair


def _document_lengths(document_ids: Tensor) -> list[Tensor]:
    """Per row, the lengths of its documents (runs of equal ids)."""
    ids = document_ids.detach().cpu()
    return [torch.unique_consecutive(row, return_counts=True)[1] for row in ids]


def peak_flops_per_second(device: torch.device) -> float | None:
    """Dense bf16 peak of a CUDA device, or None where unknown (CPU, other GPUs): MFU is then not reported
    unless ``SPPOMetrics(peak_flops=...)`` gives it."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_BF16.items() if key in name), None)
