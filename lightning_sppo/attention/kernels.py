"""Attention kernel backends with an explicit forward/backward that exposes the log-sum-exp.

Shape legend: B batch, H query heads, G K/V groups (G divides H; query head h reads group h // (H // G)),
Sq queries, Sk keys, Dh head size.

Every backend computes, for q [B, H, Sq, Dh] against k, v [B, G, Sk, Dh]:

* ``forward(q, k, v, causal, scale, *, pieces=None) -> (out [B, H, Sq, Dh] in q's dtype, lse [B, H, Sq] in fp32
  or wider)``
* ``backward(dout, q, k, v, out, lse, causal, scale, *, pieces=None) -> (dq, dk, dv)`` shaped like q, k, v.

``causal=True`` is only ever requested with Sq == Sk, where top-left and bottom-right alignment coincide;
the subsequence function handles the rectangular (prefix) part with ``causal=False``. ``backward`` takes
the *merged* ``out`` and ``lse`` of the whole row, so the gradients of each part are exact pieces of the
gradient of the full softmax.

``pieces`` (packed documents, ``lightning_sppo.documents.Pieces``; only with ``causal=True``): the attention is
block-diagonal causal, each row cut into pieces that attend only within themselves (variable-length attention,
cu_seqlens style). How each backend runs it:

* ``reference``: an explicit mask (piece ids compared), in the same query blocks;
* ``sdpa`` on CPU, and fp32 on CUDA: one dense causal call per piece (the CPU op and the memory-efficient op);
* ``sdpa`` on CUDA in fp16/bf16: one varlen call of ATen's flash op (``_flash_attention_forward`` with
  ``cum_seq_q``/``cum_seq_k``; its log-sum-exp is [H, total tokens]);
* ``flash_attn``: ``_flash_attn_varlen_forward``/``_backward`` (log-sum-exp [H, total tokens] in 2.6 and 2.7+).

The varlen calls take the B rows laid end to end, [B * Sq, heads, Dh]: a view for B = 1 (and whenever the
strides allow), a copy otherwise.

Which kernel runs where:

* ``flash_attn``: flash-attn 2.6+ on CUDA (fp16/bf16, native GQA); fp32 goes to ``sdpa``; refused on CPU.
* ``sdpa`` on CUDA: ATen's flash op for fp16/bf16 (native GQA), ATen's memory-efficient op for fp32.
* ``sdpa`` on CPU: ATen's CPU flash op, any float dtype (native GQA where the op takes it).
* ``cudnn``: ATen's cuDNN attention op pair (``_scaled_dot_product_cudnn_attention`` and its backward, log-sum-exp
  on; ``attention.cudnn`` says what is checked) for every dense fp16/bf16 call on CUDA; documents take the flash
  op's varlen form, fp32 the memory-efficient op; refused off CUDA, or where its self-probe fails.
* ``auto`` on CUDA: flash-attn when it imports; else ``sdpa`` with cuDNN attention for exactly the calls PyTorch's
  own ``F.scaled_dot_product_attention`` would run on cuDNN (on Hopper with a recent cuDNN: all of them), once a
  tiny forward and backward of it agreed with the flash op (``cudnn_status``; one log line says why not).
* ``reference``: plain PyTorch, any device and dtype; for tests (on CUDA only when chosen explicitly).

No CUDA path falls back to the reference kernel: its fp32 scores are [B, H, 1024, Sk] per query block (16 GiB
at a 128K prefix and 32 heads). fp32 on CUDA runs the memory-efficient kernel, fp64 on CUDA is refused.

PyTorch's FA3 route (``torch.nn.attention.activate_flash_attention_impl("FA3")``, torch >= 2.9 with the FA3
package installed) re-registers the ATen flash ops, so the ``sdpa`` backend picks it up without changes.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from types import ModuleType
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sppo.attention import cudnn
from lightning_sppo.attention.cudnn import CudnnFeatures
from lightning_sppo.documents import Pieces

__all__ = [
    "AttentionKernel",
    "CudnnKernel",
    "FlashAttnKernel",
    "KernelName",
    "ReferenceKernel",
    "SDPAKernel",
    "cudnn_status",
    "flash_attn_status",
    "select_kernel",
]

log = logging.getLogger(__name__)

KernelName = Literal["auto", "reference", "sdpa", "flash_attn", "cudnn"]
KERNEL_NAMES: tuple[str, ...] = ("auto", "reference", "sdpa", "flash_attn", "cudnn")
HALF_DTYPES = (torch.float16, torch.bfloat16)
NOT_INSTALLED = "flash-attn is not installed"
FLASH_ATTN_FIX = (
    'install a flash-attn>=2.6 wheel built for this torch (`pip install -e ".[flash]"`, or'
    " `pip install flash-attn --no-build-isolation`), or use attention='auto' or 'sdpa'"
)


class AttentionKernel(Protocol):
    name: str

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, *, pieces: Pieces | None = None
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
        *,
        pieces: Pieces | None = None,
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


def _sum_groups_in(dx: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """``_sum_groups`` accumulated in fp32 (or wider), returned in ``dtype``; no round trip when H == G."""
    if dx.shape[1] == groups:
        return dx.to(dtype)
    return _sum_groups(dx.to(accumulation_dtype(dx.dtype)), groups).to(dtype)


class ReferenceKernel:
    """Pure PyTorch, any device, any float dtype; math in fp32 (or fp64). Query blocks bound the score memory.

    Only for tests and CPU checks: on CUDA it runs only when chosen explicitly (``attention="reference"``).
    """

    name = "reference"

    def __init__(self, block_q: int = 1024) -> None:
        self.block_q = block_q

    def _probs(
        self, q: Tensor, k: Tensor, lse: Tensor | None, causal: bool, scale: float, start: int, pieces: Tensor | None
    ):
        """Probabilities of the query block at ``start``; ``pieces``: [B, Sk] piece id of every token (or None)."""
        acc = accumulation_dtype(q.dtype)
        scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale  # [B, H, bq, Sk]
        if causal:
            rows = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
            cols = torch.arange(k.shape[2], device=q.device)[None, :]
            hidden = cols > rows  # [bq, Sk]
            if pieces is not None:  # other documents too: [B, 1, bq, Sk]
                hidden = (hidden | (pieces[:, start : start + q.shape[2], None] != pieces[:, None, :]))[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse[..., None]), lse

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, *, pieces: Pieces | None = None
    ) -> tuple[Tensor, Tensor]:
        H = q.shape[1]
        k, v = _expand_groups(k, H), _expand_groups(v, H)
        ids = _piece_ids(pieces, q, k, causal)
        outs, lses = [], []
        for start in range(0, q.shape[2], self.block_q):
            qb = q[:, :, start : start + self.block_q]
            p, lse = self._probs(qb, k, None, causal, scale, start, ids)
            outs.append((p @ v.to(p.dtype)).to(q.dtype))
            lses.append(lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
        *,
        pieces: Pieces | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        H, G = q.shape[1], k.shape[1]
        acc = accumulation_dtype(q.dtype)
        ke, ve = _expand_groups(k, H).to(acc), _expand_groups(v, H).to(acc)
        ids = _piece_ids(pieces, q, k, causal)
        dq = torch.empty_like(q)
        dk = torch.zeros(ke.shape, dtype=acc, device=k.device)
        dv = torch.zeros(ve.shape, dtype=acc, device=v.device)
        for start in range(0, q.shape[2], self.block_q):
            rows = slice(start, start + self.block_q)
            p, _ = self._probs(q[:, :, rows], ke, lse[:, :, rows].to(acc), causal, scale, start, ids)
            do = dout[:, :, rows].to(acc)
            delta = (do * out[:, :, rows].to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
            dv += p.transpose(-1, -2) @ do
            ds = p * (do @ ve.transpose(-1, -2) - delta)
            dq[:, :, rows] = ((ds @ ke) * scale).to(q.dtype)
            dk += (ds.transpose(-1, -2) @ q[:, :, rows].to(acc)) * scale
        return dq, _sum_groups(dk, G).to(k.dtype), _sum_groups(dv, G).to(v.dtype)


def _piece_ids(pieces: Pieces | None, q: Tensor, k: Tensor, causal: bool) -> Tensor | None:
    """[B, S] piece id of every token for the reference mask, after checking ``pieces`` fits the call."""
    if pieces is None:
        return None
    _check_pieces(pieces, q, k, causal)
    return pieces.segment_ids(q.device)


def _check_pieces(pieces: Pieces, q: Tensor, k: Tensor, causal: bool) -> None:
    """Pieces describe block-diagonal *causal* attention of a square call over every row."""
    B, _, Sq, _ = q.shape
    if not causal or Sq != k.shape[2] or Sq != pieces.length or B != len(pieces.bounds):
        raise ValueError(
            f"pieces of {len(pieces.bounds)} rows x {pieces.length} tokens describe square causal attention, but the"
            f" call has causal={causal}, {B} rows, {Sq} queries and {k.shape[2]} keys."
        )


def _each_piece_forward(dense: _FusedOp, q: Tensor, k: Tensor, v: Tensor, scale: float, pieces: Pieces):
    """Block-diagonal causal attention as one dense causal call per piece (CPU, and fp32 on CUDA)."""
    _check_pieces(pieces, q, k, True)
    outs, lses = [], []
    for row, bounds in enumerate(pieces.bounds):
        parts = [
            dense.forward(*(x[row : row + 1, :, a:e] for x in (q, k, v)), True, scale)
            for a, e in zip(bounds, bounds[1:], strict=False)
        ]
        outs.append(torch.cat([out for out, _ in parts], dim=2))
        lses.append(torch.cat([lse for _, lse in parts], dim=2))
    return torch.cat(outs), torch.cat(lses)


def _each_piece_backward(
    dense: _FusedOp, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
    pieces: Pieces,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of ``_each_piece_forward``, one dense causal backward per piece (each piece's keys are its
    queries, so every gradient is the pieces' gradients laid end to end)."""
    _check_pieces(pieces, q, k, True)
    rows = []
    for row, bounds in enumerate(pieces.bounds):
        parts = [
            dense.backward(*(x[row : row + 1, :, a:e] for x in (dout, q, k, v, out, lse)), True, scale)
            for a, e in zip(bounds, bounds[1:], strict=False)
        ]
        rows.append([torch.cat(grads, dim=2) for grads in zip(*parts, strict=True)])
    return tuple(torch.cat(grads) for grads in zip(*rows, strict=True))


