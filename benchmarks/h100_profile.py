"""Where the built-in h100 profile's inferred numbers come from: derived here, never fitted to the engine's rows.

    python benchmarks/h100_profile.py        # prints the numbers; writes benchmarks/results/h100_profile.{json,md}

Measured on the H100 itself (``shared/gpu-results/h100-2026-11-26/profile.json``, ``sppo-plan --calibrate``): the
8192^3 bf16 GEMM's rate (``mfu``), pinned copies both ways, the device's memory and the CUDA context. Not measured
there yet, so inferred here, each from data that is not the engine's rows the planner is checked against:

1. **Attention kernels' shape terms** (``planner.kernels.AttentionRates``): the FlashAttention-3 paper's H100 bars
   (Shah et al. 2024, Figs. 5 and 6: H100 SXM5, head dim 128, 16 heads, 16K tokens per batch) for FlashAttention-2
   and cuDNN, forward causal and not, backward not causal, turned into call times and fitted by the same function
   ``sppo-plan --calibrate`` fits its own measurements with (``planner.calibrate.fit_rates``); the backward's causal
   factor is the forward's (the paper has no causal backward bars).
2. **cuDNN's rate and the elementwise HBM rate**: two numbers fitted together to the plain model's steps, which ran
   PyTorch's SDPA (cuDNN on sm90): plain at 16K and 32K, plain + AC at 16K, 64K and 128K (five rows, least squares on
   relative step-time errors over a grid). cuDNN in torch 2.11 is newer than the paper's, so its rates are scaled
   by one factor; FlashAttention-2 (ATen's op, unchanged for years) keeps the paper's.
3. **Host seconds per op, per saved tensor, per offloaded unit**: ``benchmarks/host_overhead.py`` on the development
   machine's CPU (``results/host_overhead.json``), not on the GPU's host.
4. **The allocator's slack**: the median of measured reserved minus predicted allocated bytes over the same five
   plain rows and the engine's rows of ``engine_vs_ac.jsonl`` (not the suite's 12 engine rows).

The engine's rows (the suite's 12 at 16K, ``engine_vs_ac.jsonl``'s at 32K and 64K) are the check of the profile
(``benchmarks/planner_vs_gpu.py``), not an input.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from lightning_sppo.planner.calibrate import fit_rates
from lightning_sppo.planner.fit import Suite, check_suite
from lightning_sppo.planner.kernels import AttentionKernel, AttentionRates
from lightning_sppo.planner.profile import BUILTIN_PROFILES, HardwareProfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_vs_gpu import suites  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
SMS, HEADS, HEAD_SIZE, TOKENS = 132, 16, 128, 16384
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
PAPER = {  # TFLOP/s, FlashAttention-3 paper Figs. 5-6 (causal counts half the pairs, backward 2.5x the forward)
    ("flash", "forward", False): (309, 350, 362, 368, 370, 370),
    ("flash", "forward", True): (191, 260, 298, 319, 333, 335),
    ("flash", "backward", False): (214, 260, 291, 310, 318, 322),
    ("cudnn", "forward", False): (497, 574, 617, 609, 600, 595),
    ("cudnn", "forward", True): (315, 410, 484, 518, 529, 539),
    ("cudnn", "backward", False): (305, 408, 465, 499, 518, 516),
}
TILES = {  # (tile_q, tile_k, CTAs per SM): FlashAttention-2's head-dim-128 kernels; cuDNN's Hopper kernels
    ("flash", "forward"): (128, 64, 2), ("flash", "backward"): (64, 128, 1),
    ("cudnn", "forward"): (128, 128, 1), ("cudnn", "backward"): (64, 128, 1),
}  # fmt: skip
PLAIN_ROWS = ("plain", "plain + AC")


def paper_calls(kernel: str, direction: str) -> list[tuple]:
    """The paper's bars as calls (queries, keys, causal, backward, batch, heads, head size, seconds)."""
    calls = []
    for (name, way, causal), rates in PAPER.items():
        if (name, way) != (kernel, direction):
            continue
        for length, tflops in zip(LENGTHS, rates, strict=True):
            batch = TOKENS // length
            pairs = length * length / (2 if causal else 1)
            flops = 4 * pairs * HEADS * HEAD_SIZE * batch * (2.5 if way == "backward" else 1)
            calls.append((length, length, causal, way == "backward", batch, HEADS, HEAD_SIZE, flops / (tflops * 1e12)))
    return calls


