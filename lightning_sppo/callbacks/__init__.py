"""Callbacks: training metrics (throughput, MFU, memory, pipeline bubble, offload bytes)."""

from lightning_sppo.callbacks.throughput import SPPOMetrics, peak_flops_per_second, training_flops_per_token

__all__ = ["SPPOMetrics", "peak_flops_per_second", "training_flops_per_token"]
