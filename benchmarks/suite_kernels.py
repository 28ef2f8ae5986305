"""The GPU suite's kernel parts: attention forward+backward TFLOP/s per backend, and a profile of engine N=1 against
the plain model.

**kernels**: every backend ``lightning_sppo.attention.kernels`` offers (``KERNEL_NAMES`` but "auto" and "reference",
so a backend added there is timed here without a change), each through its own forward/backward with the
log-sum-exp, plus ``F.scaled_dot_product_attention`` with autograd as the plain model calls it (PyTorch's own
backend choice, named in the row), at the primary model's heads and head size, bf16, causal, one sequence, q/k/v laid
out as the model makes them ([B, S, heads, Dh] memory). A backend that cannot run here is a row saying why.
TFLOP/s counts 7 B H Dh S^2 per forward+backward: the causal half of the square, forward 2 matmuls, backward 5
(2.5x the forward), as FlashAttention's benchmarks count.

The ``kernel`` helper's ``benchmarks/kernel_bench.py`` is used when it is there and has
``attention_fwd_bwd(backend, seq_len, *, device, heads, groups, head_size, dtype, warmup, repeats) -> dict`` (with
``seconds`` and ``tflops``); otherwise, or when that call fails, the suite's own timing below runs, and each row
names which one measured it (``source``).

**profile**: one step of the plain model, of the plain model with SDPA pinned to the flash backend (FA2: the op the
engine's "sdpa" backend calls), and of engine N=1, each after one warm-up step, under ``torch.profiler`` (CUDA kernels
on a GPU, CPU ops on CPU): the top kernels by total time with their calls, the attention kernels by name, and which
kernels account for the difference between the engine and the plain model.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from cuda_timing import measure
from gpu_checks import batch, release_memory, synchronize
from suite_runs import (
    ENGINE_N1,
    ENGINE_N1_SETTINGS,
    PLAIN,
    close_run,
    describe_kernel,
    plain_run,
    sdpa_backend,
    strategy_run,
    suite_model,
)
from suite_state import Context, first_line
from torch.nn.attention import SDPBackend

from lightning_sppo.attention.kernels import KERNEL_NAMES, select_kernel
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.recompute import apply_recompute

try:  # the kernel helper's microbenchmark, once it exists; a broken one must not stop the suite
    import kernel_bench
except Exception as error:
    kernel_bench, KERNEL_BENCH_MISSING = None, f"{type(error).__name__}: {str(error)[:120]}"
else:
    KERNEL_BENCH_MISSING = "" if hasattr(kernel_bench, "attention_fwd_bwd") else "no attention_fwd_bwd in it"

__all__ = ["run_kernels", "run_profile"]

SDPA_CALL = "F.scaled_dot_product_attention"
ATTENTION_NAMES = ("flash", "fmha", "cudnn", "sdpa", "attention", "attn")
"""Substrings (lower case) that mark an attention kernel or op in a profile."""
TOP = 12


# -- kernels ----------------------------------------------------------------------------------------------


def attention_flops(heads: int, head_size: int, seq_len: int, batch_size: int = 1) -> float:
    """Forward+backward FLOPs of causal attention: 2 B H Dh S^2 forward (two matmuls over half the square), 2.5x
    that backward."""
    return 7.0 * batch_size * heads * head_size * seq_len**2


def backends() -> list[str]:
    """The backends the kernels module offers (a new one appears here by itself), and the plain model's call."""
    return [name for name in KERNEL_NAMES if name not in ("auto", "reference")] + [SDPA_CALL]


