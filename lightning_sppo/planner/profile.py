"""Hardware profiles: the numbers the cost model turns FLOPs and bytes into seconds and limits.

A profile is a plain dataclass that round-trips through JSON, so a measured profile
(``sppo-plan --calibrate``) or a hand-edited one can replace the built-in datasheet defaults.
Bandwidths are in GB/s (10^9 bytes per second), one direction, per GPU.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

__all__ = [
    "BUILTIN_PROFILES",
    "DEFAULT_HOST_BYTES_PER_NODE",
    "HardwareProfile",
    "host_share_per_gpu",
    "load_profile",
    "resolve_profile",
    "with_host_memory",
]

GIB = 2**30
TIB = 2**40
GB = 10**9
DEFAULT_HOST_BYTES_PER_NODE = 2 * TIB
"""Host memory per node of every built-in profile (a DGX A100 / H100 / H200 has 2 TB): ``--host-memory``."""
_HOST_USABLE = (7, 8)
"""The share of a node's host memory the plan may use; 1/8 stays for the OS, data loading and the page cache."""


def host_share_per_gpu(host_bytes_per_node: int, gpus_per_node: int) -> int:
    """What one GPU may use of a node's host memory: 7/8 of it, over the node's GPUs."""
    return host_bytes_per_node * _HOST_USABLE[0] // _HOST_USABLE[1] // gpus_per_node


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One GPU type in one kind of node. Every field is per GPU unless it says otherwise."""

    name: str
    """Label printed with the plan."""
    peak_bf16_tflops: float
    """Dense bf16 tensor-core peak (TFLOP/s); MFU divides by this."""
    mfu: float
    """Fraction of the peak a transformer layer's kernels reach at 2K-16K tokens (matmuls, flash attention)."""
    hbm_bytes: int
    """Device memory."""
    host_bytes_per_gpu: int
    """Host memory one GPU may use for what the plan puts there (offloaded activations, spilled K/V, model state on
    host): ``host_share_per_gpu(host_bytes_per_node, gpus_per_node)``, the node's memory less 1/8 for the OS and
    data loading, over its GPUs (``with_host_memory`` recomputes it)."""
    d2h_gbps: float
    """Device-to-host copy bandwidth from pinned memory (PCIe, effective)."""
    h2d_gbps: float
    """Host-to-device copy bandwidth into the device (PCIe, effective)."""
    intra_node_gbps: float
    """Point-to-point and all-to-all bandwidth between GPUs of one node (NVLink, effective)."""
    inter_node_gbps: float
    """Bandwidth between GPUs of different nodes (this GPU's share of the node's NICs)."""
    gpus_per_node: int
    """GPUs in one node; SP and pipeline neighbours inside a node use ``intra_node_gbps``."""
    reserved_bytes: int = 4 * GIB
    """Device memory the plan leaves free: CUDA context, NCCL buffers, allocator fragmentation."""
    host_bytes_per_node: int = 0
    """Host memory of one node (``--host-memory``), printed with the plan; 0 when a profile file gives only
    ``host_bytes_per_gpu``."""
    host_optimizer_bytes_per_s: float = 50e9
    """Memory bandwidth one GPU's share of the host CPU gives AdamW when model state lives on host
    (``model_state="host"``): the CPU step reads p, g, m, v and writes p, m, v, 28 bytes per fp32 parameter. The
    default, 50 GB/s, is a server socket's ~300-400 GB/s of DRAM bandwidth shared by 4 GPUs at a fraction of
    peak that a vectorised AdamW reaches; measure yours (``benchmarks/``) and put it in a profile file."""
    layer_overhead_s: float = 1e-4
    """Fixed time per layer and subsequence pass (kernel launches, small kernels): why very short
    subsequences lose efficiency (SPPO paper, Figure 7)."""
    hbm_gbps: float = 0.0
    """Device memory bandwidth (GB/s). Every matmul pass of a layer reads the layer's weights from HBM once, however
    short the subsequence: a matmul over m tokens per device does m FLOPs per weight byte, against the GPU's ~150-300
    FLOP/s per byte/s, so below a few hundred tokens the read, not the FLOPs, sets the pass's time. With
    ``layer_overhead_s`` it is the fixed cost of short subsequences the solver weighs against the bubble
    (``CostModel.layer_fixed_s``). 0: not charged (a profile file that does not give it)."""
    attention_mfu: float | None = None
    """Fraction of the peak the attention kernels reach, when it differs from the matmuls' ``mfu`` (flash attention
    and GEMMs do not run at the same rate; ``sppo-plan --fit-suite`` fits both from measured steps). None: ``mfu``."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name" or (f.name == "attention_mfu" and value is None):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"HardwareProfile.{f.name} must be a number >= 0, got {f.name}={value!r}.")
        for key in (
            "peak_bf16_tflops", "hbm_bytes", "d2h_gbps", "h2d_gbps", "intra_node_gbps", "inter_node_gbps",
            "host_optimizer_bytes_per_s",
        ):  # fmt: skip
            if getattr(self, key) <= 0:
                raise ValueError(f"HardwareProfile.{key} must be > 0, got {key}={getattr(self, key)!r}.")
        for key in ("mfu", "attention_mfu"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"HardwareProfile.{key} is a fraction of peak in (0, 1], got {key}={value!r}.")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"HardwareProfile.gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}.")

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s of the layers: peak * mfu."""
        return self.peak_bf16_tflops * 1e12 * self.mfu

    @property
    def attention_flops_per_s(self) -> float:
        """Achieved FLOP/s of the attention kernels: peak * attention_mfu (``mfu`` when it is not given)."""
        return self.peak_bf16_tflops * 1e12 * (self.mfu if self.attention_mfu is None else self.attention_mfu)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "profile") -> HardwareProfile:
        """Build from a JSON object; unknown or missing keys are errors that name them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown}; valid keys: {sorted(known)}.")
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"{source}: missing keys {missing}.")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile from a JSON file (as written by ``HardwareProfile.save`` or ``sppo-plan --calibrate``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--gpu={str(path)!r}: cannot read a profile JSON file ({error}).") from error
    if not isinstance(data, dict):
        raise ValueError(f"--gpu={str(path)!r}: a profile file holds one JSON object, got {type(data).__name__}.")
    return HardwareProfile.from_dict(data, source=f"--gpu={str(path)!r}")


# Datasheet figures (dense, no sparsity), NVIDIA A100 / H100 / H200 datasheets and DGX system specs:
#   A100 SXM 80GB: 312 TFLOP/s bf16, 80 GB HBM2e (81920 MiB), NVLink 3 600 GB/s both directions,
#     PCIe Gen4 x16 32 GB/s per direction (~25 GB/s effective for pinned copies); DGX A100 (640 GB):
#     2 TB host memory and 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
#   H100 SXM 80GB: 989 TFLOP/s bf16, 80 GB HBM3, NVLink 4 900 GB/s both directions, PCIe Gen5 x16
#     64 GB/s per direction (~50 GB/s effective); DGX H100: 2 TB host, 8 x 400 Gb/s NDR (50 GB/s per GPU).
#   H200 SXM: 989 TFLOP/s bf16, 141 GB HBM3e, otherwise as H100 (DGX H200: 2 TB host, 8 x 400 Gb/s NDR).
#   HBM bandwidth: A100 SXM 80GB 2039 GB/s, H100 SXM 3350 GB/s, H200 SXM 4800 GB/s.
# Effective link figures take 80% of the one-direction NVLink rate and 90% of the NIC rate; host memory
# per GPU keeps 1/8 of the node's host memory (2 TiB by default, ``--host-memory``) for the OS and data loading. mfu: FlashAttention-2 reaches about
# 50-70% of peak on A100 and 35-50% on H100 for attention, and matmul-heavy layers sit near the top of
# that range (Dao, 2023); we take 0.5 (A100) and 0.4 (H100/H200) as defaults.
_HOST_PER_GPU = host_share_per_gpu(DEFAULT_HOST_BYTES_PER_NODE, 8)
_NODE = dict(host_bytes_per_gpu=_HOST_PER_GPU, host_bytes_per_node=DEFAULT_HOST_BYTES_PER_NODE)
BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    "a100-80gb": HardwareProfile(
        name="a100-80gb", peak_bf16_tflops=312.0, mfu=0.5, hbm_bytes=80 * GIB, **_NODE,
        d2h_gbps=25.0, h2d_gbps=25.0, intra_node_gbps=240.0, inter_node_gbps=22.5, gpus_per_node=8, hbm_gbps=2039.0,
    ),
    "h100": HardwareProfile(
        name="h100", peak_bf16_tflops=989.0, mfu=0.4, hbm_bytes=80 * GIB, **_NODE,
        d2h_gbps=50.0, h2d_gbps=50.0, intra_node_gbps=360.0, inter_node_gbps=45.0, gpus_per_node=8, hbm_gbps=3350.0,
    ),
    "h200": HardwareProfile(
        name="h200", peak_bf16_tflops=989.0, mfu=0.4, hbm_bytes=141 * GB, **_NODE,
        d2h_gbps=50.0, h2d_gbps=50.0, intra_node_gbps=360.0, inter_node_gbps=45.0, gpus_per_node=8, hbm_gbps=4800.0,
    ),
}  # fmt: skip


def with_host_memory(profile: HardwareProfile, host_bytes_per_node: int) -> HardwareProfile:
    """``profile`` on nodes of ``host_bytes_per_node`` host memory: its per-GPU share recomputed."""
    if isinstance(host_bytes_per_node, bool) or not isinstance(host_bytes_per_node, int) or host_bytes_per_node < 1:
        raise ValueError(f"--host-memory must be a positive number of bytes, got {host_bytes_per_node!r}; e.g. 2T.")
    share = host_share_per_gpu(host_bytes_per_node, profile.gpus_per_node)
    return replace(profile, host_bytes_per_node=host_bytes_per_node, host_bytes_per_gpu=share)


def resolve_profile(
    spec: str, gpus_per_node: int | None = None, host_bytes_per_node: int | None = None
) -> HardwareProfile:
    """A built-in profile by name, or one loaded from a JSON path; ``gpus_per_node`` overrides the node size and
    ``host_bytes_per_node`` the node's host memory. A node's host memory is shared by its GPUs, so a built-in
    profile (or a file that gives ``host_bytes_per_node``) on a smaller node gives each GPU a larger share."""
    if spec in BUILTIN_PROFILES:
        profile = BUILTIN_PROFILES[spec]
    elif spec.endswith(".json") or Path(spec).is_file():
        profile = load_profile(spec)
    else:
        raise ValueError(f"--gpu={spec!r} is neither a built-in profile {sorted(BUILTIN_PROFILES)} nor a JSON file.")
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got --gpus-per-node={gpus_per_node}.")
        profile = replace(profile, gpus_per_node=gpus_per_node)
    node = host_bytes_per_node if host_bytes_per_node is not None else profile.host_bytes_per_node
    return with_host_memory(profile, node) if node else profile
