"""Attention kernel backends with an explicit forward/backward that exposes the log-sum-exp.

Shape legend: B batch, H query heads, G K/V groups (G divides H; query head h reads group h // (H // G)),
Sq queries, Sk keys, Dh head size.

Every backend computes, for q [B, H, Sq, Dh] against k, v [B, G, Sk, Dh]:

* ``forward(q, k, v, causal, scale, *, pieces=None) -> (out [B, H, Sq, Dh] in q's dtype, lse [B, H, Sq] in fp32
  or wider)``
* ``backward(dout, q, k, v, out, lse, causal, scale, *, pieces=None) -> (dq, dk, dv)`` shaped like q, k, v.

``causal=True`` is only ever requested with Sq == Sk, where top-left and bottom-right alignment coincide;
the subsequence function handles the rectangular (prefix) part with ``causal=False``, and every backend refuses a
rectangular causal call (ATen's kernels and the reference align the mask top-left). ``backward`` takes
the *merged* ``out`` and ``lse`` of the whole row, so the gradients of each part are exact pieces of the
gradient of the full softmax.

Layouts: every backend is a ``layouts.KernelBoundary``, so each role (q, k, v, out, dout, lse) reaches its ops in
one documented layout whatever path made it, and what a forward returns is in it too (``attention.layouts`` gives
the table and why): q, k, v, out and dout [B, heads, S, Dh] over [B, S, heads, Dh] memory (BSHD, what the
projections produce and the flash kernels read), the log-sum-exp [B, H, Sq] dense (BHS; BSH for the CPU op). A
tensor that already follows its layout passes untouched; any other is copied once at the boundary. Kernel
libraries cache compiled graphs under keys that need not hold every stride, so a call never depends on how its
inputs were laid out.

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
import re
from types import ModuleType
from typing import Literal, Protocol

import torch
from torch import Tensor

from lightning_sppo.attention import cudnn
from lightning_sppo.attention.aten_ops import (
    CUDA_FLASH,
    HALF_DTYPES,
    CudnnOp,
    FusedOp,
    accumulation_dtype,
    check_pieces,
    cpu_flash_takes_groups,
    expand_groups,
    fused_op,
    lse_end_to_end,
    rows_apart,
    sum_groups,
    varlen_lse,
)
from lightning_sppo.attention.cudnn import CudnnFeatures
from lightning_sppo.attention.layouts import KERNEL_LAYOUTS, KernelBoundary, RoleLayouts
from lightning_sppo.documents import Pieces

__all__ = [
    "AttentionKernel",
    "CudnnKernel",
    "FlashAttnKernel",
    "KernelName",
    "ReferenceKernel",
    "SDPAKernel",
    "accumulation_dtype",
    "cpu_flash_takes_groups",
    "cudnn_status",
    "flash_attn_status",
    "select_kernel",
]

log = logging.getLogger(__name__)

KernelName = Literal["auto", "reference", "sdpa", "flash_attn", "cudnn"]
KERNEL_NAMES: tuple[str, ...] = ("auto", "reference", "sdpa", "flash_attn", "cudnn")
NOT_INSTALLED = "flash-attn is not installed"
FLASH_ATTN_FIX = (
    'install a flash-attn>=2.6 wheel built for this torch (`pip install -e ".[flash]"`, or'
    " `pip install flash-attn --no-build-isolation`), or use attention='auto' or 'sdpa'"
)


class AttentionKernel(Protocol):
    """The kernel interface (module docstring). Every backend here is a ``KernelBoundary``: its ``forward`` and
    ``backward`` take each role into its ``layouts`` (``attention.layouts``) before any op sees it."""

    name: str

    def layouts(self, q: Tensor) -> RoleLayouts: ...

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


class ReferenceKernel(KernelBoundary):
    """Pure PyTorch, any device, any float dtype; math in fp32 (or fp64). Query blocks bound the score memory.

    Only for tests and CPU checks: on CUDA it runs only when chosen explicitly (``attention="reference"``). Its
    layouts are the CUDA kernels' (``KERNEL_LAYOUTS``); its out is copied into them (it computes [B, H, Sq, Dh]).
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

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, pieces: Pieces | None
    ) -> tuple[Tensor, Tensor]:
        H = q.shape[1]
        k, v = expand_groups(k, H), expand_groups(v, H)
        ids = _piece_ids(pieces, q, k, causal)
        outs, lses = [], []
        for start in range(0, q.shape[2], self.block_q):
            qb = q[:, :, start : start + self.block_q]
            p, lse = self._probs(qb, k, None, causal, scale, start, ids)
            outs.append((p @ v.to(p.dtype)).to(q.dtype))
            lses.append(lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

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
        H, G = q.shape[1], k.shape[1]
        acc = accumulation_dtype(q.dtype)
        ke, ve = expand_groups(k, H).to(acc), expand_groups(v, H).to(acc)
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
        return dq, sum_groups(dk, G).to(k.dtype), sum_groups(dv, G).to(v.dtype)


def _piece_ids(pieces: Pieces | None, q: Tensor, k: Tensor, causal: bool) -> Tensor | None:
    """[B, S] piece id of every token for the reference mask, after checking ``pieces`` fits the call."""
    if pieces is None:
        return None
    check_pieces(pieces, q, k, causal)
    return pieces.segment_ids(q.device)


class SDPAKernel(KernelBoundary):
    """PyTorch's own fused kernels through their ATen ops, which return the log-sum-exp (see the module table).

    ``cudnn``: the cuDNN op pair, for the dense fp16/bf16 calls PyTorch's SDPA would run on cuDNN
    (``attention="auto"``; ``CudnnKernel`` takes it for all of them). Layouts: the op's (``KERNEL_LAYOUTS`` on
    CUDA, ``CPU_LAYOUTS`` for the CPU op); every CUDA op shares them, so the choice of op follows canonical q, k, v."""

    name = "sdpa"

    def __init__(self, cudnn: CudnnOp | None = None) -> None:
        self._cudnn = cudnn
        if cudnn is not None:
            self.name = "sdpa+cudnn"

    def layouts(self, q: Tensor) -> RoleLayouts:
        return fused_op(q.device, q.dtype).layouts

    def _op(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> FusedOp:
        op = fused_op(q.device, q.dtype)
        if op is CUDA_FLASH and self._cudnn is not None and self._takes_cudnn(q, k, v, causal, scale):
            return self._cudnn
        return op

    def _takes_cudnn(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> bool:
        return cudnn.torch_picks_cudnn(q, k, v, causal, scale)

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, pieces: Pieces | None
    ) -> tuple[Tensor, Tensor]:
        op = self._op(q, k, v, causal, scale)
        if pieces is not None:
            check_pieces(pieces, q, k, causal)
            return op.pieces_forward(q, k, v, scale, pieces)
        return op.forward(q, k, v, causal, scale)

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
        op = self._op(q, k, v, causal, scale)
        if pieces is not None:
            check_pieces(pieces, q, k, causal)
            return op.pieces_backward(dout, q, k, v, out, lse, scale, pieces)
        return op.backward(dout, q, k, v, out, lse, causal, scale)


class CudnnKernel(SDPAKernel):
    """``attention="cudnn"``: cuDNN attention for every dense fp16/bf16 call on CUDA (``SDPAKernel`` otherwise).

    A call whose shapes PyTorch's own dispatcher would never send to cuDNN (``cudnn.shape_problem``; ``head_limit``:
    the largest head size on this GPU) is refused in one line naming the setting, not left to fail inside the op."""

    def __init__(self, cudnn: CudnnOp, head_limit: int = 256) -> None:
        super().__init__(cudnn)
        self.name = "cudnn"
        self.head_limit = head_limit

    def _takes_cudnn(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> bool:
        problem = cudnn.shape_problem(q, k, v, self.head_limit)
        if problem is not None:
            raise ValueError(
                f"attention='cudnn' cannot run this call ({problem}); use attention='auto' (cuDNN wherever PyTorch's"
                " SDPA would take it, the flash op elsewhere) or 'sdpa'."
            )
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
            return cudnn.probe(torch.device("cuda", index), CudnnOp, CUDA_FLASH)
    except Exception as error:  # noqa: BLE001 - whatever fails (schema, GPU, cuDNN, numbers): fall back, say why
        return f"{type(error).__name__}: {error}"


# -- flash-attn -------------------------------------------------------------------------------------


def _flash_layout(x: Tensor) -> Tensor:
    """[B, heads, S, Dh] -> [B, S, heads, Dh] for flash-attn: a view of a canonical (BSHD) tensor, whose last
    dimension is contiguous as flash-attn needs; it takes any batch, sequence and head strides."""
    return x.transpose(1, 2)


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


class FlashAttnKernel(KernelBoundary):
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

    def layouts(self, q: Tensor) -> RoleLayouts:
        return KERNEL_LAYOUTS if q.dtype in HALF_DTYPES else self._fallback.layouts(q)

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, pieces: Pieces | None
    ) -> tuple[Tensor, Tensor]:
        if q.dtype not in HALF_DTYPES:
            return self._fallback.forward(q, k, v, causal, scale, pieces=pieces)
        qt, kt, vt = (_flash_layout(x) for x in (q, k, v))
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0, alibi_slopes=None,
                      return_softmax=False, **self._window)  # fmt: skip
        if pieces is None:
            res = self._checked(self._fai._flash_attn_forward(qt, kt, vt, **kwargs), "_flash_attn_forward")
            return res[0].transpose(1, 2), res[self._lse_index]
        check_pieces(pieces, q, k, causal)
        B = q.shape[0]
        cu, longest = pieces.cu_seqlens(q.device), pieces.max_length
        flat = (x.reshape(-1, *x.shape[2:]) for x in (qt, kt, vt))  # [B * S, heads, Dh]
        res = self._fai._flash_attn_varlen_forward(*flat, cu, cu, longest, longest, **kwargs)
        res = self._checked(res, "_flash_attn_varlen_forward")
        return rows_apart(res[0], B), varlen_lse(res[self._lse_index], B)

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
        check_pieces(pieces, q, k, causal)
        cu, longest = pieces.cu_seqlens(q.device), pieces.max_length
        dot, qt, kt, vt, ot = (x.reshape(-1, *x.shape[2:]) for x in (dot, qt, kt, vt, ot))  # [B * S, heads, Dh]
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        self._fai._flash_attn_varlen_backward(
            dot, qt, kt, vt, ot, lse_end_to_end(lse), dq, dk, dv, cu, cu, longest, longest, **kwargs
        )
        return tuple(rows_apart(x, q.shape[0]) for x in (dq, dk, dv))

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
        kernel, what = SDPAKernel(CudnnOp(_cudnn_probe(_index(device)))), "cuDNN attention wherever PyTorch's SDPA"
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
    return CudnnKernel(CudnnOp(probed), cudnn.head_size_limit(index))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
