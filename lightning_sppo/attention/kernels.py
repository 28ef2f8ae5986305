"""Attention kernel backends with an explicit forward/backward that exposes the log-sum-exp.

Every backend computes, for q [B, H, Sq, Dh] against k, v [B, G, Sk, Dh] (G divides H; query head h
reads K/V group h // (H // G)):

* ``forward(q, k, v, causal, scale) -> (out [B, H, Sq, Dh] in q's dtype, lse [B, H, Sq] in fp32 or wider)``
* ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` shaped like q, k, v.

``causal=True`` is only ever requested with Sq == Sk, where top-left and bottom-right alignment coincide;
the subsequence function handles the rectangular (prefix) part with ``causal=False``. ``backward`` takes
the *merged* ``out`` and ``lse`` of the whole row, so the gradients of each part are exact pieces of the
gradient of the full softmax.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Literal, Protocol

import torch
from torch import Tensor

__all__ = ["AttentionKernel", "KernelName", "ReferenceKernel", "SDPAKernel", "FlashAttnKernel", "select_kernel"]

KernelName = Literal["auto", "reference", "sdpa", "flash_attn"]
KERNEL_NAMES: tuple[str, ...] = ("auto", "reference", "sdpa", "flash_attn")


class AttentionKernel(Protocol):
    name: str

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, the dtype itself when already fp32/fp64: partial results never merge in bf16."""
    return torch.promote_types(dtype, torch.float32)


