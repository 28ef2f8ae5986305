"""One memory layout per tensor role at every attention kernel's boundary, and the door that enforces it.

Shape legend: B batch, H query heads, G K/V groups, S tokens of the call (Sq queries, Sk keys), Dh head size.

Why: a kernel call must not depend on how its inputs happened to be laid out by the path that made them. Kernel
libraries cache compiled graphs under keys that may not hold every stride: PyTorch's cuDNN attention backward (the
2.11 line) keys its graph cache by q, k, v and the scalars, while the graph bakes in the strides of out, dout and the
log-sum-exp. A layer whose out came back from host memory in another layout than the layer before would replay the
other layer's graph against the wrong strides: wrong gradients, no error. So every backend takes each role in ONE
layout, whatever produced it (subsequence or layer order, offload, recompute, K/V streamed from host, chunk views,
packed documents, GQA/MQA), and host round trips restore strides (``runtime.layer_major._Checkpoints``).

A layout is the order of a tensor's dimensions in memory, outermost first: ``BSHD`` is a [B, heads, S, Dh] tensor
whose memory runs [B, S, heads, Dh]. Sizes may differ from call to call (chunks, document pieces, groups of rows,
a prefix of the cache), strides may have gaps (q and k are views of the fused qkv projection's output); a dimension
of size 1 has no place in the order (its stride is never used).

The canonical layouts (``KERNEL_LAYOUTS``; ATen's CPU flash op differs in the log-sum-exp only, ``CPU_LAYOUTS``):

========== ============================ ====================================================================
role       layout                       why
========== ============================ ====================================================================
q, k, v    BSHD [B, H|G, S, Dh]         what the qkv projection produces ([B, S, (H + 2G) Dh], viewed per
                                        head) and the K/V cache stores (sequence-major: with B = 1 a prefix
                                        is contiguous); flash-attn and ATen's flash op read [B, S, heads, Dh],
                                        so their transposes are views
out        BSHD [B, H, Sq, Dh]          what every fused kernel returns for BSHD q (cuDNN's out follows q)
                                        and what the output projection reads as a view
dout       BSHD [B, H, Sq, Dh]          what the output projection's backward hands back; cuDNN before 9.5.1
                                        wants dout's strides equal to out's
lse        BHS [B, H, Sq], fp32         what the CUDA kernels return and read (cuDNN [B, H, Sq, 1], the flash
                                        ops, the memory-efficient op's padded rows); ATen's CPU flash op
                                        returns and reads BSH (its [B, Sq, H] transposed): ``CPU_LAYOUTS``
========== ============================ ====================================================================

``KernelBoundary`` is the base of every backend (``attention.kernels``): its ``forward``/``backward`` pass each
role through ``canonical`` (a no-op when the tensor already follows the layout, so the common path copies nothing)
and refuse a rectangular causal call, then run the backend's ``_forward``/``_backward``; what a forward returns is
made canonical too, so merged partials and kept checkpoints keep the layout and the backward finds it in place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_sppo.documents import Pieces

__all__ = [
    "BHS",
    "BSH",
    "BSHD",
    "CPU_LAYOUTS",
    "KERNEL_LAYOUTS",
    "KernelBoundary",
    "Layout",
    "RoleLayouts",
    "canonical",
    "empty_in",
    "follows",
    "is_dense_in",
    "memory_order",
    "tokens_joined",
]


class Layout(NamedTuple):
    """A memory order: ``order`` lists the dimensions outermost first (``name`` spells them)."""

    name: str
    order: tuple[int, ...]


BSHD = Layout("BSHD", (0, 2, 1, 3))
"""[B, heads, S, Dh] over [B, S, heads, Dh] memory."""
BHS = Layout("BHS", (0, 1, 2))
"""[B, H, S] over [B, H, S] memory (dense: contiguous)."""
BSH = Layout("BSH", (0, 2, 1))
"""[B, H, S] over [B, S, H] memory."""


@dataclass(frozen=True)
class RoleLayouts:
    """The layout of each tensor role at a kernel's boundary (module docstring)."""

    q: Layout
    k: Layout
    v: Layout
    out: Layout
    dout: Layout
    lse: Layout


KERNEL_LAYOUTS = RoleLayouts(q=BSHD, k=BSHD, v=BSHD, out=BSHD, dout=BSHD, lse=BHS)
"""Every CUDA backend's, and the reference kernel's."""
CPU_LAYOUTS = replace(KERNEL_LAYOUTS, lse=BSH)
"""ATen's CPU flash op's: its log-sum-exp as it returns it, so the CPU path copies nothing the plain model does not."""


