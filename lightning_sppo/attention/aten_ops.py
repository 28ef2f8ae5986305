"""PyTorch's fused attention ops (ATen) in the kernel interface's conventions: what ``kernels.SDPAKernel`` and
``kernels.CudnnKernel`` run.

Shape legend: B batch, H query heads, G K/V groups (G divides H), Sq queries, Sk keys, Dh head size.

Each op pair takes q [B, H, Sq, Dh], k, v [B, G, Sk, Dh] in its ``layouts`` (``attention.layouts``: the kernel
boundary has made every role canonical before an op sees it) and returns out [B, H, Sq, Dh] and the log-sum-exp
[B, H, Sq] in them, whatever the op's own conventions (padded or trailing log-sum-exp dimensions, varlen forms,
K/V groups expanded where an op cannot read them).

* ``CpuFlashOp``: ``_scaled_dot_product_flash_attention_for_cpu``, any float dtype, documents one call per piece;
* ``CudaFlashOp``: ATen's flash op (fp16/bf16), documents through its varlen entry points;
* ``CudaEfficientOp``: ATen's memory-efficient op (fp32 on CUDA), documents one call per piece;
* ``CudnnOp``: ATen's cuDNN attention pair (fp16/bf16; ``attention.cudnn`` says what is checked).

``fused_op`` picks the pair for a device and dtype (the cuDNN pair is chosen by the kernel, per call).
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sppo.attention import cudnn
from lightning_sppo.attention.cudnn import CudnnFeatures
from lightning_sppo.attention.layouts import CPU_LAYOUTS, KERNEL_LAYOUTS, RoleLayouts, canonical, empty_in
from lightning_sppo.documents import Pieces

__all__ = [
    "CPU_FLASH",
    "CUDA_EFFICIENT",
    "CUDA_FLASH",
    "HALF_DTYPES",
    "CpuFlashOp",
    "CudaEfficientOp",
    "CudaFlashOp",
    "CudnnOp",
    "FusedOp",
    "accumulation_dtype",
    "check_pieces",
    "cpu_flash_takes_groups",
    "expand_groups",
    "fused_op",
    "lse_end_to_end",
    "rows_apart",
    "sum_groups",
    "sum_groups_in",
    "varlen_lse",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, the dtype itself when already fp32/fp64: partial results never merge in bf16."""
    return torch.promote_types(dtype, torch.float32)


