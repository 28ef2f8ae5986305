"""Hardware profiles: the numbers the cost model turns FLOPs and bytes into seconds and limits.

A profile is a plain dataclass that round-trips through JSON, so a measured profile
(``sppo-plan --calibrate``) or a hand-edited one can replace the built-in datasheet defaults.
Bandwidths are in GB/s (10^9 bytes per second), one direction, per GPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from lightning_sppo.planner.kernels import ATTENTION_KERNELS, AttentionKernel, AttentionRates

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
_NOT_NUMBERS = frozenset({"name", "attention", "auto_attention", "sdpa_attention", "source"})
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
    """Extra fixed time per layer and subsequence pass beyond what the terms below count (0 in the built-in profiles,
    whose host and kernel terms count launches and small kernels; profiles without those terms charge this)."""
    hbm_gbps: float = 0.0
    """Device memory bandwidth (GB/s, the datasheet's). Without ``gemm_tile``, every matmul pass of a layer reads the
    layer's weights from HBM once at this rate (the old fixed cost of short subsequences). 0: not charged."""
    attention_mfu: float | None = None
    """Attention at this fraction of the peak, as plain FLOPs, instead of the kernel model (``attention``); None: the
    kernel model, or ``mfu`` for a profile without it."""
    sms: int = 0
    """Streaming multiprocessors: the attention kernels' CTA slots (``planner.kernels``). 0: no kernel model."""
    gemm_tile: float = 0.0
    """What one GEMM dimension loses to its tiles (``planner.kernels.gemm_rate``); 0: every GEMM at ``mfu``."""
    elementwise_gbps: float = 0.0
    """HBM GB/s that elementwise kernels (norms, RoPE, casts, adds) reach; 0: their bytes are not charged."""
    kernel_s: float = 0.0
    """Device seconds a kernel costs beyond its bytes or FLOPs (its ramp and tail): what short passes pay per op."""
    host_op_s: float = 0.0
    """Host seconds per op (Python, dispatcher, launch); a pass lasts at least its ops times this."""
    host_saved_s: float = 0.0
    """Host seconds per saved tensor under the offloader's ``saved_tensors_hooks`` (pack in forward, unpack in
    backward, both Python), charged when a run offloads (``offload`` adaptive or full)."""
    copy_unit_s: float = 0.0
    """Seconds per saved tensor a copy moves beyond its bytes: the offloader issues one copy per tensor from Python
    (``pool.take``, checks, ``copy_``) and the link's setup."""
    attention: tuple[tuple[str, AttentionKernel], ...] = ()
    """Rates of each attention kernel this GPU runs (``planner.kernels.ATTENTION_KERNELS``); JSON: an object."""
    auto_attention: str = "flash"
    """The kernel the engine's ``attention="auto"`` runs here (``cudnn`` on Hopper once the runtime has it)."""
    sdpa_attention: str = "flash"
    """The kernel PyTorch's ``scaled_dot_product_attention`` picks here (the plain model's attention)."""
    allocator_slack_bytes: int = 0
    """Device bytes PyTorch's caching allocator holds beyond the live tensors at a step's peak (reserved minus
    allocated: blocks freed in one size and requested in another). Counted in a plan's device peak."""
    context_bytes: int = 0
    """Device bytes in use outside the caching allocator (CUDA context, libraries' kernels), measured; part of
    ``reserved_bytes``."""
    source: tuple[tuple[str, str], ...] = ()
    """Where each value comes from: term -> "measured ..." or "inferred ..." or "datasheet ...", and the date, device
    and torch version it was measured with; JSON: an object."""

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):  # as JSON gives it (``to_dict``)
            kernels = tuple((k, v if isinstance(v, AttentionKernel) else AttentionKernel.from_dict(v, f"attention.{k}"))
                            for k, v in self.attention.items())  # fmt: skip
            object.__setattr__(self, "attention", kernels)
        if isinstance(self.source, dict):
            object.__setattr__(self, "source", tuple((str(k), str(v)) for k, v in self.source.items()))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _NOT_NUMBERS or (f.name == "attention_mfu" and value is None):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"HardwareProfile.{f.name} must be a finite number >= 0, got {f.name}={value!r}.")
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
        for name, kernel in self.attention:
            if name not in ATTENTION_KERNELS or not isinstance(kernel, AttentionKernel):
                raise ValueError(f"HardwareProfile.attention: {name!r} is not one of {list(ATTENTION_KERNELS)}.")
        for key in ("auto_attention", "sdpa_attention"):
            if getattr(self, key) not in ATTENTION_KERNELS:
                raise ValueError(
                    f"HardwareProfile.{key} must be one of {list(ATTENTION_KERNELS)}, got {getattr(self, key)!r}."
                )

    def attention_kernel(self, name: str) -> AttentionKernel | None:
        """The rates of kernel ``name`` (None: this profile does not rate it)."""
        return dict(self.attention).get(name)

    @property
    def sources(self) -> dict[str, str]:
        return dict(self.source)

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s of the layers: peak * mfu."""
        return self.peak_bf16_tflops * 1e12 * self.mfu

    @property
    def attention_flops_per_s(self) -> float:
        """Achieved FLOP/s of the attention kernels: peak * attention_mfu (``mfu`` when it is not given)."""
        return self.peak_bf16_tflops * 1e12 * (self.mfu if self.attention_mfu is None else self.attention_mfu)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["attention"] = {name: kernel.to_dict() for name, kernel in self.attention}
        data["source"] = dict(self.source)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "profile") -> HardwareProfile:
        """Build from a JSON object; unknown or missing keys are errors that name them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown}; valid keys: {sorted(known)}.")
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"{source}: missing keys {missing}.")
        data = dict(data)
        attention = data.get("attention") or {}
        if not isinstance(attention, dict):
            raise ValueError(f"{source}: 'attention' must be an object of kernel name -> rates, got {attention!r}.")
        data["attention"] = tuple(
            (name, AttentionKernel.from_dict(value, f"{source}: attention.{name}")) for name, value in attention.items()
        )
        data["source"] = data.get("source") or {}
        try:
            return cls(**data)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{source}: {error}") from error

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def load_profile(path: str | Path, setting: str = "--gpu") -> HardwareProfile:
    """A profile from a JSON file (as written by ``HardwareProfile.save`` or ``sppo-plan --calibrate``); errors
    name ``setting``, the option that gave the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{setting}={str(path)!r}: cannot read a profile JSON file ({error}).") from error
    if not isinstance(data, dict):
        raise ValueError(f"{setting}={str(path)!r}: a profile file holds one JSON object, got {type(data).__name__}.")
    return HardwareProfile.from_dict(data, source=f"{setting}={str(path)!r}")


# Datasheet figures (dense, no sparsity), NVIDIA A100 / H100 / H200 datasheets and DGX system specs:
#   A100 SXM 80GB: 312 TFLOP/s bf16, 108 SMs, 80 GB HBM2e (81920 MiB) at 2039 GB/s, NVLink 3 600 GB/s both
#     directions, PCIe Gen4 x16 32 GB/s per direction (~25 GB/s effective for pinned copies); DGX A100 (640 GB): 2 TB
#     host memory and 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
#   H100 SXM 80GB: 989 TFLOP/s bf16, 132 SMs, 80 GB HBM3 at 3350 GB/s, NVLink 4 900 GB/s both directions, PCIe Gen5 x16
#     64 GB/s per direction; DGX H100: 2 TB host, 8 x 400 Gb/s NDR (50 GB/s per GPU).
#   H200 SXM: 989 TFLOP/s bf16, 132 SMs, 141 GB HBM3e at 4800 GB/s, otherwise as H100.
# Effective link figures take 80% of the one-direction NVLink rate and 90% of the NIC rate; host memory per GPU keeps
# 1/8 of the node's host memory (2 TiB by default, ``--host-memory``) for the OS and data loading.
#
# The h100 profile is measured where a measurement exists (``source`` says which and where from), the rest inferred;
# ``python benchmarks/h100_profile.py`` derives every inferred number and writes why (benchmarks/results/h100_profile.md).
# The h200 and a100-80gb profiles are not measured: they are the h100's, scaled by the datasheets' ratios (``source``).
_HOST_PER_GPU = host_share_per_gpu(DEFAULT_HOST_BYTES_PER_NODE, 8)
_NODE = dict(host_bytes_per_gpu=_HOST_PER_GPU, host_bytes_per_node=DEFAULT_HOST_BYTES_PER_NODE)
_H100_RUN = "one H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-26 (shared/gpu-results/h100-2026-11-26)"
_FA3_PAPER = "Shah et al. 2024 (FlashAttention-3), Figs. 5-6: H100 SXM5, head dim 128, 16K tokens, 16 heads"


def _kernel(forward: dict, backward: dict, source: str) -> AttentionKernel:
    return AttentionKernel(forward=AttentionRates(**forward), backward=AttentionRates(**backward), source=source)


# FlashAttention-2 (ATen's flash op): fitted by benchmarks/h100_profile.py to the FA3 paper's FA2 bars (forward causal
# and not, backward not causal; the backward's causal factor taken as the forward's); tiles and CTAs per SM as FA2's
# kernels for head dim 128 (forward 128 x 64, two per SM; backward 64 x 128, one).
_H100_FLASH = _kernel(
    dict(tflops=382.07, cta_tiles=2.0, causal=0.9097, tile_q=128, tile_k=64, occupancy=2),
    dict(tflops=328.81, cta_tiles=4.25, causal=0.9097, tile_q=64, tile_k=128, occupancy=1),
    f"inferred: fitted to {_FA3_PAPER} (FlashAttention-2); checked against the engine at N=1, 32K",
)
# cuDNN: the FA3 paper's cuDNN bars give the shape terms; the rates are scaled to the plain model's steps on the H100
# (plain 16K and 32K, plain + AC 16K, 64K and 128K), which ran PyTorch's SDPA, i.e. cuDNN on sm90.
_H100_CUDNN = _kernel(
    dict(tflops=676.41, cta_tiles=1.0, causal=0.8945, tile_q=128, tile_k=128, occupancy=1),
    dict(tflops=587.24, cta_tiles=6.0, causal=0.8945, tile_q=64, tile_k=128, occupancy=1),
    f"inferred: shape fitted to {_FA3_PAPER} (cuDNN), rate scaled to the plain-model rows of {_H100_RUN}",
)
_H100 = HardwareProfile(
    name="h100", peak_bf16_tflops=989.0, mfu=0.7878160450564372, hbm_bytes=85017493504, **_NODE,
    d2h_gbps=55.012494557755694, h2d_gbps=54.51617084865905, intra_node_gbps=360.0, inter_node_gbps=45.0,
    gpus_per_node=8, hbm_gbps=3350.0, layer_overhead_s=0.0, sms=132, gemm_tile=128.0, elementwise_gbps=2550.0,
    kernel_s=2e-6, host_op_s=1.637e-05, host_saved_s=6.91e-06, copy_unit_s=1.117e-05, attention=(("flash", _H100_FLASH), ("cudnn", _H100_CUDNN)),
    auto_attention="cudnn", sdpa_attention="cudnn", context_bytes=822935552, reserved_bytes=2 * GIB,
    allocator_slack_bytes=1840885760,
    source=(
        ("date", "2026-11-26"), ("device", "NVIDIA H100 80GB HBM3"), ("torch", "2.11.0+cu130"),
        ("peak_bf16_tflops", "datasheet"), ("mfu", f"measured: 8192^3 bf16 GEMM, sppo-plan --calibrate, {_H100_RUN}"),
        ("hbm_bytes", f"measured: total_memory, {_H100_RUN}"), ("context_bytes", f"measured: {_H100_RUN}"),
        ("d2h_gbps", f"measured: 1 GiB pinned copies, sppo-plan --calibrate, {_H100_RUN}"),
        ("h2d_gbps", f"measured: 1 GiB pinned copies, sppo-plan --calibrate, {_H100_RUN}"),
        ("sms", "datasheet"), ("gemm_tile", "inferred: one 128-wide tile (cuBLAS Hopper tiles), not yet measured"),
        ("elementwise_gbps", f"inferred: fitted to the plain-model rows of {_H100_RUN}"),
        ("kernel_s", "inferred: a small kernel's ramp and tail on Hopper, not yet measured"),
        *((term, "inferred: measured on the development machine's CPU (AMD EPYC, 2 shared cores, torch 2.13;"
           " benchmarks/host_overhead.py), not on the GPU's host") for term in ("host_op_s", "host_saved_s",
                                                                                  "copy_unit_s")),
        ("attention.flash", _H100_FLASH.source), ("attention.cudnn", _H100_CUDNN.source),
        ("allocator_slack_bytes", f"inferred: median reserved minus predicted allocated of the plain-model rows and"
         f" engine_vs_ac's engine rows of {_H100_RUN} (benchmarks/h100_profile.py)"),
        ("reserved_bytes", "inferred: the measured context (0.77 GiB) and NCCL's buffers"),
        ("intra_node_gbps", "datasheet: 80% of NVLink 4's one direction"), ("inter_node_gbps", "datasheet: 90% of NDR"),
    ),
)  # fmt: skip


def _scaled(base: HardwareProfile, name: str, *, peak: float, sms: int, hbm_bytes: int, hbm_gbps: float,
            note: str, **changes) -> HardwareProfile:  # fmt: skip
    """``base`` on another GPU: compute terms scaled by the peaks, HBM terms by the bandwidths (module comment)."""
    ratio, hbm = peak / base.peak_bf16_tflops, hbm_gbps / base.hbm_gbps
    attention = tuple(
        (k, AttentionKernel(forward=replace(v.forward, tflops=v.forward.tflops * ratio),
                            backward=replace(v.backward, tflops=v.backward.tflops * ratio), source=f"scaled: {note}"))
        for k, v in base.attention
    )  # fmt: skip
    source = tuple((k, f"scaled from the h100 profile: {note}") for k, _ in base.source if k not in ("date", "torch"))
    return replace(
        base, name=name, peak_bf16_tflops=peak, sms=sms, hbm_bytes=hbm_bytes, hbm_gbps=hbm_gbps,
        elementwise_gbps=base.elementwise_gbps * hbm, attention=attention, context_bytes=0,
        source=(("device", name), *((k, v) for k, v in source if k != "device")), **changes,
    )  # fmt: skip


def _a100(profile: HardwareProfile) -> HardwareProfile:
    """FlashAttention-2 on the A100 reaches a larger share of its peak than on the H100 (Dao 2023: up to 73% forward,
    63% backward, for long sequences); cuDNN attention is not what SDPA picks there."""
    note = "not measured; FlashAttention-2's A100 peak shares (Dao 2023), the h100's shape terms"
    flash = profile.attention_kernel("flash")
    flash = AttentionKernel(
        forward=replace(flash.forward, tflops=0.73 * 312.0),
        backward=replace(flash.backward, tflops=0.63 * 312.0),
        source=f"scaled: {note}",
    )
    return replace(profile, attention=(("flash", flash),))


BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    "a100-80gb": _a100(
        _scaled(
            _H100, "a100-80gb", peak=312.0, sms=108, hbm_bytes=80 * GIB, hbm_gbps=2039.0, d2h_gbps=25.0, h2d_gbps=25.0,
            intra_node_gbps=240.0, inter_node_gbps=22.5, auto_attention="flash", sdpa_attention="flash",
            note="not measured; peak, SMs and HBM by the A100 datasheet, PCIe Gen4 ~25 GB/s",
        )
    ),
    "h100": _H100,
    "h200": _scaled(
        _H100, "h200", peak=989.0, sms=132, hbm_bytes=141 * GB, hbm_gbps=4800.0,
        note="not measured; the H100's compute, HBM3e at 4800 GB/s and 141 GB by the H200 datasheet",
    ),
}  # fmt: skip


def with_host_memory(profile: HardwareProfile, host_bytes_per_node: int) -> HardwareProfile:
    """``profile`` on nodes of ``host_bytes_per_node`` host memory: its per-GPU share recomputed."""
    if isinstance(host_bytes_per_node, bool) or not isinstance(host_bytes_per_node, int) or host_bytes_per_node < 1:
        raise ValueError(f"--host-memory must be a positive number of bytes, got {host_bytes_per_node!r}; e.g. 2T.")
    share = host_share_per_gpu(host_bytes_per_node, profile.gpus_per_node)
    return replace(profile, host_bytes_per_node=host_bytes_per_node, host_bytes_per_gpu=share)


def resolve_profile(
    spec: str, gpus_per_node: int | None = None, host_bytes_per_node: int | None = None, setting: str = "--gpu"
) -> HardwareProfile:
    """A built-in profile by name, or one loaded from a JSON path; ``gpus_per_node`` overrides the node size and
    ``host_bytes_per_node`` the node's host memory. A node's host memory is shared by its GPUs, so a built-in
    profile (or a file that gives ``host_bytes_per_node``) on a smaller node gives each GPU a larger share."""
    if spec in BUILTIN_PROFILES:
        profile = BUILTIN_PROFILES[spec]
    elif spec.endswith(".json") or Path(spec).is_file():
        profile = load_profile(spec, setting)
    else:
        raise ValueError(
            f"{setting}={spec!r} is neither a built-in profile {sorted(BUILTIN_PROFILES)} nor a JSON file."
        )
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got --gpus-per-node={gpus_per_node}.")
        profile = replace(profile, gpus_per_node=gpus_per_node)
    node = host_bytes_per_node if host_bytes_per_node is not None else profile.host_bytes_per_node
    return with_host_memory(profile, node) if node else profile
