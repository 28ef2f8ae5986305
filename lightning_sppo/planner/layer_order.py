"""Bytes of the layer order on one device (``order="layer"``, ``runtime/layer_major.py``), counted from the code.

Per token and layer, what the forward keeps for the backward (``kept_bytes_per_token``; D hidden, H heads, Dh head
size, r residual and c compute element bytes):

    "full"       r D                   the layer's input
    "selective"  r D + c H Dh + 4 H     also the attention output and its fp32 log-sum-exp

with ``offload="full"`` on host for every layer but the last (the device holds two layers' worth during the
backward: the running one and the next one arriving).

The running layer's working set in its backward, per token of the whole sequence (``working_bytes_per_token``):
the input gradient (r D: the incoming one, replaced chunk by chunk by the residual's share, then by the input
gradient), q and the attention's dout (2 c H Dh), the fp32 dq sums (4 H Dh), and under "full" the recomputed
output and log-sum-exp (c H Dh + 4 H).

K/V and dK/dV on the device (``kv_peak_bytes``), what ``LayerMajorEngine.meter`` measures: the cache's device
buffer of min(R, S) tokens (``kv_device_tokens`` R), plus the most of either
    forward   two chunks of ``kv_chunk_tokens`` of the prefix's host part streamed in (the one attended, the next);
    backward  for key chunk j: its host part fetched (and, when it straddles R, the whole chunk joined), the next
              chunk's host part arriving, and, when a later chunk reads it, its fp32 dK/dV sums.
"""

from __future__ import annotations

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.precision import PrecisionBytes

__all__ = ["kept_bytes_per_token", "kv_peak_bytes", "working_bytes_per_token"]

_FP32 = 4


def kept_bytes_per_token(config: GPTConfig, dtypes: PrecisionBytes, recompute: str) -> int:
    """What the forward keeps per token and layer for the backward (module docstring)."""
    kept = dtypes.residual * config.n_embd
    if recompute == "selective":
        kept += dtypes.compute * config.n_head * config.head_size + _FP32 * config.n_head
    return kept


def working_bytes_per_token(config: GPTConfig, dtypes: PrecisionBytes, recompute: str) -> int:
    """The running layer's working set in its backward, per token of the sequence (module docstring)."""
    heads = config.n_head * config.head_size
    working = dtypes.residual * config.n_embd + 2 * dtypes.compute * heads + _FP32 * heads
    if recompute == "full":
        working += dtypes.compute * heads + _FP32 * config.n_head
    return working


def kv_peak_bytes(
    config: GPTConfig,
    dtypes: PrecisionBytes,
    spans: list[tuple[int, int]],
    device_tokens: int | None,
    chunk_tokens: int,
    batch: int = 1,
) -> int:
    """The most K/V and dK/dV bytes on the device at once during a step (module docstring)."""
    seq_len = spans[-1][0] + spans[-1][1]
    R = seq_len if device_tokens is None else min(device_tokens, seq_len)
    per_token = 2 * batch * config.n_query_groups * config.head_size  # K and V elements of one token
    kv, sums = per_token * dtypes.compute, per_token * _FP32
    prefix_host = max(0, spans[-1][0] - R)  # the longest prefix's host part (the last chunk's)
    forward = min(prefix_host, 2 * chunk_tokens) * kv

    def host(offset: int, length: int) -> int:
        return max(0, offset + length - max(offset, R))

    backward = 0
    for j, (offset, length) in enumerate(spans):
        joined = length if offset < R < offset + length else 0
        arriving = host(*spans[j + 1]) if j + 1 < len(spans) else 0
        summed = length * sums if j + 1 < len(spans) else 0
        backward = max(backward, (host(offset, length) + joined + arriving) * kv + summed)
    return R * kv + max(forward, backward)
