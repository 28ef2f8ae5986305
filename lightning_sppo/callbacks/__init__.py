"""Callbacks: training metrics (throughput, MFU, memory, offloaded bytes, pipeline bubble, planner predictions)
and checkpoints."""

from lightning_sppo.callbacks.checkpoint import SPPOCheckpoint
from lightning_sppo.callbacks.mfu import peak_flops_per_second, training_flops_per_token
from lightning_sppo.callbacks.reduction import reduce_over_ranks
from lightning_sppo.callbacks.throughput import SPPOMetrics, ThroughputWindow

__all__ = [
    "SPPOCheckpoint",
    "SPPOMetrics",
    "ThroughputWindow",
    "peak_flops_per_second",
    "reduce_over_ranks",
    "training_flops_per_token",
]
