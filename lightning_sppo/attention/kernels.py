"""Attention kernel backends with an explicit forward/backward that exposes the log-sum-exp.

Shape legend: B batch, H query heads, G K/V groups (G divides H; query head h reads group h // (H // G)),
Sq queries, Sk keys, Dh head size.

Every backend computes, for q [B, H, Sq, Dh] against k, v [B, G, Sk, Dh]:

* ``forward(q, k, v, causal, scale) -> (out [B, H, Sq, Dh] in q's dtype, lse [B, H, Sq] in fp32 or wider)``
* ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` shaped like q, k, v.

``causal=True`` is only ever requested with Sq == Sk, where top-left and bottom-right alignment coincide;
the subsequence function handles the rectangular (prefix) part with ``causal=False``. ``backward`` takes
the *merged* ``out`` and ``lse`` of the whole row, so the gradients of each part are exact pieces of the
gradient of the full softmax. (Document masking will add variable-length pieces, cu_seqlens style, as
keyword arguments of both methods; every fused op used here has a varlen form.)

Which kernel runs where:

* ``flash_attn``: flash-attn 2.6+ on CUDA (fp16/bf16, native GQA); fp32 goes to ``sdpa``; refused on CPU.
* ``sdpa`` on CUDA: ATen's flash op for fp16/bf16 (native GQA), ATen's memory-efficient op for fp32.
* ``sdpa`` on CPU: ATen's CPU flash op, any float dtype (native GQA where the op takes it).
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

__all__ = [
    "AttentionKernel",
    "FlashAttnKernel",
    "KernelName",
    "ReferenceKernel",
    "SDPAKernel",
    "flash_attn_status",
    "select_kernel",
]

log = logging.getLogger(__name__)

KernelName = Literal["auto", "reference", "sdpa", "flash_attn"]
KERNEL_NAMES: tuple[str, ...] = ("auto", "reference", "sdpa", "flash_attn")
HALF_DTYPES = (torch.float16, torch.bfloat16)
NOT_INSTALLED = "flash-attn is not installed"
FLASH_ATTN_FIX = (
    'install a flash-attn>=2.6 wheel built for this torch (`pip install -e ".[flash]"`, or'
    " `pip install flash-attn --no-build-isolation`), or use attention='auto' or 'sdpa'"
)


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


# -- PyTorch's fused kernels ------------------------------------------------------------------------


class _FusedOp(Protocol):
    """One ATen attention op pair, called in the kernel interface's layout and conventions."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class _CpuFlash:
    """``_scaled_dot_product_flash_attention_for_cpu``: fp32/fp64/bf16/fp16; K/V unexpanded where the op takes GQA."""

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
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, ke, ve, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale
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
    """

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
    """PyTorch's own fused kernels through their ATen ops, which return the log-sum-exp (see the module table)."""

    name = "sdpa"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        return fused_op(q.device, q.dtype).forward(q, k, v, causal, scale)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        return fused_op(q.device, q.dtype).backward(dout, q, k, v, out, lse, causal, scale)


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

    Both backwards overwrite dq/dk/dv (they do not add). ``deterministic`` follows
    ``torch.use_deterministic_algorithms``. fp32 inputs go to ``SDPAKernel`` (flash-attn takes fp16/bf16 only).
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

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if q.dtype not in HALF_DTYPES:
            return self._fallback.forward(q, k, v, causal, scale)
        qt, kt, vt = (_flash_layout(x) for x in (q, k, v))
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0, alibi_slopes=None,
                      return_softmax=False, **self._window)  # fmt: skip
        res = self._fai._flash_attn_forward(qt, kt, vt, **kwargs)
        if len(res) != self._arity:
            raise RuntimeError(
                f"flash-attn {self.version[0]}.{self.version[1]} returned {len(res)} values from"
                f" _flash_attn_forward, expected {self._arity}; this flash-attn version is not supported."
            )
        return res[0].transpose(1, 2), res[self._lse_index]

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        if q.dtype not in HALF_DTYPES:
            return self._fallback.backward(dout, q, k, v, out, lse, causal, scale)
        qt, kt, vt, ot, dot = (_flash_layout(x) for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0, alibi_slopes=None,
                      deterministic=torch.are_deterministic_algorithms_enabled(), rng_state=None,
                      **self._window)  # fmt: skip
        self._fai._flash_attn_backward(dot, qt, kt, vt, ot, lse.contiguous(), dq, dk, dv, **kwargs)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


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
    """Resolve a backend name. ``"auto"``: flash-attn on CUDA when it imports, else PyTorch's fused kernels."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"Unknown attention={name!r}; choose one of {list(KERNEL_NAMES)}.")
    if name == "reference":
        if device.type == "cuda":
            _log_once(logging.WARNING, "attention='reference' on CUDA: O(S x S_k) fp32 scores, for tests only.")
        return ReferenceKernel()
    if name == "sdpa" or (name == "auto" and device.type != "cuda"):
        return SDPAKernel()
    why = flash_attn_status() if device.type == "cuda" else f"device={device.type!r} is not CUDA"
    if why is None:
        return FlashAttnKernel()
    if name == "flash_attn":
        raise ValueError(f"attention='flash_attn' cannot run here ({why}): {FLASH_ATTN_FIX}.")
    level = logging.INFO if why == NOT_INSTALLED else logging.WARNING
    _log_once(level, f"attention='auto': flash-attn unavailable ({why}); using PyTorch's fused kernels (sdpa).")
    return SDPAKernel()
