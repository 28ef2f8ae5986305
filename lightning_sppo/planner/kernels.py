"""Seconds of the GPU's kinds of work, each a function of what one kernel call does: the cost model's terms.

Every term is measurable on its own (``sppo-plan --calibrate`` times each, ``planner.calibrate``):

    matmul      a GEMM of M x K by K x N: 2 M N K FLOPs at rate R(M, N, K) = R_ref g(M) g(N) g(K) / g(8192)^3,
                g(x) = x / (x + t). R_ref (``HardwareProfile.mfu`` x peak) is the rate of the 8192^3 bf16 GEMM the
                calibration times; t (``gemm_tile``) is how much a dimension loses to its tiles: the last tile's
                quantisation and the K loop's prologue and epilogue. Short subsequences run smaller GEMMs slower.
    attention   one flash-attention call (forward or backward) of q queries over k keys (bottom-right causal or
                not), per kernel: the kernel runs CTAs over query tiles (forward) or key tiles (backward); a CTA
                costs its tiles plus a fixed ``cta_tiles`` (loading its tile, writing its output); the GPU runs
                ``sms x occupancy`` CTAs at once, so a call takes max(all work / slots, the longest CTA) tile
                times, a tile time being its FLOPs at ``tflops`` (``causal`` times it for causal calls). Few CTAs
                (one short subsequence, few heads) or short loops (short keys in forward, short queries in
                backward) lose efficiency; long calls approach ``tflops``.
    elementwise HBM bytes (``planner.census``: norms, RoPE, SwiGLU, casts, residual adds, the engine's K/V and dK/dV
                sums, weight-gradient casts and sums, the loss) at ``elementwise_gbps``, plus ``kernel_s`` per
                kernel (the ramp and tail a small kernel does not hide).
    host        every op costs the host ``host_op_s`` (Python, the dispatcher, the launch). A pass takes the longer
                of its device work and its host work: the GPU cannot run ahead of the ops it is given.
    copies      bytes over PCIe at ``d2h_gbps`` / ``h2d_gbps``; copies on one stream (the offloader's, the K/V
                spill's) run one after another, both directions sharing its time.
    optimizer   AdamW reads p, g, m, v and writes p, m, v: 28 bytes per fp32 parameter, on the device at
                ``elementwise_gbps``, on the host at ``host_optimizer_bytes_per_s``.

These are plain functions of a profile, so a new engine order (the lead's layer-major order, say) can charge its
own calls: ``attention_seconds`` for each (queries, keys) block, ``matmul_seconds`` for each pass of the block's
weights over a token count, ``elementwise_seconds`` for its bytes and ops, ``host_seconds`` for its ops.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = [
    "ATTENTION_KERNELS",
    "AttentionKernel",
    "AttentionRates",
    "GEMM_REFERENCE",
    "attention_seconds",
    "block_gemms",
    "copy_seconds",
    "gemm_rate",
    "matmul_seconds",
]

ATTENTION_KERNELS = ("flash", "cudnn", "efficient", "math", "reference")
"""Attention kernel families: ``flash`` (FlashAttention-2: ATen's flash op, the engine's "sdpa" backend on half
types, and the flash-attn package), ``cudnn`` (cuDNN's fused attention), ``efficient`` (ATen's memory-efficient
kernel), ``math`` (SDPA's unfused fallback), ``reference`` (pure PyTorch, CPU). The built-in profiles rate the first
two; a call of a kernel a profile does not rate is timed by its FLOPs (``CostModel.attention_call``)."""
GEMM_REFERENCE = 8192
"""The calibration's GEMM is GEMM_REFERENCE^3: ``HardwareProfile.mfu`` is its rate over the peak."""


@dataclass(frozen=True, kw_only=True)
class AttentionRates:
    """One attention kernel in one direction (module docstring)."""

    tflops: float
    """TFLOP/s of a long non-causal call, all SMs busy (forward: 4 q k Dh FLOPs per head; backward: 2.5x that)."""
    cta_tiles: float = 2.0
    """Fixed cost of one CTA, in tiles: loading its own tile, the softmax's end, writing its output."""
    causal: float = 1.0
    """Rate of a causal call's tiles over a non-causal call's (masking, the diagonal tiles' imbalance)."""
    tile_q: int = 128
    tile_k: int = 128
    occupancy: int = 1
    """CTAs one SM runs at once."""

    def __post_init__(self) -> None:
        for name in ("tflops", "causal"):
            if not getattr(self, name) > 0:
                raise ValueError(f"AttentionRates.{name} must be > 0, got {getattr(self, name)!r}.")
        if not self.cta_tiles >= 0 or self.tile_q < 1 or self.tile_k < 1 or self.occupancy < 1:
            raise ValueError(f"AttentionRates: cta_tiles >= 0, tiles and occupancy >= 1, got {self!r}.")


@dataclass(frozen=True, kw_only=True)
class AttentionKernel:
    """A kernel's forward and backward rates, and where they come from."""

    forward: AttentionRates
    backward: AttentionRates
    source: str = ""
    """Measured (``sppo-plan --calibrate``, the date and torch version), or what they are inferred from."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "attention") -> AttentionKernel:
        try:
            return cls(
                forward=AttentionRates(**data["forward"]), backward=AttentionRates(**data["backward"]),
                source=str(data.get("source", "")),
            )  # fmt: skip
        except (KeyError, TypeError) as error:
            raise ValueError(
                f"{where}: an attention kernel needs 'forward' and 'backward' rates ({AttentionRates.__doc__}); {error}"
            ) from error


def attention_seconds(
    rates: AttentionRates, queries: int, keys: int, causal: bool, *, heads: int, head_size: int, batch: int = 1,
    sms: int, backward: bool = False,
) -> float:  # fmt: skip
    """Seconds of one attention call: ``queries`` over ``keys`` (``causal``: bottom-right aligned, so the last query
    sees every key), ``heads`` query heads of ``head_size``, ``batch`` rows, on ``sms`` SMs (module docstring)."""
    if queries <= 0 or keys <= 0:
        return 0.0
    work, longest, ctas = _cta_work(queries, keys, causal, rates.tile_q, rates.tile_k, rates.cta_tiles, backward)
    per_cta = work / ctas  # mean tiles of one CTA including its fixed cost
    slots = sms * rates.occupancy
    total = batch * heads * ctas * per_cta
    tile_flops = 4.0 * rates.tile_q * rates.tile_k * head_size * (2.5 if backward else 1.0)
    rate = rates.tflops * 1e12 * (rates.causal if causal else 1.0)
    return max(total / slots, longest) * tile_flops * slots / rate


@functools.lru_cache(maxsize=2**16)
def _cta_work(
    queries: int, keys: int, causal: bool, tq: int, tk: int, c0: float, backward: bool
) -> tuple[float, float, int]:
    """(tiles of all CTAs of one head, tiles of the longest CTA, CTAs of one head), fixed costs included (cached: the
    planner asks for the same calls across sync modes, offload policies and recompute modes).

    Forward: one CTA per query tile, looping over the key tiles it sees. Backward: one per key tile, looping over the
    query tiles that see it. Bottom-right causal: query r sees keys [0, keys - queries + r]."""
    nq, nk = math.ceil(queries / tq), math.ceil(keys / tk)
    offset = keys - queries  # keys every query sees besides its own diagonal
    if not causal:
        inner = nk if not backward else nq
        outer = nq if not backward else nk
        return outer * (inner + c0), inner + c0, outer
    if not backward:  # query tile j sees keys up to offset + (j + 1) tq
        tiles = [math.ceil(max(0, min(keys, offset + (j + 1) * tq)) / tk) for j in range(nq)]
        return sum(tiles) + nq * c0, max(tiles) + c0, nq
    # key tile i is seen by the queries from max(0, i tk - offset)
    tiles = [math.ceil(max(0, queries - max(0, i * tk - offset)) / tq) for i in range(nk)]
    return sum(tiles) + nk * c0, max(tiles) + c0, nk


def gemm_rate(peak_flops: float, mfu: float, tile: float, m: float, n: float, k: float) -> float:
    """FLOP/s of an M x K by K x N GEMM (module docstring)."""

    def g(x: float) -> float:
        return x / (x + tile)

    return peak_flops * mfu * g(m) * g(n) * g(k) / g(GEMM_REFERENCE) ** 3


def matmul_seconds(
    peak_flops: float, mfu: float, tile: float, tokens: float, gemms: Sequence[tuple[int, int]], passes: int = 1
) -> float:
    """Seconds of ``passes`` GEMMs over ``tokens`` rows with each (in, out) weight of ``gemms`` (forward: 1; backward:
    2, the input gradient and the weight gradient, whose dimensions are the same three)."""
    if tokens <= 0:
        return 0.0
    return passes * sum(2.0 * tokens * i * o / gemm_rate(peak_flops, mfu, tile, tokens, i, o) for i, o in gemms)


def block_gemms(config) -> tuple[tuple[int, int], ...]:
    """(in, out) of every linear layer of one block: qkv, the attention's projection, and the MLP's."""
    d, h, g, dh, i = config.n_embd, config.n_head, config.n_query_groups, config.head_size, config.intermediate_size
    mlp = ((d, i), (d, i), (i, d)) if config.mlp == "swiglu" else ((d, i), (i, d))
    return ((d, (h + 2 * g) * dh), (h * dh, d), *mlp)


def copy_seconds(d2h_bytes: float, h2d_bytes: float, d2h_gbps: float, h2d_gbps: float) -> float:
    """Copies on one stream: each direction at its own rate, one after another (they share the stream's time)."""
    return d2h_bytes / (d2h_gbps * 1e9) + h2d_bytes / (h2d_gbps * 1e9)
