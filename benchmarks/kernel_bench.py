"""Attention kernel microbenchmark: forward + backward TFLOP/s of every available backend, causal, per length.

One attention call of q [B, H, S, Dh] against k, v [B, G, S, Dh] (square, causal; the layouts the model produces:
views of sequence-major memory), forward then backward, timed apart (CUDA events on a GPU, the wall clock on CPU),
median of ``repeats`` after one warm-up. FLOPs are counted as ``lightning_sppo.planner.flops`` counts them: forward
4 B H Dh x pairs, pairs = S (S / 2) (the causal half, each (query, key) pair once), backward 2.5 x forward; no
credit for recomputation. Backends:

* ``flash``: ATen's flash op pair as the engine calls it (``SDPAKernel``, log-sum-exp out and back in);
* ``cudnn``: ATen's cuDNN attention op pair as the engine calls it (``CudnnKernel``), where its self-probe passed;
* ``flash_attn``: flash-attn 2, where it imports;
* ``sdpa_autograd``: ``F.scaled_dot_product_attention`` and its autograd, what the plain model runs (the row says
  which backend PyTorch picked);
* on CPU: ``cpu_flash`` (ATen's CPU flash op pair) and ``sdpa_autograd``.

A row that cannot run says why (``error``: out of memory, not available, over the time budget) instead of a number.

    python benchmarks/kernel_bench.py --seq-lens 16384 32768 65536 131072    # one GPU, bf16, H=16, Dh=128
    python benchmarks/kernel_bench.py --quick                                # CPU, tiny sizes (the same code)

``benchmarks/gpu_suite.py`` calls ``kernel_microbench`` for its kernel table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sppo.attention import SDPAKernel, select_kernel
from lightning_sppo.attention.kernels import cudnn_status, flash_attn_status
from lightning_sppo.planner.flops import ATTENTION_BACKWARD_FACTOR, attention_pairs

__all__ = ["attention_call_flops", "available_backends", "kernel_microbench"]

GPU_BACKENDS = ("flash", "cudnn", "flash_attn", "sdpa_autograd")
CPU_BACKENDS = ("cpu_flash", "sdpa_autograd")


def attention_call_flops(
    batch: int, heads: int, seq_len: int, head_size: int, causal: bool = True
) -> tuple[float, float]:
    """(forward, backward) FLOPs of one square attention call (causal: the lower half), as
    ``planner.flops.attention_flops`` counts a layer's: 4 pairs H Dh forward, 2.5x that backward."""
    pairs = attention_pairs(seq_len, 0) if causal else float(seq_len) * seq_len
    forward = 4.0 * batch * pairs * heads * head_size
    return forward, ATTENTION_BACKWARD_FACTOR * forward


def available_backends(device: torch.device) -> dict[str, str | None]:
    """Every backend for ``device``, with None where it runs here, else why not."""
    if device.type != "cuda":
        return dict.fromkeys(CPU_BACKENDS)
    no_cudnn = cudnn_status(device)
    if no_cudnn is not None and no_cudnn.startswith("PyTorch's SDPA does not pick it"):
        no_cudnn = None  # runnable even where SDPA prefers another kernel: measured all the same
    return {"flash": None, "cudnn": no_cudnn, "flash_attn": flash_attn_status(), "sdpa_autograd": None}


