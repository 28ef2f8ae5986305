"""Two-level activation management (SPPO section 5).

Level 1, the K/V cache and its gradient buffers, stays on the device (``lightning_sppo.attention``). Level 2,
everything else a subsequence saves for backward, is captured by ``saved_tensors_hooks`` and a share
alpha_i of it goes to host memory while the next subsequence computes (``Offloader``). Importing this
package fills the ``"adaptive"`` partition policy (the flops partition until costs are known).

Modules: ``policy`` (alpha rule, memory dynamics, adaptive partition), ``units`` (what is saved and how
it is grouped), ``pool`` (host buffers), ``streams`` (copies and events), ``offloader`` (the hooks),
``callback`` (per-step reporting).
"""

from lightning_sppo.offload.callback import OffloadCallback
from lightning_sppo.offload.offloader import (
    DEFAULT_MIN_BYTES,
    Offloader,
    OffloadStats,
    SubsequenceStats,
    build_offloader,
)
from lightning_sppo.offload.policy import (
    OFFLOAD_POLICIES,
    AdaptivePartition,
    OffloadCosts,
    OffloadPolicy,
    adaptive_alpha,
    adaptive_partition,
    alphas,
    memory_dynamics,
    peak_saved_bytes,
)
from lightning_sppo.offload.pool import HostMemoryError, HostPool, available_host_bytes, check_host_memory
from lightning_sppo.partition import register_partition_policy

register_partition_policy("adaptive", adaptive_partition)

__all__ = [
    "DEFAULT_MIN_BYTES",
    "OFFLOAD_POLICIES",
    "AdaptivePartition",
    "HostMemoryError",
    "HostPool",
    "OffloadCallback",
    "OffloadCosts",
    "OffloadPolicy",
    "OffloadStats",
    "Offloader",
    "SubsequenceStats",
    "adaptive_alpha",
    "adaptive_partition",
    "alphas",
    "available_host_bytes",
    "build_offloader",
    "check_host_memory",
    "memory_dynamics",
    "peak_saved_bytes",
]