def _expand_groups(x: Tensor, n_head: int) -> Tensor:
    """[B, G, S, Dh] -> [B, H, S, Dh] by repeating each K/V group for its query heads."""
    groups = x.shape[1]
    return x if groups == n_head else x.repeat_interleave(n_head // groups, dim=1)


def _sum_groups(dx: Tensor, groups: int) -> Tensor:
    """[B, H, S, Dh] -> [B, G, S, Dh]: the gradient of ``_expand_groups``."""
    B, H, S, Dh = dx.shape
    return dx if H == groups else dx.view(B, groups, H // groups, S, Dh).sum(dim=2)


class ReferenceKernel:
    """Pure PyTorch, any device, any float dtype; math in fp32 (or fp64). Query blocks bound the score memory."""

    name = "reference"

    def __init__(self, block_q: int = 1024) -> None:
        self.block_q = block_q

    def _probs(self, q: Tensor, k: Tensor, lse: Tensor | None, causal: bool, scale: float, start: int):
        acc = accumulation_dtype(q.dtype)
        scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale  # [B, H, bq, Sk]
        if causal:
            rows = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
            cols = torch.arange(k.shape[2], device=q.device)[None, :]
            scores = scores.masked_fill(cols > rows, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse[..., None]), lse

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        H = q.shape[1]
        k, v = _expand_groups(k, H), _expand_groups(v, H)
        outs, lses = [], []
        for start in range(0, q.shape[2], self.block_q):
            qb = q[:, :, start : start + self.block_q]
            p, lse = self._probs(qb, k, None, causal, scale, start)
            outs.append((p @ v.to(p.dtype)).to(q.dtype))
            lses.append(lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        H, G = q.shape[1], k.shape[1]
        acc = accumulation_dtype(q.dtype)
        ke, ve = _expand_groups(k, H).to(acc), _expand_groups(v, H).to(acc)
        dq = torch.empty_like(q)
        dk = torch.zeros(ke.shape, dtype=acc, device=k.device)
        dv = torch.zeros(ve.shape, dtype=acc, device=v.device)
        for start in range(0, q.shape[2], self.block_q):
            rows = slice(start, start + self.block_q)
            p, _ = self._probs(q[:, :, rows], ke, lse[:, :, rows].to(acc), causal, scale, start)
            do = dout[:, :, rows].to(acc)
            delta = (do * out[:, :, rows].to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
            dv += p.transpose(-1, -2) @ do
            ds = p * (do @ ve.transpose(-1, -2) - delta)
            dq[:, :, rows] = ((ds @ ke) * scale).to(q.dtype)
            dk += (ds.transpose(-1, -2) @ q[:, :, rows].to(acc)) * scale
        return dq, _sum_groups(dk, G).to(k.dtype), _sum_groups(dv, G).to(v.dtype)


class SDPAKernel:
    """PyTorch's own flash kernels through their ATen ops, which return the log-sum-exp.

    CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (fp32/fp64/bf16/fp16). CUDA: the flash op, fp16/bf16
    only; other dtypes fall back to the reference kernel.
    """

    name = "sdpa"

    def __init__(self) -> None:
        self._fallback = ReferenceKernel()

    def _use_fallback(self, q: Tensor) -> bool:
        return q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if self._use_fallback(q):
            return self._fallback.forward(q, k, v, causal, scale)
        H = q.shape[1]
        k, v = _expand_groups(k, H), _expand_groups(v, H)
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        else:
            out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self._use_fallback(q):
            return self._fallback.backward(dout, q, k, v, out, lse, causal, scale)
        H, G = q.shape[1], k.shape[1]
        ke, ve = _expand_groups(k, H), _expand_groups(v, H)
        dout, out, lse = dout.contiguous(), out.contiguous(), lse.contiguous()
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, ke, ve, out, lse, 0.0, causal, scale=scale
            )
        else:
            # Dense (not varlen) call: cum_seq_* are undefined, as the forward returns them; without
            # dropout the philox state is never read.
            no_rng = torch.empty(0, dtype=torch.uint64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, ke, ve, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng, scale=scale
            )
        if H == G:  # nothing to sum: no fp32 round trip (it would copy the whole prefix's dK/dV twice)
            return dq, dk, dv
        acc = accumulation_dtype(k.dtype)
        return dq, _sum_groups(dk.to(acc), G).to(k.dtype), _sum_groups(dv.to(acc), G).to(v.dtype)


def _flash_layout(x: Tensor) -> Tensor:
    """[B, heads, S, Dh] -> [B, S, heads, Dh] for flash-attn, copying only when the last dimension is strided.

    flash-attn takes any batch, sequence and head strides; the K/V cache is stored sequence-major, so its
    prefixes pass through without a copy.
    """
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 else x.contiguous()


class FlashAttnKernel:
    """flash-attn 2 (``flash_attn_2_cuda``), native GQA, layout [B, S, heads, Dh] inside."""

    name = "flash_attn"

    def __init__(self) -> None:
        import flash_attn
        from flash_attn import flash_attn_interface as fai

        self._fai = fai
        major, minor = (int(x) for x in flash_attn.__version__.split(".")[:2])
        if (major, minor) < (2, 6):
            raise ImportError(f"flash-attn>=2.6 is required, found {flash_attn.__version__}.")
        # 2.7 split ``window_size`` into two arguments.
        takes_pair = "window_size_left" in inspect.signature(fai._flash_attn_forward).parameters
        self._window = dict(window_size_left=-1, window_size_right=-1) if takes_pair else dict(window_size=(-1, -1))
        self._fallback = SDPAKernel()  # fp32 inputs: flash-attn takes fp16/bf16 only

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if q.dtype not in (torch.float16, torch.bfloat16):
            return self._fallback.forward(q, k, v, causal, scale)
        qt, kt, vt = (_flash_layout(x) for x in (q, k, v))
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0, alibi_slopes=None,
                      return_softmax=False, **self._window)  # fmt: skip
        res = self._fai._flash_attn_forward(qt, kt, vt, **kwargs)
        # The return arity changed in 2.7: (out, lse, S_dmask, rng_state); 2.6 returned 8 values.
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return out.transpose(1, 2), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        if q.dtype not in (torch.float16, torch.bfloat16):
            return self._fallback.backward(dout, q, k, v, out, lse, causal, scale)
        qt, kt, vt, ot, dot = (_flash_layout(x) for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        # flash-attn overwrites dq/dk/dv (it does not add), so fresh buffers are required.
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0, alibi_slopes=None,
                      deterministic=False, rng_state=None, **self._window)  # fmt: skip
        self._fai._flash_attn_backward(dot, qt, kt, vt, ot, lse.contiguous(), dq, dk, dv, **kwargs)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def select_kernel(name: str, device: torch.device) -> AttentionKernel:
    """Resolve a backend name. ``"auto"``: flash-attn on CUDA when importable, else PyTorch's flash kernels."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"Unknown attention={name!r}; choose one of {list(KERNEL_NAMES)}.")
    if name == "auto":
        name = "flash_attn" if device.type == "cuda" and flash_attn_available() else "sdpa"
    if name == "flash_attn":
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError(
                "attention='flash_attn' needs a CUDA device and `pip install lightning-sppo[flash]`;"
                " use attention='sdpa' or 'auto'."
            )
        return FlashAttnKernel()
    return ReferenceKernel() if name == "reference" else SDPAKernel()