def _rows_end_to_end(x: Tensor) -> Tensor:
    """[B, heads, S, Dh] -> [B * S, heads, Dh], the varlen layout (a view when the strides allow, e.g. B = 1)."""
    B, heads, S, Dh = x.shape
    return x.transpose(1, 2).reshape(B * S, heads, Dh)


def _rows_apart(x: Tensor, B: int) -> Tensor:
    """The inverse of ``_rows_end_to_end``: [B * S, heads, Dh] -> [B, heads, S, Dh] (a view)."""
    total, heads, Dh = x.shape
    return x.view(B, total // B, heads, Dh).transpose(1, 2)


def _varlen_lse(lse: Tensor, B: int) -> Tensor:
    """A varlen call's log-sum-exp [H, B * S] as [B, H, S] (a view)."""
    H, total = lse.shape
    return lse.view(H, B, total // B).transpose(0, 1)


def _lse_end_to_end(lse: Tensor) -> Tensor:
    """[B, H, S] -> the dense [H, B * S] a varlen backward reads."""
    B, H, S = lse.shape
    return lse.transpose(0, 1).reshape(H, B * S).contiguous()


# -- PyTorch's fused kernels ------------------------------------------------------------------------


class _FusedOp(Protocol):
    """One ATen attention op pair, called in the kernel interface's layout and conventions; ``pieces_*`` run the
    block-diagonal causal attention of packed documents."""

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


class _CpuFlash:
    """``_scaled_dot_product_flash_attention_for_cpu``: fp32/fp64/bf16/fp16; K/V unexpanded where the op takes GQA.

    The op has no varlen form: documents run one call per piece (``pieces_forward``)."""

    def pieces_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, pieces: Pieces) -> tuple[Tensor, Tensor]:
        return _each_piece_forward(self, q, k, v, scale, pieces)

    def pieces_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, pieces: Pieces
    ) -> tuple[Tensor, Tensor, Tensor]:
        return _each_piece_backward(self, dout, q, k, v, out, lse, scale, pieces)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if not cpu_flash_takes_groups():
            k, v = _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        H, G = q.shape[1], k.shape[1]
        native = cpu_flash_takes_groups()
        ke, ve = (k, v) if native else (_expand_groups(k, H), _expand_groups(v, H))
        # dout, out and lse as they come (the op reads any strides): no copies the plain model's autograd lacks.
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal, scale=scale
        )
        if native:
            return dq, dk, dv
        return dq, _sum_groups_in(dk, G, k.dtype), _sum_groups_in(dv, G, v.dtype)


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


