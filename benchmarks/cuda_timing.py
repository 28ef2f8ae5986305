"""Timing shared by the benchmark scripts (imported as a sibling module: run them as `python benchmarks/X.py`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["time_steps"]


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