def paper_kernel(kernel: str) -> AttentionKernel:
    """A kernel's rates fitted to the paper's bars (the backward's causal factor: the forward's)."""
    rates = {}
    for direction in ("forward", "backward"):
        tile_q, tile_k, occupancy = TILES[kernel, direction]
        start = AttentionRates(tflops=1.0, tile_q=tile_q, tile_k=tile_k, occupancy=occupancy)
        rates[direction] = fit_rates(paper_calls(kernel, direction), SMS, start)
    backward = replace(rates["backward"], causal=rates["forward"].causal)
    return AttentionKernel(forward=rates["forward"], backward=backward, source="fitted to the FA3 paper")


def _scaled(kernel: AttentionKernel, factor: float) -> AttentionKernel:
    return replace(
        kernel, forward=replace(kernel.forward, tflops=kernel.forward.tflops * factor),
        backward=replace(kernel.backward, tflops=kernel.backward.tflops * factor),
    )  # fmt: skip


def plain_suite() -> Suite:
    """The timed plain-model rows of every GPU result (the five of 2026-11-26)."""
    runs = [r for suite in suites() for r in suite.runs if r.name in PLAIN_ROWS and r.timed]
    return Suite(tuple(runs))


def plain_rows(profile: HardwareProfile, rows: Suite | None = None) -> list:
    return list(check_suite(rows or plain_suite(), profile))


def fit_plain(base: HardwareProfile, cudnn: AttentionKernel) -> tuple[float, float, float]:
    """(cuDNN scale, elementwise GB/s, rms relative error) fitted to the plain rows over a grid."""
    rows = plain_suite()
    best = None
    for scale in [0.80 + 0.01 * i for i in range(51)]:
        for gbps in range(1500, 3351, 25):
            kernels = tuple((k, _scaled(cudnn, scale) if k == "cudnn" else v) for k, v in base.attention)
            profile = replace(base, attention=kernels, elementwise_gbps=float(gbps))
            errors = [f.time_error for f in plain_rows(profile, rows)]
            rms = (sum(e * e for e in errors) / len(errors)) ** 0.5
            if best is None or rms < best[2]:
                best = (scale, float(gbps), rms)
    return best


def main() -> int:
    base = BUILTIN_PROFILES["h100"]
    flash, cudnn = paper_kernel("flash"), paper_kernel("cudnn")
    start = replace(base, attention=(("flash", flash), ("cudnn", cudnn)))
    scale, gbps, rms = fit_plain(start, cudnn)
    fitted = replace(start, attention=(("flash", flash), ("cudnn", _scaled(cudnn, scale))), elementwise_gbps=gbps)
    host = json.loads((OUT / "host_overhead.json").read_text())
    engine_rows = [
        f for suite in suites() if "engine_vs_ac" in suite.runs[0].source for f in check_suite(suite, fitted)
    ]
    slack_rows = plain_rows(fitted) + [f for f in engine_rows if f.run.timed]
    slack = statistics.median(f.run.peak_bytes - f.predicted.allocated_bytes for f in slack_rows)
    result = {
        "flash": flash.to_dict(), "cudnn": _scaled(cudnn, scale).to_dict(), "cudnn_scale": scale,
        "elementwise_gbps": gbps, "plain_rows_rms": rms, "host": host, "allocator_slack_bytes": int(slack),
        "plain_rows": [(f.run.label, f.run.step_s, f.predicted.step_s) for f in plain_rows(fitted)],
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "h100_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