class _CudaFlash:
    """ATen's flash op (FlashAttention-2 inside PyTorch): fp16/bf16, native GQA (H % G == 0).

    The op takes [B, heads, S, Dh] and transposes to [B, S, heads, Dh] itself; the K/V cache and the
    projections' outputs are already sequence-major, so those transposes are views and nothing is copied.
    The backward gets ``dout`` and ``out`` as they come (no ``.contiguous()``: the op makes its own
    sequence-major copy only when they are not sequence-major); the log-sum-exp must be a dense [B, H, Sq].

    Documents: ``_flash_attention_forward``/``_backward``, the varlen entry points under the SDPA op, with
    ``cum_seq_q = cum_seq_k`` the pieces' boundaries over the rows laid end to end; their log-sum-exp is
    [H, B * Sq] (torch 2.3+; the meta functions say so), viewed as [B, H, Sq] for the merge.
    """

    def pieces_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, pieces: Pieces) -> tuple[Tensor, Tensor]:
        _check_pieces(pieces, q, k, True)
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
        return _rows_apart(out, q.shape[0]), _varlen_lse(lse, q.shape[0])

    def pieces_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, pieces: Pieces
    ) -> tuple[Tensor, Tensor, Tensor]:
        _check_pieces(pieces, q, k, True)
        cu, longest = pieces.cu_seqlens(q.device), pieces.max_length
        no_rng = torch.empty(0, dtype=torch.uint64, device=q.device)
        grads = torch.ops.aten._flash_attention_backward(
            *(_rows_end_to_end(x) for x in (dout, q, k, v, out)), _lse_end_to_end(lse), cu, cu, longest, longest,
            0.0, True, no_rng, no_rng, scale=scale,
        )  # fmt: skip
        return tuple(_rows_apart(g, q.shape[0]) for g in grads)

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


