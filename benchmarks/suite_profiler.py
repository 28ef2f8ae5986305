"""Which attention kernel a step actually ran, read from the profiler's kernel names.

Why: the engine asks the dispatcher per call (``attention="auto"`` takes cuDNN where PyTorch's SDPA would, else ATen's
flash op) and the plain model's ``F.scaled_dot_product_attention`` picks its own backend, so a configuration says what
was asked for, not what ran. On the first H100 run the engine's slower steps were very probably FA2 against the plain
model's cuDNN, and nothing recorded it. Every check and row of the GPU suite's decisive preset is labelled by the
kernels named here.

On CUDA the names are the device kernels ``torch.profiler`` records (CUPTI): cuDNN's fused attention
(``cudnn_generated_..._sdpa_...``), ATen's FlashAttention-2 (``pytorch_flash::flash_fwd_kernel``), the flash-attn
package (``flash::flash_fwd_kernel``, outside ``pytorch_flash``), ATen's memory-efficient kernel
(``fmha_cutlassF``/``fmha_cutlassB``). On CPU the ATen ops that compute attention, as dispatched below autograd
(``aten::_scaled_dot_product_flash_attention_for_cpu``, ``aten::_scaled_dot_product_attention_math``, ...). On CUDA
only device kernels are recorded: a step whose attention ran unfused (math) shows no attention kernel, and says so.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NO_ATTENTION", "AttentionRecord", "AttentionRecorder", "attention_family", "profiled", "record_from_events"]

T = TypeVar("T")

CUDNN, FA2, FLASH_ATTN, EFFICIENT, MATH, CPU_FLASH = (
    "cuDNN", "FA2 (ATen flash)", "flash-attn", "memory-efficient (ATen cutlass)", "math (unfused SDPA)", "CPU flash",
)  # fmt: skip
NO_ATTENTION = "no fused attention kernel seen (math, or the reference kernel)"

_CUDA_KERNELS = (  # (substrings that must all appear, lower case) -> family; the first match wins
    (("cudnn", "sdpa"), CUDNN),
    (("cudnn", "fmha"), CUDNN),
    (("cudnn", "flash"), CUDNN),
    (("pytorch_flash",), FA2),
    (("flash_fwd",), FLASH_ATTN),
    (("flash_bwd",), FLASH_ATTN),
    (("flashattn",), FLASH_ATTN),  # flash-attn 3 on Hopper: flash::FlashAttnFwdSm90<...>
    (("fmha_cutlass",), EFFICIENT),
)
_ATEN_OPS = {  # the ATen op that computes attention -> family (the dispatcher's wrappers are not listed)
    "aten::_scaled_dot_product_flash_attention_for_cpu": CPU_FLASH,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": CPU_FLASH,
    "aten::_scaled_dot_product_attention_math": MATH,
    "aten::_scaled_dot_product_attention_math_for_mps": MATH,
    "aten::_scaled_dot_product_cudnn_attention": CUDNN,
    "aten::_scaled_dot_product_cudnn_attention_backward": CUDNN,
    "aten::_scaled_dot_product_flash_attention": FA2,
    "aten::_scaled_dot_product_flash_attention_backward": FA2,
    "aten::_flash_attention_forward": FA2,
    "aten::_flash_attention_backward": FA2,
    "aten::_scaled_dot_product_efficient_attention": EFFICIENT,
    "aten::_scaled_dot_product_efficient_attention_backward": EFFICIENT,
    "aten::_efficient_attention_forward": EFFICIENT,
    "aten::_efficient_attention_backward": EFFICIENT,
}


def attention_family(name: str, device_kernel: bool) -> str | None:
    """The attention kernel family a profiled name belongs to, or None when it computes no attention.
    ``device_kernel``: a CUDA kernel's name (else an ATen op's)."""
    if not device_kernel:
        return _ATEN_OPS.get(name)
    lower = name.lower()
    for parts, family in _CUDA_KERNELS:
        if all(part in lower for part in parts):
            return family
    return None


@dataclass
class AttentionRecord:
    """What attention ran in one profiled step."""

    label: str = NO_ATTENTION
    """The families that ran, in order of time spent, joined by " + " (e.g. "cuDNN", "cuDNN + FA2 (ATen flash)")."""
    source: str = ""
    """"CUDA kernels" or "ATen ops": what the names are."""
    kernels: list[dict[str, Any]] = field(default_factory=list)
    """Each attention kernel (or op): name (shortened), family, calls, milliseconds (device time on CUDA; 0 for ATen
    ops, which are counted, not timed), most time first (then most calls)."""

    def to_dict(self) -> dict[str, Any]:
        return {"attention": self.label, "attention_source": self.source, "attention_kernels": self.kernels}


def record_from_events(events: list[tuple[str, bool, float, int]]) -> AttentionRecord:
    """``events``: (name, is a CUDA kernel, microseconds, calls). Device kernels decide where any attention kernel
    ran on the device; otherwise the ATen ops do (CPU)."""
    totals: dict[tuple[str, bool], list[float]] = defaultdict(lambda: [0.0, 0])
    for name, on_device, us, calls in events:
        if attention_family(name, on_device) is not None:
            totals[(name, on_device)][0] += us
            totals[(name, on_device)][1] += calls
    on_device = any(device for _, device in totals)
    chosen = sorted(
        ((n, t) for (n, d), t in totals.items() if d == on_device), key=lambda item: (-item[1][0], -item[1][1])
    )
    if not chosen:
        return AttentionRecord()
    kernels = [{"name": name[:160], "family": attention_family(name, on_device), "calls": int(calls),
                "ms": us / 1e3} for name, (us, calls) in chosen]  # fmt: skip
    weight: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # family -> [ms, calls]
    for k in kernels:
        weight[k["family"]][0] -= k["ms"]
        weight[k["family"]][1] -= k["calls"]
    label = " + ".join(sorted(weight, key=lambda family: weight[family]))
    return AttentionRecord(label, "CUDA kernels" if on_device else "ATen ops", kernels)


class AttentionRecorder:
    """A context in which the attention that runs is recorded; ``record`` reads it afterwards (reading a CUDA
    profile costs host time, so it happens outside whatever the context timed).

    On CUDA the kernels ``torch.profiler`` records (device activity only: the CPU ops of a long step would cost seconds
    to read back); on CPU the ATen ops dispatched (a dispatch mode, about as cheap as the ops themselves, where the
    profiler's own CPU trace costs over a second per ten thousand ops to read)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._context: Any = None
        self._record: AttentionRecord | None = None

    def __enter__(self) -> AttentionRecorder:
        if self.device.type == "cuda":
            self._context = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        else:
            self._context = _AtenOps()
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda" and exc[0] is None:
            torch.cuda.synchronize(self.device)  # every kernel of the context done before the trace stops
        self._context.__exit__(*exc)

    @property
    def record(self) -> AttentionRecord:
        if self._record is None:
            if isinstance(self._context, _AtenOps):
                events = [(name, False, 0.0, calls) for name, calls in self._context.calls.items()]
            else:
                events = [_event(e) for e in self._context.key_averages()]
            self._record = record_from_events(events)
        return self._record


def profiled(fn: Callable[[], T], device: torch.device) -> tuple[T, AttentionRecord]:
    """``fn()`` and the attention it ran (``AttentionRecorder``)."""
    with AttentionRecorder(device) as recorder:
        result = fn()
    return result, recorder.record


class _AtenOps(TorchDispatchMode):
    """Counts every ATen op dispatched inside (below autograd: the op that computes, e.g. the one
    ``F.scaled_dot_product_attention`` chose)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.name()] += 1
        return func(*args, **(kwargs or {}))


def _event(event: Any) -> tuple[str, bool, float, int]:
    on_device = event.device_type == torch.autograd.DeviceType.CUDA
    us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
    return event.key, on_device, float(us if on_device else 0.0), int(event.count)
