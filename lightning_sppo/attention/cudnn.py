"""What the cuDNN attention backend needs to know about this torch and GPU: the op schemas, the log-sum-exp layout,
whether PyTorch's own SDPA would pick cuDNN, and whether the op agrees with the flash op. The op pair itself, in the
kernel interface's conventions, is ``aten_ops.CudnnOp``.

ATen's ``_scaled_dot_product_cudnn_attention`` (with ``compute_log_sumexp``) and its ``_backward`` run cuDNN's fused
attention (Hopper kernels on sm90), the kernel ``F.scaled_dot_product_attention`` itself prefers on recent
PyTorch/cuDNN. What differs between torch versions is checked, not assumed, so a torch that differs fails with one
clear line instead of wrong numbers:

* the schemas: the argument names this code passes positionally, the same in torch 2.11 and 2.13, read from the
  ops at first use (``ops``, ``schema_problems``);
* the log-sum-exp: torch 2.5-2.13 return [B, H, Sq, 1] fp32; a torch that pads the query dimension ([B, H, P] or
  [B, H, P, 1], P a multiple of a tile) is handled too. ``LseLayout`` says which, found from what the op returns
  for two query lengths (``lse_layout``); ``lse_from_op`` and ``lse_to_op`` convert between it and the kernel
  interface's dense [B, H, Sq], both ways (a merged log-sum-exp feeds the backward);
* the choice: ``torch_picks_cudnn`` asks PyTorch's SDPA dispatcher (``torch._fused_sdp_choice``, torch 2.5+)
  which backend it would run for these tensors in training, so ``attention="auto"`` uses cuDNN exactly where the
  plain model's ``F.scaled_dot_product_attention`` would;
* the numbers: ``probe`` runs tiny bf16 forwards and backwards against the flash op once (square causal,
  rectangular, MHA and GQA), and finds whether G < H K/V groups are read natively.

Not yet run on a GPU when written (the CPU tests run every function here on fakes and meta tensors);
``benchmarks/gpu_checks.py`` checks the backend against float64 on the next GPU session.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "BACKWARD_ARGS",
    "FORWARD_ARGS",
    "CudnnFeatures",
    "head_size_limit",
    "LseLayout",
    "lse_from_op",
    "lse_layout",
    "lse_to_op",
    "ops",
    "probe",
    "schema_problems",
    "shape_problem",
    "torch_picks_cudnn",
]

FORWARD_ARGS = (
    "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask", "scale",
)  # fmt: skip
"""``_scaled_dot_product_cudnn_attention``'s arguments, in the order they are passed (``scale`` by keyword)."""
FORWARD_RETURNS = 9
"""(output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)."""
BACKWARD_ARGS = (
    "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
    "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale",
)  # fmt: skip
"""``_scaled_dot_product_cudnn_attention_backward``'s arguments, in the order they are passed."""


def schema_problems(forward: torch._C.FunctionSchema, backward: torch._C.FunctionSchema) -> list[str]:
    """What differs between the ops' schemas and the arguments this code passes (empty: they match)."""
    problems = []
    for schema, expected in ((forward, FORWARD_ARGS), (backward, BACKWARD_ARGS)):
        names = tuple(argument.name for argument in schema.arguments)
        if names != expected:
            problems.append(f"{schema.name}({', '.join(names)}) where this code passes ({', '.join(expected)})")
    if len(forward.returns) != FORWARD_RETURNS:
        problems.append(f"{forward.name} returns {len(forward.returns)} values, this code reads {FORWARD_RETURNS}")
    return problems


@functools.cache
def ops() -> tuple[torch._ops.OpOverload, torch._ops.OpOverload]:
    """The cuDNN attention op pair, after checking their schemas take what ``aten_ops.CudnnOp`` passes
    (RuntimeError naming ``attention=`` otherwise)."""
    forward = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", None)
    if forward is None or backward is None:
        raise RuntimeError(f"torch {torch.__version__} has no ATen cuDNN attention ops; use attention='sdpa'.")
    problems = schema_problems(forward.default._schema, backward.default._schema)
    if problems:
        raise RuntimeError(
            f"torch {torch.__version__}'s cuDNN attention ops differ from what lightning_sppo passes: "
            + "; ".join(problems)
            + ". Use attention='sdpa'."
        )
    return forward.default, backward.default


class LseLayout(NamedTuple):
    """How the cuDNN op lays out its log-sum-exp for Sq queries: [B, H, P] plus a trailing 1 when
    ``trailing_one``, with P = Sq rounded up to a multiple of ``tile`` (1: no padding)."""

    trailing_one: bool
    tile: int

    def length(self, queries: int) -> int:
        return math.ceil(queries / self.tile) * self.tile


