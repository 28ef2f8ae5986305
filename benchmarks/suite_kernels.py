"""The GPU suite's kernel parts: attention forward+backward TFLOP/s per backend, and a profile of engine N=1 against
the plain model.

**kernels**: every backend ``benchmarks/kernel_bench.py`` knows for the device (the engine's ATen flash and cuDNN op
pairs, flash-attn, and ``F.scaled_dot_product_attention`` with autograd as the plain model calls it, naming the backend
PyTorch picked), timed by its ``kernel_microbench`` (forward and backward apart; FLOPs as the planner counts them),
one row per backend and length, at the primary model's heads and head size, bf16, causal, one sequence. A backend
that cannot run here is a row saying why.

**profile**: one step of the plain model, of the plain model with SDPA pinned to the flash backend (FA2: the op the
engine's "sdpa" backend calls), and of engine N=1, each after one warm-up step, under ``torch.profiler`` (CUDA kernels
on a GPU, CPU ops on CPU): the top kernels by total time with their calls, the attention kernels by name, and which
kernels account for the difference between the engine and the plain model.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from gpu_checks import batch, release_memory, synchronize
from kernel_bench import available_backends, kernel_microbench
from suite_predict import attention_call_seconds
from suite_profiler import AttentionRecorder
from suite_runs import (
    ENGINE_N1,
    ENGINE_N1_SETTINGS,
    PLAIN,
    close_run,
    plain_run,
    strategy_run,
    suite_model,
)
from suite_state import Context, first_line
from torch.nn.attention import SDPBackend

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.recompute import apply_recompute

__all__ = ["decisive_kernel_rows", "predict_decisive_kernels", "run_decisive_kernels", "run_kernels", "run_profile"]

ATTENTION_NAMES = ("flash", "fmha", "cudnn", "sdpa", "attention", "attn")
"""Substrings (lower case) that mark an attention kernel or op in a profile."""
TOP = 12


# -- kernels ----------------------------------------------------------------------------------------------


def run_kernels(ctx: Context) -> None:
    """``kernel_bench.kernel_microbench`` for every backend at every length, one row at a time (so the budget is
    checked and the report written between rows), at the primary model's heads and head size."""
    config = GPTConfig.from_name(ctx.data["model"])  # shapes only: heads, groups, head size
    rows, last = ctx.data["kernels"], {}
    shape = dict(heads=config.n_head, groups=config.n_query_groups, head_size=config.head_size)
    for seq_len in ctx.sizes.kernel_seq_lens:
        for backend in available_backends(ctx.device):
            row = {"backend": backend, "seq_len": seq_len, **shape, "dtype": "bfloat16", "source": "kernel_bench"}
            steps = 1 + ctx.sizes.repeats
            needed = last[backend][1] * (seq_len / last[backend][0]) ** 2 * steps if backend in last else 0.0
            if not ctx.budget.affords(needed + ctx.sizes.cell_overhead_s):
                row["status"] = f"skipped (time budget: ~{needed:.0f} s needed, {ctx.budget.left():.0f} s left)"
            else:
                with AttentionRecorder(ctx.device) as recorder:
                    (timed,) = kernel_microbench([seq_len], ctx.device, backends=[backend], repeats=ctx.sizes.repeats,
                                                 **shape)  # fmt: skip
                row |= _suite_row(timed) | recorder.record.to_dict()
                release_memory(ctx.device)
            if row["status"] == "ok":
                last[backend] = (seq_len, row["seconds"])
            rows.append(row)
            ctx.save()
            tflops = f"{row['tflops']:.3g} TFLOP/s" if row["status"] == "ok" else row["status"]
            print(f"kernel {backend:<16} S={seq_len:>7}  {tflops}", flush=True)


def _suite_row(timed: dict[str, Any]) -> dict[str, Any]:
    """A ``kernel_microbench`` row as the suite reports it (``status``, ``seconds`` forward + backward)."""
    if timed["error"] is not None:
        return {"status": timed["error"]}
    seconds = (timed["forward_ms"] + timed["backward_ms"]) / 1e3
    keep = ("forward_ms", "backward_ms", "tflops", "tflops_forward", "tflops_backward", "picked")
    return {"status": "ok", "seconds": seconds, **{key: timed[key] for key in keep}}