def follows(x: Tensor, layout: Layout) -> bool:
    """Whether ``x``'s memory runs in ``layout``'s order: the innermost dimension (of size > 1) has stride 1, and
    each one further out steps over at least the whole extent of the one inside it (gaps allowed, no overlap)."""
    shape, strides = x.shape, x.stride()
    reach = None  # the extent of the dimensions inside, once the innermost is placed
    for dim in reversed(layout.order):
        size, stride = shape[dim], strides[dim]
        if size == 1:
            continue
        if (reach is None and stride != 1) or (reach is not None and stride < reach):
            return False
        reach = stride * size
    return True


def empty_in(shape: tuple[int, ...], layout: Layout, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised dense tensor of ``shape`` laid out in ``layout``'s order."""
    memory = torch.empty([shape[d] for d in layout.order], dtype=dtype, device=device)
    return memory.permute([layout.order.index(d) for d in range(len(shape))])


def is_dense_in(x: Tensor, layout: Layout) -> bool:
    """Whether ``x`` follows ``layout`` without gaps: its strides (of dimensions of size > 1) are those of
    ``empty_in``, so they follow from its shape alone."""
    shape, strides, step = x.shape, x.stride(), 1
    for dim in reversed(layout.order):
        if shape[dim] != 1 and strides[dim] != step:
            return False
        step *= shape[dim]
    return True


def canonical(x: Tensor, layout: Layout, *, dense: bool = False) -> Tensor:
    """``x`` itself when it follows ``layout`` (``dense``: without gaps, ``is_dense_in``), else one copy laid out
    so: the choke point of every kernel call."""
    if is_dense_in(x, layout) if dense else follows(x, layout):
        return x
    return empty_in(tuple(x.shape), layout, dtype=x.dtype, device=x.device).copy_(x)


def tokens_joined(parts: list[Tensor], layout: Layout = BSHD) -> Tensor:
    """[B, heads, n_i, Dh] parts joined along the tokens into one tensor in ``layout`` (``torch.cat`` would return
    it contiguous, [B, heads, S, Dh] in memory: the kernel boundary would copy it again)."""
    first = parts[0]
    shape = (*first.shape[:2], sum(p.shape[2] for p in parts), *first.shape[3:])
    joined = empty_in(shape, layout, dtype=first.dtype, device=first.device)
    at = 0
    for part in parts:
        joined[:, :, at : at + part.shape[2]].copy_(part)
        at += part.shape[2]
    return joined


def memory_order(x: Tensor, names: str = "BHSD") -> str:
    """The dimensions of size > 1 from the largest stride to the smallest, by name (e.g. "BSHD"): what a layout
    check compares across calls (sizes may differ, size-1 dimensions have no place)."""
    dims = sorted((d for d in range(x.dim()) if x.shape[d] > 1), key=lambda d: (-x.stride(d), d))
    return "".join(names[d] for d in dims)


def _check_square_causal(q: Tensor, k: Tensor, causal: bool) -> None:
    """A causal call is square: ATen's kernels (cuDNN, the flash and memory-efficient ops, the CPU op) and the
    reference align a causal mask top-left, the engine needs bottom-right; both agree only when Sq == Sk."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            "Attention kernels take causal=True for square causal attention only (as many queries as keys: their"
            f" masks align top-left), got {q.shape[2]} queries over {k.shape[2]} keys; pass the earlier keys as a"
            " prefix with causal=False (attention.subsequence.attend)."
        )


class KernelBoundary:
    """The door into an attention backend (module docstring): ``forward``/``backward`` make every role canonical and
    check the call, then run ``_forward``/``_backward``, which a backend implements together with ``layouts``.

    ``forward(q, k, v, causal, scale, *, pieces=None) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, causal,
    scale, *, pieces=None) -> (dq, dk, dv)`` are the kernel interface (``attention.kernels``)."""

    name: str = "kernel"

    def layouts(self, q: Tensor) -> RoleLayouts:
        """This backend's layouts for a call with ``q`` (its device and dtype pick the op)."""
        return KERNEL_LAYOUTS

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, *, pieces: Pieces | None = None
    ) -> tuple[Tensor, Tensor]:
        _check_square_causal(q, k, causal)
        roles = self.layouts(q)
        q, k, v = canonical(q, roles.q), canonical(k, roles.k), canonical(v, roles.v)
        out, lse = self._forward(q, k, v, causal, scale, pieces)
        return canonical(out, roles.out), canonical(lse, roles.lse)

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
        _check_square_causal(q, k, causal)
        roles = self.layouts(q)
        tensors = (dout, q, k, v, out, lse)
        layouts = (roles.dout, roles.q, roles.k, roles.v, roles.out, roles.lse)
        dout, q, k, v, out, lse = (canonical(x, layout) for x, layout in zip(tensors, layouts, strict=True))
        return self._backward(dout, q, k, v, out, lse, causal, scale, pieces)

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, pieces: Pieces | None
    ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError(f"{type(self).__name__} implements no attention forward.")

    def _backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
        pieces: Pieces | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError(f"{type(self).__name__} implements no attention backward.")