TORCH_LSE = LseLayout(trailing_one=True, tile=1)
"""What torch 2.5-2.13 return: [B, H, Sq, 1]."""


class CudnnFeatures(NamedTuple):
    """What the self-probe found (``kernels.cudnn_status``): the log-sum-exp layout, and whether the op reads G < H
    K/V groups itself (else the op pair expands them and sums dK/dV over each group in fp32)."""

    lse: LseLayout
    groups: bool


def lse_layout(short: tuple[int, ...], short_queries: int, long: tuple[int, ...], long_queries: int) -> LseLayout:
    """The layout, from the log-sum-exp shapes the op returned for two query lengths (e.g. 17 and 33: coprime, so
    only one tile rounds both up as observed). Raises ValueError for shapes that fit no layout."""
    trailing = len(short) == 4
    if len(short) != len(long) or len(short) not in (3, 4) or (trailing and (short[-1], long[-1]) != (1, 1)):
        raise ValueError(f"cuDNN attention returned log-sum-exp shapes {short} and {long}: no known layout.")
    observed = (short[2], long[2])
    common = math.gcd(*observed)
    tiles = [t for t in range(1, common + 1) if common % t == 0 and
             (LseLayout(trailing, t).length(short_queries), LseLayout(trailing, t).length(long_queries)) == observed]  # fmt: skip
    if not tiles:
        raise ValueError(f"cuDNN attention returned log-sum-exp shapes {short} and {long}: no known padding.")
    return LseLayout(trailing, tiles[-1])


def lse_from_op(lse: Tensor, queries: int) -> Tensor:
    """The op's log-sum-exp as the kernel interface's [B, H, Sq] (a view)."""
    if lse.dim() == 4:
        lse = lse[..., 0]
    return lse[..., :queries]


def lse_to_op(lse: Tensor, layout: LseLayout) -> Tensor:
    """A dense [B, H, Sq] log-sum-exp (merged or not) in the op's layout, contiguous as the op allocates it."""
    padded = layout.length(lse.shape[-1])
    lse = (F.pad(lse, (0, padded - lse.shape[-1])) if padded != lse.shape[-1] else lse).contiguous()
    return lse.unsqueeze(-1) if layout.trailing_one else lse


def shape_problem(q: Tensor, k: Tensor, v: Tensor, head_limit: int) -> str | None:
    """Why PyTorch's SDPA dispatcher would not run cuDNN attention for these dense shapes (its shape gates:
    ``check_cudnn_tensor_shapes``), or None. ``head_limit``: the largest head size on this GPU (``head_size_limit``)."""
    sizes = (q.shape[-1], v.shape[-1])
    if k.shape[2] == 1:
        return "1 key: cuDNN attention takes at least 2"
    if max(sizes) > head_limit or any(size % 8 for size in sizes):
        return f"head size {q.shape[-1]}: cuDNN attention takes multiples of 8 up to {head_limit} here"
    return None


@functools.cache
def head_size_limit(index: int) -> int:
    """The largest head size PyTorch runs cuDNN attention with on this GPU: 256 on Hopper (sm90) with cuDNN 9.10 or
    later, else 128 (the dispatcher's rule)."""
    version = torch.backends.cudnn.version() or 0
    return 256 if version >= 91000 and torch.cuda.get_device_capability(index) == (9, 0) else 128


def cudnn_backend() -> int | None:
    """The SDPA backend number of cuDNN attention in this torch (None: it has none)."""
    backend = getattr(torch.nn.attention.SDPBackend, "CUDNN_ATTENTION", None)
    return None if backend is None else int(backend.value)


_CHOICES: dict[tuple, bool] = {}