# -- the decisive preset's kernels -------------------------------------------------------------------------

PLANNER_KERNEL = {"flash": "flash", "cudnn": "cudnn", "flash_attn": "flash", "cpu_flash": "flash"}
"""The planner's kernel for each backend ``kernel_bench`` times ("sdpa_autograd": the profile's SDPA pick)."""


def decisive_kernel_rows(sizes: Any) -> list[tuple[int, bool]]:
    """(S, causal) of each decisive shape: square calls at each of ``sizes.kernel_lens``, causal (a diagonal chunk of
    the layer order, or the plain model's whole call) and not (one prefix block of a later chunk)."""
    return [(seq_len, causal) for seq_len in sizes.kernel_lens for causal in (True, False)]


def _planner_seconds(config: GPTConfig, profile: Any, backend: str, seq_len: int, causal: bool) -> dict[str, Any]:
    kernel = PLANNER_KERNEL.get(backend, profile.sdpa_attention)
    forward, backward = attention_call_seconds(config, profile, kernel, seq_len, seq_len, causal)
    return {"kernel": kernel, "forward_ms": forward * 1e3, "backward_ms": backward * 1e3}


def predict_decisive_kernels(sizes: Any, profile: Any, backends: list[str]) -> float:
    """Seconds of part b: per backend and shape, one warm-up call pair and ``kernel_repeats`` timed, as the planner
    predicts them, plus a fixed cost per row."""
    config = GPTConfig.from_name(sizes.model)
    total = 0.0
    for seq_len, causal in decisive_kernel_rows(sizes):
        for backend in backends:
            p = _planner_seconds(config, profile, backend, seq_len, causal)
            total += (1 + sizes.kernel_repeats) * (p["forward_ms"] + p["backward_ms"]) / 1e3
            total += sizes.overheads.kernel_row_s
    return total


def run_decisive_kernels(ctx: Context) -> None:
    """Part b: every backend ``kernel_bench`` offers here, at each decisive shape, the primary model's heads: the
    kernels it ran (profiled through the warm-up and timed calls), TFLOP/s, and the planner's prediction beside."""
    config = GPTConfig.from_name(ctx.data["model"])
    profile, source = ctx.cache["planner"].profile, ctx.cache["planner"].source
    shape = dict(heads=config.n_head, groups=config.n_query_groups, head_size=config.head_size)
    for seq_len, causal in decisive_kernel_rows(ctx.sizes):
        for backend, why in available_backends(ctx.device).items():
            row = {"backend": backend, "seq_len": seq_len, "causal": causal, **shape, "dtype": "bfloat16"}
            planned = _planner_seconds(config, profile, backend, seq_len, causal)
            row["prediction"] = planned | {"profile": source}
            needed = (1 + ctx.sizes.kernel_repeats) * (planned["forward_ms"] + planned["backward_ms"]) / 1e3
            if why is not None:
                row["status"] = f"n/a: {why}"
            elif not ctx.budget.affords(needed + ctx.sizes.overheads.kernel_row_s):
                row["status"] = f"skipped (predicted {needed:.0f} s, {ctx.budget.left():.0f} s left in the part)"
            else:
                with AttentionRecorder(ctx.device) as recorder:
                    (timed,) = kernel_microbench([seq_len], ctx.device, backends=[backend], causal=causal,
                                                 repeats=ctx.sizes.kernel_repeats, **shape)  # fmt: skip
                row |= _suite_row(timed) | recorder.record.to_dict()
                if row["status"] == "ok":
                    row["prediction"]["tflops"] = (timed["flops_forward"] + timed["flops_backward"]) / (
                        (planned["forward_ms"] + planned["backward_ms"]) / 1e3) / 1e12  # fmt: skip
                release_memory(ctx.device)
            ctx.data["kernels"].append(row)
            ctx.save()
            tflops = f"{row['tflops']:.3g} TFLOP/s [{row['attention']}]" if row["status"] == "ok" else row["status"]
            print(f"kernel {backend:<14} S={seq_len:>7} {'causal' if causal else 'full  '}  {tflops}", flush=True)


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