def run_kernels(ctx: Context) -> None:
    config = GPTConfig.from_name(ctx.data["model"])  # shapes only: heads, groups, head size
    rows, last = ctx.data["kernels"], {}
    dtype = torch.bfloat16
    for seq_len in ctx.sizes.kernel_seq_lens:
        for backend in backends():
            row = {"backend": backend, "seq_len": seq_len, "heads": config.n_head, "groups": config.n_query_groups,
                   "head_size": config.head_size, "dtype": "bfloat16"}  # fmt: skip
            steps = ctx.sizes.warmup + ctx.sizes.repeats
            needed = last[backend][1] * (seq_len / last[backend][0]) ** 2 * steps if backend in last else 0.0
            if not ctx.budget.affords(needed + ctx.sizes.cell_overhead_s):
                row["status"] = f"skipped (time budget: ~{needed:.0f} s needed, {ctx.budget.left():.0f} s left)"
            else:
                row |= _time_backend(ctx, backend, seq_len, config, dtype)
            if row["status"] == "ok":
                last[backend] = (seq_len, row["seconds"])
            rows.append(row)
            ctx.save()
            tflops = f"{row['tflops']:.3g} TFLOP/s" if row["status"] == "ok" else row["status"]
            print(f"kernel {backend:<32} S={seq_len:>7}  {tflops}", flush=True)


