"""What ``model_state="host"`` costs on the CPU: one AdamW step over fp32 parameters in host memory.

AdamW reads p, g, m, v and writes p, m, v: 28 bytes per parameter, so the step is bound by host memory bandwidth.
This times ``torch.optim.AdamW`` on this machine's CPU, in its three implementations (foreach, per-tensor, and
fused: one pass over memory, far faster on a CPU), and reports seconds per step and the bytes per second that
implies; the planner's ``host_optimizer_bytes_per_s`` is that figure for a GPU server's CPU share. Build the
optimizer with ``fused=True`` for ``model_state="host"``: it takes FSDP2's host DTensors.

Run:  python benchmarks/cpu_optimizer_step.py --params 50e6 --out benchmarks/results/cpu_optimizer_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

BYTES_PER_PARAM = 28
"""fp32 AdamW: reads parameter, gradient and two moments (16 B), writes parameter and two moments (12 B)."""


IMPLEMENTATIONS: dict[str, dict[str, bool]] = {
    "foreach": {"foreach": True},
    "for-loop": {"foreach": False},
    "fused": {"fused": True},
}
"""AdamW's keyword arguments per implementation."""


def time_step(num_params: int, repeats: int, implementation: str) -> list[float]:
    chunk = 1 << 22  # tensors of 4M elements, like a model's weight matrices
    params = [torch.zeros(min(chunk, num_params - i), requires_grad=True) for i in range(0, num_params, chunk)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, **IMPLEMENTATIONS[implementation])
    optimizer.step()  # allocates the moments
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    n = int(args.params)
    rows = []
    for implementation in IMPLEMENTATIONS:
        seconds = statistics.median(time_step(n, args.repeats, implementation))
        rate = BYTES_PER_PARAM * n / seconds
        rows.append({"implementation": implementation, "params": n, "seconds": seconds, "bytes_per_s": rate})
        print(f"AdamW {implementation}: {n:.3g} params, {seconds:.3f} s/step, {rate / 1e9:.2f} GB/s")
    report = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