class _CudaEfficient:
    """ATen's memory-efficient op for fp32 on CUDA: O(Sq + Sk) memory, log-sum-exp on request.

    Its log-sum-exp is padded to [B, H, ceil(Sq / 32) * 32] (the kernel's query tile): forward returns the
    [B, H, Sq] slice, backward re-pads the merged one. The op needs H == G, so K/V groups are expanded
    (fp32 is the correctness path; bf16-mixed is the fast one).
    """

    TILE = 32

    def pieces_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, pieces: Pieces) -> tuple[Tensor, Tensor]:
        # One dense call per piece: the op's varlen form pads its log-sum-exp per piece ([P, H, max rounded up to
        # 32]), and fp32 on CUDA is the correctness path; bf16-mixed takes the varlen flash op.
        return _each_piece_forward(self, q, k, v, scale, pieces)

    def pieces_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, pieces: Pieces
    ) -> tuple[Tensor, Tensor, Tensor]:
        return _each_piece_backward(self, dout, q, k, v, out, lse, scale, pieces)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        H = q.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand_groups(k, H), _expand_groups(v, H), None, True, 0.0, causal, scale=scale
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
            dout, q, _expand_groups(k, H), _expand_groups(v, H), None, out, padded, seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return dq, _sum_groups_in(dk, G, k.dtype), _sum_groups_in(dv, G, v.dtype)