def torch_picks_cudnn(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> bool:
    """Whether ``F.scaled_dot_product_attention`` would run cuDNN attention for these tensors in a training step
    (inputs requiring grad), under the SDPA backends enabled now (``torch.nn.attention.sdpa_kernel``).

    Asked once per layout (shapes, strides, dtype, device, mask, the enabled backends, determinism): the engine asks
    for every kernel call, and the dispatcher's answer depends on nothing else."""
    key = (*(tuple(x.shape) + x.stride() for x in (q, k, v)), q.dtype, q.device, causal, scale, _sdpa_settings())
    picked = _CHOICES.get(key)
    if picked is None:
        if len(_CHOICES) > 4096:  # distinct layouts are few (a few per subsequence length); never grow without bound
            _CHOICES.clear()
        picked = _CHOICES[key] = _ask_dispatcher(q, k, v, causal, scale)
    return picked


def _sdpa_settings() -> tuple:
    cuda = torch.backends.cuda
    flags = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled", "math_sdp_enabled")
    return (*(getattr(cuda, flag, lambda: None)() for flag in flags), torch.are_deterministic_algorithms_enabled())


def _ask_dispatcher(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> bool:
    choose, backend = getattr(torch, "_fused_sdp_choice", None), cudnn_backend()
    if choose is None or backend is None:
        return False
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]  # aliases: no copy
        choice = choose(*leaves, None, 0.0, causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return choice == backend


# -- the self-probe --------------------------------------------------------------------------------------------

PROBE_TOLERANCE = 2e-2
"""Relative error allowed between the cuDNN and flash ops on the probe's bf16 inputs (both accumulate in fp32)."""
PROBE_CASES = ((4, 4, 96, 96, True, 64), (4, 4, 32, 96, False, 64), (8, 8, 64, 64, True, 128))
"""(H, G, Sq, Sk, causal, Dh): square causal and rectangular, both head sizes the shipped models use."""
GQA_CASES = ((4, 2, 96, 96, True, 64), (4, 2, 32, 96, False, 64))


class _OpPair(Protocol):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...


def probe(device: torch.device, make: Callable[[CudnnFeatures], _OpPair], reference: _OpPair) -> CudnnFeatures:
    """Tiny bf16 forwards and backwards of the cuDNN op pair (``make(features)``) against ``reference`` (the flash
    op) on ``device``: the log-sum-exp layout (from what the op returns for 17 and 33 queries), then out, lse, dq, dk,
    dv on ``PROBE_CASES``, then G < H groups read natively, else expanded (``GQA_CASES``), all in the layouts the
    engine passes (sequence-major views, prefixes of a longer cache). Raises RuntimeError naming what disagrees. Its
    own generator: the caller's random stream is left alone."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(batch: int, heads: int, length: int, head_size: int, room: int = 0) -> Tensor:
        """[B, heads, length, Dh] as the engine passes them: a view of sequence-major memory, the first ``length``
        tokens of ``length + room`` (a K/V cache's prefix)."""
        memory = torch.randn(batch, length + room, heads, head_size, generator=gen, device=device, dtype=torch.bfloat16)
        return memory[:, :length].transpose(1, 2)

    forward, _ = ops()
    shapes = [tuple(forward(rand(1, 4, n, 64), rand(1, 4, 33, 64), rand(1, 4, 33, 64), None, True, 0.0, False, False,
                            scale=0.125)[1].shape) for n in (17, 33)]  # fmt: skip
    layout = lse_layout(shapes[0], 17, shapes[1], 33)
    for case in PROBE_CASES:
        _agree(make(CudnnFeatures(layout, True)), reference, case, rand)
    try:
        for case in GQA_CASES:
            _agree(make(CudnnFeatures(layout, True)), reference, case, rand)
        return CudnnFeatures(layout, True)
    except RuntimeError:  # the op refused or misread G < H groups: expand them
        for case in GQA_CASES:
            _agree(make(CudnnFeatures(layout, False)), reference, case, rand)
        return CudnnFeatures(layout, False)


def _agree(op: _OpPair, reference: _OpPair, case: tuple, rand: Callable[..., Tensor]) -> None:
    """Raise RuntimeError unless ``op`` and ``reference`` give the same out, lse, dq, dk, dv on ``case``; the
    backwards get the reference's out and lse, as a merged out/lse would reach them."""
    heads, groups, sq, sk, causal, dh = case
    room = 0 if causal else 16  # a prefix: part of a longer cache
    q, dout = rand(1, heads, sq, dh), rand(1, heads, sq, dh)
    k, v = rand(1, groups, sk, dh, room), rand(1, groups, sk, dh, room)
    scale = dh**-0.5
    want = reference.forward(q, k, v, causal, scale)
    got = (*op.forward(q, k, v, causal, scale), *op.backward(dout, q, k, v, *want, causal, scale))
    want = (*want, *reference.backward(dout, q, k, v, *want, causal, scale))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        if a.shape != b.shape:
            raise RuntimeError(f"{name} of shape {tuple(a.shape)}, the flash op's is {tuple(b.shape)} ({case})")
        error = ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-6)).item()
        if not error <= PROBE_TOLERANCE:
            raise RuntimeError(f"{name} differs from the flash op's by {error:.3g} (H, G, Sq, Sk, causal, Dh = {case})")
