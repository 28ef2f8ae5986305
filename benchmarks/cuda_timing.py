"""Timing shared by the benchmark scripts (imported as a sibling module: run them as `python benchmarks/X.py`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GIB", "measure", "time_steps", "timed"]

GIB = 2**30


def time_steps(step: Callable[[], Any], warmup: int, steps: int) -> tuple[float, int]:
    """Median seconds per step and the peak allocated CUDA bytes over the timed steps.

    Synchronises around each step: device work is asynchronous, so a host clock only measures it once
    the queue has drained.
    """
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def timed(step: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one step: CUDA events around it on the compute stream (which waits for any copy stream the step
    uses before it ends), a host clock on CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def measure(step: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> dict[str, Any]:
    """Median seconds over ``repeats`` timed steps after ``warmup`` untimed ones, every timed step's seconds, and the
    peak memory of the timed steps (allocated and reserved device bytes, pinned host bytes; None off CUDA)."""
    for _ in range(warmup):
        step()
    cuda = device.type == "cuda"
    host_stats = getattr(torch.cuda, "host_memory_stats", None) if cuda else None  # pinned allocator, torch >= 2.6
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        if host_stats is not None:
            torch.cuda.reset_peak_host_memory_stats()
    steps = [timed(step, device) for _ in range(repeats)]
    pinned = host_stats().get("allocated_bytes.peak") if host_stats is not None else None
    allocated = torch.cuda.max_memory_allocated(device) if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) if cuda else None
    return {
        "seconds": statistics.median(steps),
        "step_seconds": steps,
        "peak_allocated_gib": allocated / GIB if cuda else None,
        "peak_reserved_gib": reserved / GIB if cuda else None,
        "peak_allocated_bytes": allocated,
        "peak_reserved_bytes": reserved,
        "pinned_peak_gib": pinned / GIB if pinned is not None else None,
    }