_CPU_FLASH, _CUDA_FLASH, _CUDA_EFFICIENT = _CpuFlash(), _CudaFlash(), _CudaEfficient()


class _CudaCudnn:
    """ATen's cuDNN attention op pair (fp16/bf16) in the kernel interface's conventions (``attention.cudnn``).

    ``features`` come from the self-probe: the op's log-sum-exp layout (converted to and from [B, H, Sq] both ways,
    so a merged log-sum-exp feeds the backward), and whether it reads G < H K/V groups itself (else K/V are
    expanded and dK/dV summed over each group in fp32). cuDNN reads any strides, so the K/V cache's sequence-major
    views pass as they are; the backward gets ``dout`` with ``out``'s strides (cuDNN before 9.5.1 assumes them
    equal, and ATen would otherwise copy with a warning; at N = 1 they already match). No dropout: the philox
    seed and offset are never read, ``cum_seq_*`` are undefined as the dense forward returns them. Documents take
    the flash op's varlen form.
    """

    def __init__(self, features: CudnnFeatures) -> None:
        self.features = features

    def pieces_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, pieces: Pieces) -> tuple[Tensor, Tensor]:
        return _CUDA_FLASH.pieces_forward(q, k, v, scale, pieces)

    def pieces_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, pieces: Pieces
    ) -> tuple[Tensor, Tensor, Tensor]:
        return _CUDA_FLASH.pieces_backward(dout, q, k, v, out, lse, scale, pieces)

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
        dq, dk, dv = backward(
            _strides_of(dout, out), q, ke, ve, out, cudnn.lse_to_op(lse, self.features.lse), unread, unread, None,
            None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )  # fmt: skip
        if ke is k:
            return dq, dk, dv
        return dq, _sum_groups_in(dk, k.shape[1], k.dtype), _sum_groups_in(dv, v.shape[1], v.dtype)

    def _groups(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.features.groups or k.shape[1] == q.shape[1]:
            return k, v
        return _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])


def _strides_of(x: Tensor, like: Tensor) -> Tensor:
    """``x`` laid out with ``like``'s strides (``like`` dense): itself when they already agree, else one copy."""
    if x.stride() == like.stride():
        return x
    return torch.empty_strided(like.shape, like.stride(), dtype=x.dtype, device=x.device).copy_(x)


def fused_op(device: torch.device, dtype: torch.dtype) -> _FusedOp:
    """The ATen op pair for a device and dtype; never the O(Sq x Sk) reference on CUDA."""
    if device.type != "cuda":
        return _CPU_FLASH
    if dtype in HALF_DTYPES:
        return _CUDA_FLASH
    if dtype == torch.float32:
        return _CUDA_EFFICIENT
    raise ValueError(
        f"Attention on CUDA runs fused kernels for float16, bfloat16 and float32, got dtype={dtype}. Train with"
        ' precision="bf16-mixed" (fast) or "32-true", or pass attention="reference" to accept O(S x S_k) memory.'
    )


