"""Per-layer, device-resident K/V cache and its gradient cache (SPPO's level-1, "skeletal" activations).

One cache holds one micro-batch's sequence: K/V are written subsequence by subsequence in forward,
and the gradient buffers collect dK/dV contributions that later subsequences make to earlier ones.
The buffers are allocated once for the whole sequence and reused across steps (no per-subsequence cat).

Shape legend: B batch, G K/V groups, S sequence length, Dh head size.

Every buffer is a [B, G, S, Dh] view of [B, S, G, Dh] memory, the layout flash-attn takes. With one
sequence per micro-batch (B = 1) a prefix ``k[:, :, :o]`` transposed back to [B, o, G, Dh] is then
contiguous, so the kernel reads the cache in place instead of copying the whole prefix in every call.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_sppo.attention.kernels import accumulation_dtype

__all__ = ["KV_GRAD_DTYPES", "KVCache", "KVGradDtype"]

KVGradDtype = Literal["fp32", "bf16"]
KV_GRAD_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
"""The ``kv_grad_dtype`` setting: dK/dV accumulators in fp32 (None: fp32, or fp64 for fp64 K/V) or bf16."""


class KVCache:
    """K/V [B, G, S, Dh] in the compute dtype, dK/dV [B, G, S, Dh] in fp32 (allocated at the first backward).

    ``grad_dtype`` overrides the dK/dV dtype (``kv_grad_dtype="bf16"``: two bytes less per element, but the
    sums round in bf16, so their error grows with the number of subsequences; fp32 is exact to rounding).

    The buffers are allocated at the first ``write`` of a sequence, from the shape and dtype of the K/V
    that arrive (so autocast decides the dtype), and reused by later sequences of the same shape.

    ``strict`` enforces the contract that makes the gradients exact: forward writes subsequences
    left to right without gaps, and backward visits them in exactly the reverse order.
    """

    def __init__(self, seq_len: int, strict: bool = True, grad_dtype: torch.dtype | None = None) -> None:
        self.seq_len = seq_len
        self.strict = strict
        self.grad_dtype = grad_dtype
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self._dk: Tensor | None = None
        self._dv: Tensor | None = None
        self.spans: list[tuple[int, int]] = []  # (offset, length) in forward order
        self._backward_done = 0

    @property
    def filled(self) -> int:
        """Tokens written so far."""
        return self.spans[-1][0] + self.spans[-1][1] if self.spans else 0

    def reset(self, seq_len: int | None = None) -> None:
        """Start a new sequence: forget spans, zero the gradient buffers, keep the allocation if it fits."""
        if seq_len is not None and seq_len != self.seq_len:
            self.seq_len = seq_len
            self.release()
        self.spans.clear()
        self._backward_done = 0
        if self._dk is not None:
            self._dk.zero_()
            self._dv.zero_()

    def release(self) -> None:
        """Free the buffers (they are allocated again on the next write)."""
        self.k = self.v = self._dk = self._dv = None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self._dk, self._dv) if t is not None)

    def write(self, offset: int, k: Tensor, v: Tensor) -> None:
        """Store the K/V of the subsequence starting at ``offset`` (autograd does not see this copy)."""
        B, G, length, Dh = k.shape
        if self.strict and offset != self.filled:
            raise RuntimeError(
                f"K/V cache expects the subsequence at offset {self.filled} next, got offset={offset}:"
                " subsequences must run forward in order, without gaps."
            )
        if offset + length > self.seq_len:
            raise RuntimeError(f"Subsequence {offset}..{offset + length} overflows the cache of {self.seq_len}.")
        shape = (B, G, self.seq_len, Dh)
        if self.k is None or self.k.shape != shape or self.k.dtype != k.dtype or self.k.device != k.device:
            if self.spans:
                raise RuntimeError("K/V shape or dtype changed in the middle of a sequence.")
            self.release()
            self.k, self.v = _sequence_major(shape, k.dtype, k.device), _sequence_major(shape, v.dtype, v.device)
        self.k[:, :, offset : offset + length].copy_(k.detach())
        self.v[:, :, offset : offset + length].copy_(v.detach())
        self.spans.append((offset, length))

    def begin_backward(self, offset: int) -> None:
        """Check that the subsequence at ``offset`` is the latest one whose backward has not run yet."""
        if not self.strict:
            return
        index = len(self.spans) - 1 - self._backward_done
        expected = self.spans[index][0] if index >= 0 else None
        if offset != expected:
            raise RuntimeError(
                f"Subsequence backward out of order: expected offset {expected}, got offset={offset}."
                " Backward must run from the last subsequence to the first, or dK/dV of earlier"
                " subsequences would miss the contributions of later ones."
            )
        self._backward_done += 1

    def grad_buffers(self) -> tuple[Tensor, Tensor]:
        """dK/dV accumulators, allocated (zeroed) on first use so forward-only passes never pay for them."""
        if self._dk is None:
            dtype = self.grad_dtype or accumulation_dtype(self.k.dtype)
            self._dk = _sequence_major(self.k.shape, dtype, self.k.device).zero_()
            self._dv = _sequence_major(self.v.shape, dtype, self.v.device).zero_()
        return self._dk, self._dv


def _sequence_major(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised [B, G, S, Dh] tensor laid out as [B, S, G, Dh] in memory (module docstring)."""
    B, G, S, Dh = shape
    return torch.empty((B, S, G, Dh), dtype=dtype, device=device).transpose(1, 2)
