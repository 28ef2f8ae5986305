"""Callbacks: training metrics (throughput, MFU, memory, pipeline bubble, offload bytes) and checkpoints."""

from lightning_sppo.callbacks.checkpoint import SPPOCheckpoint
from lightning_sppo.callbacks.throughput import SPPOMetrics, peak_flops_per_second, training_flops_per_token

__all__ = ["SPPOCheckpoint", "SPPOMetrics", "peak_flops_per_second", "training_flops_per_token"]