class SDPAKernel:
    """PyTorch's own fused kernels through their ATen ops, which return the log-sum-exp (see the module table).

    ``cudnn``: the cuDNN op pair, for the dense fp16/bf16 calls PyTorch's SDPA would run on cuDNN
    (``attention="auto"``; ``CudnnKernel`` takes it for all of them)."""

    name = "sdpa"

    def __init__(self, cudnn: _CudaCudnn | None = None) -> None:
        self._cudnn = cudnn
        if cudnn is not None:
            self.name = "sdpa+cudnn"

    def _op(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> _FusedOp:
        op = fused_op(q.device, q.dtype)
        if op is _CUDA_FLASH and self._cudnn is not None and self._takes_cudnn(q, k, v, causal, scale):
            return self._cudnn
        return op

    def _takes_cudnn(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> bool:
        return cudnn.torch_picks_cudnn(q, k, v, causal, scale)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, *, pieces: Pieces | None = None
    ) -> tuple[Tensor, Tensor]:
        op = self._op(q, k, v, causal, scale)
        if pieces is not None:
            _check_pieces(pieces, q, k, causal)
            return op.pieces_forward(q, k, v, scale, pieces)
        return op.forward(q, k, v, causal, scale)

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
        *,
        pieces: Pieces | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        op = self._op(q, k, v, causal, scale)
        if pieces is not None:
            _check_pieces(pieces, q, k, causal)
            return op.pieces_backward(dout, q, k, v, out, lse, scale, pieces)
        return op.backward(dout, q, k, v, out, lse, causal, scale)


class CudnnKernel(SDPAKernel):
    """``attention="cudnn"``: cuDNN attention for every dense fp16/bf16 call on CUDA (``SDPAKernel`` otherwise)."""

    def __init__(self, cudnn: _CudaCudnn) -> None:
        super().__init__(cudnn)
        self.name = "cudnn"

    def _takes_cudnn(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> bool:
        return True


# -- cuDNN attention: may it run, and does it agree with the flash op ---------------------------------------


NO_CUDNN_PROBE = "its self-probe against the flash op failed: "
"""How a reason that cuDNN attention cannot be trusted here begins (the others only say it is not picked)."""


def cudnn_status(device: torch.device) -> str | None:
    """None when ``attention="auto"`` uses cuDNN attention on ``device`` (PyTorch's SDPA would pick it for a training
    shape, and the self-probe passed), else why not."""
    index = _usable_index(device)
    if isinstance(index, str):
        return index
    picks = _torch_picks_cudnn_here(index)
    if picks is not True:
        return picks or f"PyTorch's SDPA does not pick it on this GPU (cuDNN {torch.backends.cudnn.version()})"
    probed = _cudnn_probe(index)
    return NO_CUDNN_PROBE + probed if isinstance(probed, str) else None


def _usable_index(device: torch.device) -> int | str:
    """The CUDA device's index, or why there is none."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA device"
    try:
        return _index(device)
    except Exception as error:  # noqa: BLE001 - CUDA reported but not usable: say so
        return f"no usable CUDA device ({type(error).__name__}: {error})"


@functools.cache
def _torch_picks_cudnn_here(index: int) -> bool | str:
    """Whether the SDPA dispatcher runs cuDNN for a bf16 causal training call of a 1B-class shape on this GPU (a
    string: asking failed, and why)."""
    try:
        q, k, v = (torch.empty(1, 8, 1024, 128, dtype=torch.bfloat16, device=f"cuda:{index}") for _ in range(3))
        return cudnn.torch_picks_cudnn(q, k, v, True, 128**-0.5)
    except Exception as error:  # noqa: BLE001 - any failure to ask means: not picked, say why
        return f"asking PyTorch's SDPA failed: {type(error).__name__}: {error}"


@functools.cache
def _cudnn_probe(index: int) -> CudnnFeatures | str:
    """The cuDNN op pair's features on this GPU, or why it cannot be used (cached: one probe per process)."""
    try:
        with torch.autocast("cuda", enabled=False), torch.inference_mode(False), torch.no_grad():
            return cudnn.probe(torch.device("cuda", index), _CudaCudnn, _CUDA_FLASH)
    except Exception as error:  # noqa: BLE001 - whatever fails (schema, GPU, cuDNN, numbers): fall back, say why
        return f"{type(error).__name__}: {error}"


# -- flash-attn -------------------------------------------------------------------------------------


def _flash_layout(x: Tensor) -> Tensor:
    """[B, heads, S, Dh] -> [B, S, heads, Dh] for flash-attn, copying only when the last dimension is strided.

    flash-attn takes any batch, sequence and head strides; the K/V cache is stored sequence-major, so its
    prefixes pass through without a copy.
    """
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 else x.contiguous()


def _version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ImportError(f"flash-attn reports an unreadable version {text!r}.")
    return int(match.group(1)), int(match.group(2))


def _load_flash_attn() -> tuple[ModuleType, tuple[int, int]]:
    """flash-attn's low-level interface and version, or ImportError saying why it cannot be used.

    A real import, not a package lookup: a wheel built against another torch is found but fails to load
    (``undefined symbol``), which must count as absent.
    """
    try:
        import flash_attn
        import flash_attn.flash_attn_interface as interface
    except ModuleNotFoundError as error:
        if error.name == "flash_attn":
            raise ImportError(NOT_INSTALLED) from error
        raise ImportError(f"import flash_attn.flash_attn_interface failed: {error}") from error
    except Exception as error:  # ImportError, OSError (undefined symbol), RuntimeError from CUDA init, ...
        raise ImportError(f"import flash_attn.flash_attn_interface failed: {type(error).__name__}: {error}") from error
    version = _version(getattr(flash_attn, "__version__", ""))
    if version < (2, 6):
        raise ImportError(f"flash-attn>=2.6 is required, found {flash_attn.__version__}")
    return interface, version


class FlashAttnKernel:
    """flash-attn 2 (2.6 and 2.7+), native GQA, layout [B, S, heads, Dh] inside.

    The low-level interface changed in 2.7, and is told apart by the package version (in 2.7+ the functions
    are ``torch.library`` custom ops whose Python signature is ``(*args, **kwargs)``, so it cannot be read):

    * 2.6: ``window_size=(left, right)``; forward returns 8 values, the log-sum-exp at index 5;
    * 2.7+: ``window_size_left``, ``window_size_right``; forward returns (out, lse, S_dmask, rng_state).

    The same holds for the varlen pair (``_flash_attn_varlen_forward``/``_backward``, which take
    ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k`` after q, k, v, and whose log-sum-exp
    is [H, total tokens]), used for packed documents. Both backwards overwrite dq/dk/dv (they do not add).
    ``deterministic`` follows ``torch.use_deterministic_algorithms``. fp32 inputs go to ``SDPAKernel``
    (flash-attn takes fp16/bf16 only).
    """

    name = "flash_attn"

    def __init__(self, interface: ModuleType | None = None, version: tuple[int, int] | None = None) -> None:
        if interface is None:
            interface, version = _load_flash_attn()
        elif version is None:
            raise ValueError("FlashAttnKernel(interface=...) needs the flash-attn version it belongs to, e.g. (2, 7).")
        self._fai = interface
        self.version = version
        split = version >= (2, 7)
        self._window = dict(window_size_left=-1, window_size_right=-1) if split else dict(window_size=(-1, -1))
        self._lse_index, self._arity = (1, 4) if split else (5, 8)
        self._fallback = SDPAKernel()

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, *, pieces: Pieces | None = None
    ) -> tuple[Tensor, Tensor]:
        if q.dtype not in HALF_DTYPES:
            return self._fallback.forward(q, k, v, causal, scale, pieces=pieces)
        qt, kt, vt = (_flash_layout(x) for x in (q, k, v))
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0, alibi_slopes=None,
                      return_softmax=False, **self._window)  # fmt: skip
        if pieces is None:
            res = self._checked(self._fai._flash_attn_forward(qt, kt, vt, **kwargs), "_flash_attn_forward")
            return res[0].transpose(1, 2), res[self._lse_index]
        _check_pieces(pieces, q, k, causal)
        B = q.shape[0]
        cu, longest = pieces.cu_seqlens(q.device), pieces.max_length
        flat = (x.reshape(-1, *x.shape[2:]) for x in (qt, kt, vt))  # [B * S, heads, Dh]
        res = self._fai._flash_attn_varlen_forward(*flat, cu, cu, longest, longest, **kwargs)
        res = self._checked(res, "_flash_attn_varlen_forward")
        return _rows_apart(res[0], B), _varlen_lse(res[self._lse_index], B)

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
        *,
        pieces: Pieces | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if q.dtype not in HALF_DTYPES:
            return self._fallback.backward(dout, q, k, v, out, lse, causal, scale, pieces=pieces)
        qt, kt, vt, ot, dot = (_flash_layout(x) for x in (q, k, v, out, dout))
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0, alibi_slopes=None,
                      deterministic=torch.are_deterministic_algorithms_enabled(), rng_state=None,
                      **self._window)  # fmt: skip
        if pieces is None:
            dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
            self._fai._flash_attn_backward(dot, qt, kt, vt, ot, lse.contiguous(), dq, dk, dv, **kwargs)
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        _check_pieces(pieces, q, k, causal)
        cu, longest = pieces.cu_seqlens(q.device), pieces.max_length
        dot, qt, kt, vt, ot = (x.reshape(-1, *x.shape[2:]) for x in (dot, qt, kt, vt, ot))  # [B * S, heads, Dh]
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        self._fai._flash_attn_varlen_backward(
            dot, qt, kt, vt, ot, _lse_end_to_end(lse), dq, dk, dv, cu, cu, longest, longest, **kwargs
        )
        return tuple(_rows_apart(x, q.shape[0]) for x in (dq, dk, dv))

    def _checked(self, res: tuple, function: str) -> tuple:
        if len(res) != self._arity:
            raise RuntimeError(
                f"flash-attn {self.version[0]}.{self.version[1]} returned {len(res)} values from"
                f" {function}, expected {self._arity}; this flash-attn version is not supported."
            )
        return res