def _inputs(batch: int, heads: int, groups: int, seq_len: int, head_size: int, dtype, device) -> list[Tensor]:
    """q, k, v, dout as [B, heads, S, Dh] views of [B, S, heads, Dh] memory (the projections' layout)."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = ((heads, heads), (groups, groups), (groups, groups), (heads, heads))
    return [torch.randn(batch, seq_len, n, head_size, generator=gen, device=device, dtype=dtype).transpose(1, 2)
            for n, _ in shapes]  # fmt: skip


def _kernel_call(backend: str, device: torch.device, causal: bool = True) -> Callable:
    """(q, k, v, dout) -> (run forward, run backward) for a backend that goes through the kernel interface."""
    kernel = {"flash": SDPAKernel, "cpu_flash": SDPAKernel}.get(backend)
    kernel = kernel() if kernel is not None else select_kernel(backend, device)

    def call(q, k, v, dout):
        scale, state = q.shape[-1] ** -0.5, {}

        def forward():
            state["out"] = kernel.forward(q, k, v, causal, scale)

        def backward():
            kernel.backward(dout, q, k, v, *state["out"], causal, scale)

        return forward, backward

    return call


def _autograd_call(q, k, v, dout, causal: bool = True):
    """F.scaled_dot_product_attention and its autograd (a fresh graph every forward)."""
    leaves, state = [x.detach().requires_grad_() for x in (q, k, v)], {}

    def forward():
        state["out"] = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    def backward():
        state.pop("out").backward(dout)
        for x in leaves:
            x.grad = None

    return forward, backward


def _picked(q: Tensor, k: Tensor, causal: bool = True) -> str:
    """The backend PyTorch's SDPA picks for this training call."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown"
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, k)]
        index = choose(*leaves, None, 0.0, causal, enable_gqa=q.shape[1] != k.shape[1])
    return next((b.name for b in torch.nn.attention.SDPBackend if int(b.value) == index), str(index))


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _measure(forward, backward, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds after one warm-up pair (cuDNN builds its graph, caches fill)."""
    forward()
    backward()
    times = [(_timed(forward, device), _timed(backward, device)) for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def kernel_microbench(
    seq_lens: Sequence[int],
    device: torch.device,
    *,
    backends: Sequence[str] | None = None,
    batch: int = 1,
    heads: int = 16,
    groups: int | None = None,
    head_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 3,
    budget_s: float | None = None,
    causal: bool = True,
) -> list[dict]:
    """Forward + backward TFLOP/s of each backend (default: every one for ``device``) at each length, causal (or,
    ``causal=False``, every query over every key: a prefix block of the engine's later chunks).

    One row per (backend, length): the sizes, FLOPs (``attention_call_flops``), median forward and backward
    milliseconds, TFLOP/s of each and of both, ``picked`` (for ``sdpa_autograd``: the backend PyTorch ran) and
    ``error`` (None, or why the row has no numbers). ``budget_s``: a row whose time, estimated from the backend's
    last row scaled by (S / S_last)^2, would end past the budget is skipped and says so. Shorter lengths run first.
    """
    groups = groups or heads
    status = available_backends(device)
    names = list(backends) if backends is not None else list(status)
    rows, started, last = [], time.monotonic(), {}
    for seq_len in sorted(seq_lens):
        flops = attention_call_flops(batch, heads, seq_len, head_size, causal)
        for name in names:
            row = dict(backend=name, seq_len=seq_len, batch=batch, heads=heads, groups=groups, head_size=head_size,
                       dtype=str(dtype).removeprefix("torch."), causal=causal, flops_forward=flops[0],
                       flops_backward=flops[1], forward_ms=None, backward_ms=None, tflops_forward=None,
                       tflops_backward=None, tflops=None, picked=None, error=status.get(name, "unknown backend"))  # fmt: skip
            if row["error"] is None:
                row["error"] = _over_budget(last.get(name), seq_len, repeats, budget_s, started)
            if row["error"] is None:
                row.update(
                    _run(name, seq_len, flops, device, (batch, heads, groups, head_size, dtype), repeats, causal)
                )
                if row["error"] is None:
                    last[name] = (seq_len, (row["forward_ms"] + row["backward_ms"]) / 1e3)
            rows.append(row)
    return rows


def _over_budget(last, seq_len: int, repeats: int, budget_s: float | None, started: float) -> str | None:
    if budget_s is None or last is None:
        return None
    estimate = last[1] * (seq_len / last[0]) ** 2 * (repeats + 1)
    if time.monotonic() - started + estimate > budget_s:
        return f"skipped: ~{estimate:.0f} s estimated would pass the {budget_s:.0f} s budget"
    return None


def _run(name: str, seq_len: int, flops, device: torch.device, sizes, repeats: int, causal: bool = True) -> dict:
    batch, heads, groups, head_size, dtype = sizes
    try:
        q, k, v, dout = _inputs(batch, heads, groups, seq_len, head_size, dtype, device)
        call = partial(_autograd_call, causal=causal) if name == "sdpa_autograd" else _kernel_call(name, device, causal)
        forward_s, backward_s = _measure(*call(q, k, v, dout), device, repeats)
        picked = _picked(q, k, causal) if name == "sdpa_autograd" and device.type == "cuda" else None
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return dict(forward_ms=forward_s * 1e3, backward_ms=backward_s * 1e3, tflops_forward=flops[0] / forward_s / 1e12,
                tflops_backward=flops[1] / backward_s / 1e12, tflops=sum(flops) / (forward_s + backward_s) / 1e12,
                picked=picked, error=None)  # fmt: skip


def table(rows: list[dict]) -> str:
    """Markdown: TFLOP/s forward + backward (forward / backward) per backend and length."""
    lengths = sorted({r["seq_len"] for r in rows})
    lines = ["| backend | " + " | ".join(f"S={s}" for s in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for name in dict.fromkeys(r["backend"] for r in rows):
        cells = []
        for s in lengths:
            r = next(r for r in rows if r["backend"] == name and r["seq_len"] == s)
            picked = f" [{r['picked']}]" if r["picked"] else ""
            cells.append(r["error"] if r["error"] else f"{r['tflops']:.3g} ({r['tflops_forward']:.3g} / {r['tflops_backward']:.3g}){picked}")  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--backends", nargs="+", default=None)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=None, help="K/V groups (default: heads, MHA)")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--quick", action="store_true", help="CPU, tiny sizes: the same code end to end")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    if args.quick:
        device, seq_lens, heads, head_size, repeats = torch.device("cpu"), [256, 512], 4, 32, 1
    else:
        device, seq_lens, heads, head_size, repeats = torch.device("cuda"), args.seq_lens, args.heads, args.head_size, args.repeats  # fmt: skip
    rows = kernel_microbench(seq_lens, device, backends=args.backends, heads=heads, groups=args.groups,
                             head_size=head_size, repeats=repeats, budget_s=args.budget_s)  # fmt: skip
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"attention forward + backward TFLOP/s (forward / backward), causal, bf16, {where}, torch {torch.__version__}"
    )
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