def _time_backend(ctx: Context, backend: str, seq_len: int, config: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    device, sizes = ctx.device, ctx.sizes
    heads, groups, dh = config.n_head, config.n_query_groups, config.head_size
    bench = getattr(kernel_bench, "attention_fwd_bwd", None)
    note = ""
    if bench is not None:
        try:
            found = bench(backend, seq_len, device=device, heads=heads, groups=groups, head_size=dh, dtype=dtype,
                          warmup=sizes.warmup, repeats=sizes.repeats)  # fmt: skip
            return {"status": "ok", "source": "kernel_bench.attention_fwd_bwd", **found}
        except Exception as error:  # its contract may differ: the suite's own timing still answers
            note = f"kernel_bench.attention_fwd_bwd failed ({type(error).__name__}: {str(error)[:120]}); "
    try:
        step, kernel = _step(backend, seq_len, config, device, dtype)
    except torch.OutOfMemoryError:
        release_memory(device)
        return {"status": "OOM"}
    except (ValueError, RuntimeError) as error:  # not available here (flash-attn missing, no CUDA)
        return {"status": "unavailable", "why": first_line(error)}
    try:
        timing = measure(step, device, sizes.warmup, sizes.repeats)
    except torch.OutOfMemoryError:
        return {"status": "OOM", "kernel": kernel}
    except RuntimeError as error:  # e.g. a backend refusing this shape: a result
        return {"status": f"error: {first_line(error, 200)}", "kernel": kernel}
    finally:
        del step
        release_memory(device)
    tflops = attention_flops(heads, dh, seq_len) / timing["seconds"] / 1e12
    why = note or (f"kernel_bench: {KERNEL_BENCH_MISSING}; " if KERNEL_BENCH_MISSING else "")
    source = why + "gpu_suite (kernel forward + backward, CUDA events)"
    return {"status": "ok", "kernel": kernel, "seconds": timing["seconds"], "tflops": tflops, "source": source,
            "peak_allocated_gib": timing["peak_allocated_gib"]}  # fmt: skip


def _inputs(seq_len: int, config: GPTConfig, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """q [B, H, S, Dh], k, v [B, G, S, Dh], dout like q: fresh random values, in the model's memory layout."""
    heads, groups, dh = config.n_head, config.n_query_groups, config.head_size
    shapes = [(1, seq_len, heads, dh), (1, seq_len, groups, dh), (1, seq_len, groups, dh), (1, seq_len, heads, dh)]
    return [torch.randn(shape, device=device, dtype=dtype).transpose(1, 2) for shape in shapes]


def _step(
    backend: str, seq_len: int, config: GPTConfig, device: torch.device, dtype: torch.dtype
) -> tuple[Callable, str]:
    """A zero-argument forward+backward of ``backend`` on fresh inputs, and the kernel it runs."""
    q, k, v, dout = _inputs(seq_len, config, device, dtype)
    scale = 1 / math.sqrt(config.head_size)
    if backend == SDPA_CALL:
        gqa = q.shape[1] != k.shape[1]
        leaves = [x.requires_grad_() for x in (q, k, v)]

        def sdpa_step() -> None:
            for x in leaves:
                x.grad = None
            F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=gqa).backward(dout)

        return sdpa_step, sdpa_backend(config, seq_len, device)
    kernel = select_kernel(backend, device)

    def kernel_step() -> None:
        out, lse = kernel.forward(q, k, v, True, scale)
        kernel.backward(dout, q, k, v, out, lse, True, scale)

    return kernel_step, describe_kernel(kernel, device, dtype)


# -- profile ----------------------------------------------------------------------------------------------

PROFILED = (PLAIN, "plain, SDPA pinned to flash (FA2)", ENGINE_N1)


def run_profile(ctx: Context) -> None:
    device, seq_len = ctx.device, ctx.sizes.profile_seq_len
    model = suite_model(ctx, ctx.data["model"])
    ids, targets = batch(model.config, seq_len, device)
    section = ctx.data["profile"] = {"model": model.config.name, "seq_len": seq_len, "runs": [], "difference": []}
    for name in PROFILED:
        ctx.budget.check()
        apply_recompute(model, "none")
        if name == ENGINE_N1:
            make = lambda: strategy_run(ENGINE_N1, ENGINE_N1_SETTINGS, model, ids, targets, device, 0)  # noqa: E731
        else:
            flash = [SDPBackend.FLASH_ATTENTION] if name != PLAIN else None
            make = lambda flash=flash, name=name: plain_run(name, model, ids, targets, device, backends=flash)  # noqa: E731
        section["runs"].append(_profile_one(name, make, device))
        model.zero_grad(set_to_none=True)
        release_memory(device)
        ctx.save()
    runs = {r["run"]: r for r in section["runs"] if r["status"] == "ok"}
    if PLAIN in runs and ENGINE_N1 in runs:
        section["difference"] = _difference(runs[ENGINE_N1], runs[PLAIN])
    ctx.save()


def _profile_one(name: str, make: Callable, device: torch.device) -> dict[str, Any]:
    row: dict[str, Any] = {"run": name}
    run = None
    try:
        run = make()
        row["attention"] = run.attention
        run.step()  # warm-up: kernels chosen, memory reserved
        synchronize(device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            run.step()
            synchronize(device)
            row["step_s"] = time.perf_counter() - started  # under the profiler: slower than the table's steps
        row |= {"status": "ok", **summarize(prof, device)}
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    except Exception as error:  # a result: e.g. no flash kernel for this shape on CPU
        row |= {"status": f"error: {type(error).__name__}", "error": first_line(error)}
    finally:
        close_run(run, row)
    print(f"profile {name}: {row['status']} {row.get('total_ms', 0):.1f} ms", flush=True)
    return row


def summarize(prof: Any, device: torch.device) -> dict[str, Any]:
    """Total time, the top kernels (CUDA) or ops (CPU) by self time with their calls, and the attention ones."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        us = _self_us(event, device)
        if us is None:
            continue
        totals[event.key][0] += us
        totals[event.key][1] += event.count
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    table = [{"name": name, "total_ms": us / 1e3, "calls": int(calls)} for name, (us, calls) in ranked]
    attention = [r for r in table if any(tag in r["name"].lower() for tag in ATTENTION_NAMES)]
    return {
        "what": "CUDA kernels" if device.type == "cuda" else "CPU ops (self time)",
        "total_ms": sum(r["total_ms"] for r in table),
        "kernels": len(table),
        "top": table[:TOP],
        "attention_kernels": attention[:TOP],
        "all": {r["name"]: [r["total_ms"], r["calls"]] for r in table},
    }


def _self_us(event: Any, device: torch.device) -> float | None:
    """An event's self time in microseconds on the device that matters: CUDA kernels on a GPU, CPU ops on CPU."""
    if device.type == "cuda":
        if event.device_type != torch.autograd.DeviceType.CUDA:
            return None
        return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))
    return float(event.self_cpu_time_total)


def _difference(engine: dict[str, Any], plain: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kernel name, the engine's time minus the plain model's, largest first: where the engine's extra time goes."""
    names = set(engine["all"]) | set(plain["all"])
    rows = []
    for name in names:
        e_ms, e_calls = engine["all"].get(name, [0.0, 0])
        p_ms, p_calls = plain["all"].get(name, [0.0, 0])
        rows.append({"name": name, "engine_ms": e_ms, "plain_ms": p_ms, "extra_ms": e_ms - p_ms,
                     "engine_calls": e_calls, "plain_calls": p_calls})  # fmt: skip
    return sorted(rows, key=lambda r: -abs(r["extra_ms"]))[:TOP]