def flash_attn_status() -> str | None:
    """None when flash-attn is usable here (CUDA present, a real import works), else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _load_flash_attn()
    except ImportError as error:
        return str(error)
    return None


_LOGGED: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.log(level, message)


def select_kernel(name: str, device: torch.device) -> AttentionKernel:
    """Resolve a backend name. ``"auto"``: flash-attn on CUDA when it imports, else PyTorch's fused kernels with
    cuDNN attention where PyTorch's SDPA would pick it (``cudnn_status``)."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"Unknown attention={name!r}; choose one of {list(KERNEL_NAMES)}.")
    if name == "reference":
        if device.type == "cuda":
            _log_once(logging.WARNING, "attention='reference' on CUDA: O(S x S_k) fp32 scores, for tests only.")
        return ReferenceKernel()
    if name == "cudnn":
        return _explicit_cudnn(device)
    if name == "sdpa" or (name == "auto" and device.type != "cuda"):
        return SDPAKernel()
    why = flash_attn_status() if device.type == "cuda" else f"device={device.type!r} is not CUDA"
    if why is None:
        return FlashAttnKernel()
    if name == "flash_attn":
        raise ValueError(f"attention='flash_attn' cannot run here ({why}): {FLASH_ATTN_FIX}.")
    no_cudnn = cudnn_status(device)
    serious = why != NOT_INSTALLED or (no_cudnn or "").startswith(NO_CUDNN_PROBE)
    if no_cudnn is None:
        kernel, what = SDPAKernel(_CudaCudnn(_cudnn_probe(_index(device)))), "cuDNN attention wherever PyTorch's SDPA"
        what += " would pick it, PyTorch's other fused kernels elsewhere (sdpa+cudnn)"
    else:
        kernel, what = SDPAKernel(), f"cuDNN attention not used ({no_cudnn}); using PyTorch's fused kernels (sdpa)"
    # One line for both choices: which kernel runs, and why not the ones before it.
    _log_once(
        logging.WARNING if serious else logging.INFO, f"attention='auto': flash-attn unavailable ({why}); {what}."
    )
    return kernel


def _explicit_cudnn(device: torch.device) -> CudnnKernel:
    if device.type != "cuda":
        raise ValueError(
            f"attention='cudnn' runs cuDNN attention on CUDA only, got device={device.type!r}; use attention='auto'"
            " or 'sdpa'."
        )
    index = _usable_index(device)
    probed = index if isinstance(index, str) else _cudnn_probe(index)
    if isinstance(probed, str):
        raise ValueError(f"attention='cudnn' cannot run here ({probed}); use attention='auto' or 'sdpa'.")
    return CudnnKernel(_CudaCudnn(probed))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
