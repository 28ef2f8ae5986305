"""What ``kv_grad_dtype="bf16"`` costs in accuracy: dK/dV error against fp64 attention as N grows.

Subsequence attention in bf16 (q, k, v rounded to bf16, as under bf16-mixed) runs forward 0..N-1 and
backward N-1..0 over one K/V cache whose dK/dV accumulators are fp32 (the default) or bf16, and the
gradients are compared with dense fp64 attention on the same bf16 inputs. Every subsequence adds its
contribution to all earlier ones, so bf16 accumulators round N times where fp32 ones round once.
Rounding does not depend on the device; the numbers come from the CPU.

Run:  python benchmarks/kv_grad_precision.py                    # S=2048, N in 1 4 16 64 256
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch
from torch import Tensor

from lightning_sppo.attention import KV_GRAD_DTYPES, KVCache, SDPAKernel, subsequence_attention
from lightning_sppo.partition import spans as to_spans

RESULTS = Path(__file__).parent / "results"


def subsequence_gradients(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, n: int, grad_dtype) -> list[Tensor]:
    """dq, dk, dv of causal attention computed as ``n`` equal subsequences over one cache."""
    cache = KVCache(q.shape[2], grad_dtype=grad_dtype)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    spans = to_spans([q.shape[2] // n] * n)
    outs = [subsequence_attention(*(x[:, :, o : o + s] for x in leaves), cache, o, SDPAKernel()) for o, s in spans]
    for (o, s), out in reversed(list(zip(spans, outs, strict=True))):
        out.backward(dout[:, :, o : o + s])
    return [x.grad for x in leaves]


def dense_gradients(q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> list[Tensor]:
    """The fp64 reference: one causal softmax over the whole sequence."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout.double())
    return [x.grad for x in leaves]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("-n", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    args = parser.parse_args()

    torch.manual_seed(0)
    shape = (1, args.heads, args.seq_len, args.head_size)
    q, k, v, dout = (torch.randn(shape).to(torch.bfloat16) for _ in range(4))
    reference = dense_gradients(q, k, v, dout)
    rows = []
    for n in args.n:
        row = {"n": n}
        for name, grad_dtype in KV_GRAD_DTYPES.items():
            grads = subsequence_gradients(q, k, v, dout, n, grad_dtype)
            for label, got, want in zip(("dq", "dk", "dv"), grads, reference, strict=True):
                row[f"{label}_{name}"] = ((got.double() - want).norm() / want.norm()).item()
        rows.append(row)

    header = "| N | dq | dK fp32 | dK bf16 | dV fp32 | dV bf16 |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["dq_fp32"], r["dk_fp32"], r["dk_bf16"], r["dv_fp32"], r["dv_bf16"]]
        lines.append(f"| {r['n']} | " + " | ".join(f"{c:.2e}" for c in cells) + " |")
    table = "\n".join(lines)
    print(table)

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "device": "cpu",
        "shape": list(shape),
        "metric": "relative Frobenius error against fp64 dense attention on the same bf16 inputs",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_grad_precision.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    command = "python benchmarks/kv_grad_precision.py"
    intro = f"dK/dV accumulators in fp32 vs bf16 ({meta['date']}, torch {meta['torch']}, CPU), q/k/v {shape} bf16."
    (RESULTS / "kv_grad_precision.md").write_text(f"# {intro}\n\nCommand: `{command}`. {meta['metric']}.\n\n{table}\n")


if __name__ == "__main__":
    main()