def expand_groups(x: Tensor, n_head: int) -> Tensor:
    """[B, G, S, Dh] -> [B, H, S, Dh] by repeating each K/V group for its query heads."""
    groups = x.shape[1]
    return x if groups == n_head else x.repeat_interleave(n_head // groups, dim=1)


def sum_groups(dx: Tensor, groups: int) -> Tensor:
    """[B, H, S, Dh] -> [B, G, S, Dh]: the gradient of ``expand_groups``."""
    B, H, S, Dh = dx.shape
    return dx if H == groups else dx.view(B, groups, H // groups, S, Dh).sum(dim=2)


def sum_groups_in(dx: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """``sum_groups`` accumulated in fp32 (or wider), returned in ``dtype``; no round trip when H == G."""
    if dx.shape[1] == groups:
        return dx.to(dtype)
    return sum_groups(dx.to(accumulation_dtype(dx.dtype)), groups).to(dtype)


def check_pieces(pieces: Pieces, q: Tensor, k: Tensor, causal: bool) -> None:
    """Pieces describe block-diagonal *causal* attention of a square call over every row."""
    B, _, Sq, _ = q.shape
    if not causal or Sq != k.shape[2] or Sq != pieces.length or B != len(pieces.bounds):
        raise ValueError(
            f"pieces of {len(pieces.bounds)} rows x {pieces.length} tokens describe square causal attention, but the"
            f" call has causal={causal}, {B} rows, {Sq} queries and {k.shape[2]} keys."
        )


def _rows_end_to_end(x: Tensor) -> Tensor:
    """[B, heads, S, Dh] -> [B * S, heads, Dh], the varlen layout (a view when the strides allow, e.g. B = 1)."""
    B, heads, S, Dh = x.shape
    return x.transpose(1, 2).reshape(B * S, heads, Dh)


def rows_apart(x: Tensor, B: int) -> Tensor:
    """The inverse of ``_rows_end_to_end``: [B * S, heads, Dh] -> [B, heads, S, Dh] (a view)."""
    total, heads, Dh = x.shape
    return x.view(B, total // B, heads, Dh).transpose(1, 2)


def varlen_lse(lse: Tensor, B: int) -> Tensor:
    """A varlen call's log-sum-exp [H, B * S] as [B, H, S] (a view)."""
    H, total = lse.shape
    return lse.view(H, B, total // B).transpose(0, 1)


def lse_end_to_end(lse: Tensor) -> Tensor:
    """[B, H, S] -> the dense [H, B * S] a varlen backward reads."""
    B, H, S = lse.shape
    return lse.transpose(0, 1).reshape(H, B * S).contiguous()


# -- PyTorch's fused kernels ------------------------------------------------------------------------


class FusedOp(Protocol):
    """One ATen attention op pair, called in the kernel interface's layout and conventions; ``pieces_*`` run the
    block-diagonal causal attention of packed documents. ``layouts``: the roles' layouts it takes and returns."""

    layouts: RoleLayouts

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...

    def pieces_forward(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, pieces: Pieces
    ) -> tuple[Tensor, Tensor]: ...

    def pieces_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, pieces: Pieces
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class _PieceByPiece:
    """The ``pieces_*`` of an op without a usable varlen form: block-diagonal causal attention as one dense causal
    call per piece (CPU, and fp32 on CUDA)."""

    layouts: RoleLayouts

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def pieces_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, pieces: Pieces) -> tuple[Tensor, Tensor]:
        """Each piece's result copied into out and lse laid out as the op's own (``torch.cat`` would lay them out
        otherwise)."""
        check_pieces(pieces, q, k, True)
        B, H, S, _ = q.shape
        out = empty_in((B, H, S, v.shape[3]), self.layouts.out, dtype=q.dtype, device=q.device)
        lse = None
        for row, bounds in enumerate(pieces.bounds):
            for a, e in zip(bounds, bounds[1:], strict=False):
                out_p, lse_p = self.forward(*(x[row : row + 1, :, a:e] for x in (q, k, v)), True, scale)
                if lse is None:
                    lse = empty_in((B, H, S), self.layouts.lse, dtype=lse_p.dtype, device=q.device)
                out[row : row + 1, :, a:e].copy_(out_p)
                lse[row : row + 1, :, a:e].copy_(lse_p)
        return out, lse

    def pieces_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, pieces: Pieces
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One dense causal backward per piece (each piece's keys are its queries, so every gradient is the pieces'
        gradients laid end to end)."""
        check_pieces(pieces, q, k, True)
        rows = []
        for row, bounds in enumerate(pieces.bounds):
            parts = [
                self.backward(*(x[row : row + 1, :, a:e] for x in (dout, q, k, v, out, lse)), True, scale)
                for a, e in zip(bounds, bounds[1:], strict=False)
            ]
            rows.append([torch.cat(grads, dim=2) for grads in zip(*parts, strict=True)])
        return tuple(torch.cat(grads) for grads in zip(*rows, strict=True))


class CpuFlashOp(_PieceByPiece):
    """``_scaled_dot_product_flash_attention_for_cpu``: fp32/fp64/bf16/fp16; K/V unexpanded where the op takes GQA.

    The op has no varlen form: documents run one call per piece (``pieces_forward``)."""

    layouts = CPU_LAYOUTS

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if not cpu_flash_takes_groups():
            k, v = expand_groups(k, q.shape[1]), expand_groups(v, q.shape[1])
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        H, G = q.shape[1], k.shape[1]
        native = cpu_flash_takes_groups()
        ke, ve = (k, v) if native else (expand_groups(k, H), expand_groups(v, H))
        # dout, out and lse in the op's own layouts (CPU_LAYOUTS): no copies the plain model's autograd lacks.
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal, scale=scale
        )
        if native:
            return dq, dk, dv
        return dq, sum_groups_in(dk, G, k.dtype), sum_groups_in(dv, G, v.dtype)


@functools.cache
def cpu_flash_takes_groups() -> bool:
    """Whether this torch's CPU flash op reads G < H K/V groups itself (torch 2.13 does), by a tiny probe.

    Feature detection, not a version test: the probe checks the values (query head 1 must read group 0, as
    ``repeat_interleave`` would give it) and the gradient's shape, so an op that accepted the shapes but
    mapped the heads differently would count as not supporting it.
    """
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 3, 8, generator=gen) for n in (2, 1, 1))
    op, op_backward = (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
    )
    try:
        out, lse = op(q, k, v, 0.0, True, scale=0.3)
        want, _ = op(q, k.expand(1, 2, 3, 8).contiguous(), v.expand(1, 2, 3, 8).contiguous(), 0.0, True, scale=0.3)
        _, dk, _ = op_backward(torch.ones_like(out), q, k, v, out, lse, 0.0, True, scale=0.3)
    except RuntimeError:
        return False
    return torch.allclose(out, want) and dk.shape == k.shape


class CudaFlashOp:
    """ATen's flash op (FlashAttention-2 inside PyTorch): fp16/bf16, native GQA (H % G == 0).

    The op takes [B, heads, S, Dh] and transposes to [B, S, heads, Dh] itself; the K/V cache and the
    projections' outputs are already sequence-major, so those transposes are views and nothing is copied.
    The backward gets ``dout`` and ``out`` sequence-major (the kernel layout), which the op reads without a copy;
    the log-sum-exp must be a dense [B, H, Sq] (a slice of rows is made so).

    Documents: ``_flash_attention_forward``/``_backward``, the varlen entry points under the SDPA op, with
    ``cum_seq_q = cum_seq_k`` the pieces' boundaries over the rows laid end to end; their log-sum-exp is
    [H, B * Sq] (torch 2.3+; the meta functions say so), viewed as [B, H, Sq] for the merge.
    """

    layouts = KERNEL_LAYOUTS

    def pieces_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, pieces: Pieces) -> tuple[Tensor, Tensor]:
        check_pieces(pieces, q, k, True)
        cu, longest = pieces.cu_seqlens(q.device), pieces.max_length
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            *(_rows_end_to_end(x) for x in (q, k, v)), cu, cu, longest, longest, 0.0, True, False, scale=scale
        )
        if lse.shape != (q.shape[1], out.shape[0]):  # a shape, not a value: no device sync
            raise RuntimeError(
                f"ATen's varlen flash op returned a log-sum-exp of shape {tuple(lse.shape)}, expected [H, total] ="
                f" {(q.shape[1], out.shape[0])}; this torch is not supported for document masking in half precision"
                ' (use precision="32-true" or attention="flash_attn").'
            )
        return rows_apart(out, q.shape[0]), varlen_lse(lse, q.shape[0])

    def pieces_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, pieces: Pieces
    ) -> tuple[Tensor, Tensor, Tensor]:
        check_pieces(pieces, q, k, True)
        cu, longest = pieces.cu_seqlens(q.device), pieces.max_length
        no_rng = torch.empty(0, dtype=torch.uint64, device=q.device)
        grads = torch.ops.aten._flash_attention_backward(
            *(_rows_end_to_end(x) for x in (dout, q, k, v, out)), lse_end_to_end(lse), cu, cu, longest, longest,
            0.0, True, no_rng, no_rng, scale=scale,
        )  # fmt: skip
        return tuple(rows_apart(g, q.shape[0]) for g in grads)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        # Dense (not varlen) call: cum_seq_* are undefined, as the forward returns them; without dropout the
        # philox state is never read. With G < H the op sums each group's expanded dK/dV itself.
        no_rng = torch.empty(0, dtype=torch.uint64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng,
            scale=scale,
        )  # fmt: skip


class CudaEfficientOp(_PieceByPiece):
    """ATen's memory-efficient op for fp32 on CUDA: O(Sq + Sk) memory, log-sum-exp on request.

    Its log-sum-exp is padded to [B, H, ceil(Sq / 32) * 32] (the kernel's query tile): forward returns the
    [B, H, Sq] slice, backward re-pads the merged one. The op needs H == G, so K/V groups are expanded
    (fp32 is the correctness path; bf16-mixed is the fast one). Documents run one dense call per piece: the op's
    varlen form pads its log-sum-exp per piece ([P, H, max rounded up to 32]); bf16-mixed takes the varlen flash op.
    """

    TILE = 32
    layouts = KERNEL_LAYOUTS

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        H = q.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, expand_groups(k, H), expand_groups(v, H), None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]]

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        H, G, Sq = q.shape[1], k.shape[1], q.shape[2]
        padded = F.pad(lse, (0, math.ceil(Sq / self.TILE) * self.TILE - Sq))  # contiguous [B, H, Sq up to 32]
        # What the forward returns for the philox state without dropout (CPU scalars); never read then.
        seed, offset = torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, expand_groups(k, H), expand_groups(v, H), None, out, padded, seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return dq, sum_groups_in(dk, G, k.dtype), sum_groups_in(dv, G, v.dtype)


CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT = CpuFlashOp(), CudaFlashOp(), CudaEfficientOp()


class CudnnOp:
    """ATen's cuDNN attention op pair (fp16/bf16) in the kernel interface's conventions (``attention.cudnn``).

    ``features`` come from the self-probe: the op's log-sum-exp layout (converted to and from [B, H, Sq] both ways,
    so a merged log-sum-exp feeds the backward), and whether it reads G < H K/V groups itself (else K/V are
    expanded and dK/dV summed over each group in fp32). cuDNN reads any strides, so the K/V cache's sequence-major
    views pass as they are. The backward's graph cache is keyed by q, k, v (PyTorch 2.11: not by out, dout or the
    log-sum-exp, whose strides the graph bakes in), so out is made dense in its canonical layout (a copy only for the
    first queries of several rows, documents' prefix calls), dout gets ``out``'s strides (cuDNN before 9.5.1 assumes them equal too)
    and the log-sum-exp is contiguous: their strides follow from q's shape, and a cached graph always meets the
    strides it was built with. No dropout: the philox seed and offset are never read, ``cum_seq_*`` are undefined as
    the dense forward returns them. Documents take the flash op's varlen form.
    """

    layouts = KERNEL_LAYOUTS

    def __init__(self, features: CudnnFeatures) -> None:
        self.features = features

    def pieces_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, pieces: Pieces) -> tuple[Tensor, Tensor]:
        return CUDA_FLASH.pieces_forward(q, k, v, scale, pieces)

    def pieces_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, pieces: Pieces
    ) -> tuple[Tensor, Tensor, Tensor]:
        return CUDA_FLASH.pieces_backward(dout, q, k, v, out, lse, scale, pieces)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        forward, _ = cudnn.ops()
        ke, ve = self._groups(q, k, v)
        out, lse, *_ = forward(q, ke, ve, None, True, 0.0, causal, False, scale=scale)
        return out, cudnn.lse_from_op(lse, q.shape[2])

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        _, backward = cudnn.ops()
        ke, ve = self._groups(q, k, v)
        unread = torch.empty((), dtype=torch.int64, device=q.device)  # philox seed and offset: no dropout
        out = canonical(out, self.layouts.out, dense=True)
        dq, dk, dv = backward(
            _strides_of(dout, out), q, ke, ve, out, cudnn.lse_to_op(lse, self.features.lse), unread, unread, None,
            None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )  # fmt: skip
        if ke is k:
            return dq, dk, dv
        return dq, sum_groups_in(dk, k.shape[1], k.dtype), sum_groups_in(dv, v.shape[1], v.dtype)

    def _groups(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.features.groups or k.shape[1] == q.shape[1]:
            return k, v
        return expand_groups(k, q.shape[1]), expand_groups(v, q.shape[1])


def _strides_of(x: Tensor, like: Tensor) -> Tensor:
    """``x`` laid out with ``like``'s strides (``like`` dense): itself when they already agree, else one copy."""
    if x.stride() == like.stride():
        return x
    return torch.empty_strided(like.shape, like.stride(), dtype=x.dtype, device=x.device).copy_(x)


def fused_op(device: torch.device, dtype: torch.dtype) -> FusedOp:
    """The ATen op pair for a device and dtype; never the O(Sq x Sk) reference on CUDA."""
    if device.type != "cuda":
        return CPU_FLASH
    if dtype in HALF_DTYPES:
        return CUDA_FLASH
    if dtype == torch.float32:
        return CUDA_EFFICIENT
    raise ValueError(
        f"Attention on CUDA runs fused kernels for float16, bfloat16 and float32, got dtype={dtype}. Train with"
        ' precision="bf16-mixed" (fast) or "32-true", or pass attention="reference" to accept O(S x S_k) memory.'
    )
