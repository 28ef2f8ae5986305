"""``sppo-plan --calibrate``: measure this machine's GPU and write a profile JSON.

It times what one GPU can measure alone: a large bf16 matmul (achieved TFLOP/s) and pinned copies in both
directions (D2H/H2D GB/s), and reads the device and host memory sizes. Links between GPUs and nodes cannot
be measured from one process; they are taken from the closest built-in profile. The measured matmul rate
is an upper bound for a whole layer, so ``mfu`` in the written file is optimistic; ``sppo-plan --fit-suite``
(``planner.fit``) fits it, attention's own rate, the per-layer overhead, the copy rate and the memory reserve to whole
steps measured by ``benchmarks/gpu_suite.py`` instead.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from lightning_sppo.planner.profile import BUILTIN_PROFILES, HardwareProfile

__all__ = ["CalibrationUnavailable", "calibrate"]


class CalibrationUnavailable(RuntimeError):
    """No CUDA device to measure."""


def calibrate(matmul_size: int = 8192, copy_bytes: int = 2**30, repeats: int = 10) -> HardwareProfile:
    """A profile of the current CUDA device; raises ``CalibrationUnavailable`` without one."""
    if not torch.cuda.is_available():
        raise CalibrationUnavailable(
            "--calibrate needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
            "use --gpu a100-80gb, h100, h200 or a profile JSON instead."
        )
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    base = _closest_builtin(name)
    tflops = _matmul_tflops(matmul_size, repeats, device)
    d2h, h2d = _copy_gbps(copy_bytes, repeats, device)
    # A datasheet peak for the GPUs we know; otherwise the matmul rate is the best peak we have.
    peak = base.peak_bf16_tflops if _known(name) else tflops
    return replace(
        base,
        name=f"calibrated: {name}",
        peak_bf16_tflops=peak,
        mfu=min(1.0, tflops / peak),
        hbm_bytes=torch.cuda.get_device_properties(device).total_memory,
        host_bytes_per_gpu=_host_bytes_per_gpu(),
        d2h_gbps=d2h,
        h2d_gbps=h2d,
        gpus_per_node=torch.cuda.device_count(),
    )


def _known(name: str) -> bool:
    return any(tag in name.upper() for tag in ("A100", "H100", "H200"))


def _closest_builtin(device_name: str) -> HardwareProfile:
    upper = device_name.upper()
    for tag, key in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb")):
        if tag in upper:
            return BUILTIN_PROFILES[key]
    return BUILTIN_PROFILES["a100-80gb"]


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, timed with CUDA events after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # waits for this run only; the elapsed time needs both events done
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _matmul_tflops(n: int, repeats: int, device: torch.device) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = _timed(lambda: torch.mm(a, b), repeats)
    return 2 * n**3 / seconds / 1e12


def _copy_gbps(nbytes: int, repeats: int, device: torch.device) -> tuple[float, float]:
    """Pinned host <-> device copy bandwidth, the way the offloader copies (non_blocking into pinned memory)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = _timed(lambda: host.copy_(gpu, non_blocking=True), repeats)
    h2d = _timed(lambda: gpu.copy_(host, non_blocking=True), repeats)
    return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def _host_bytes_per_gpu() -> int:
    """The node's memory less 1/8 for the OS, shared among the visible GPUs (as the built-in profiles assume)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total * 7 // 8 // max(1, torch.cuda.device_count())
