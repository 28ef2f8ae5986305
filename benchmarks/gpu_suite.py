"""GPU validation in one command: are the GPU paths right, and how fast are they (one GPU, ~8 minutes).

Run:  python benchmarks/gpu_suite.py --out benchmarks/results/gpu_suite            # CUDA: H100/H200, torch >= 2.11
      python benchmarks/gpu_suite.py --device cpu --quick --out /tmp/gpu_suite    # the same code, tiny sizes (CI)

Needs torch and lightning_sppo only (no flash-attn, jsonargparse or wandb; flash-attn is used when it imports).
Four parts, in this order, all in one process:

1. checks (``gpu_checks.py``): the kernels' output, log-sum-exp and dq/dk/dv (GQA and not, fp32 and bf16, square causal and
   rectangular) and whole subsequence attention over a K/V cache, against a float64 dense reference; no call
   of the O(S x S_k) reference kernel on CUDA; the engine against the plain model in fp32 and in bf16; offload
   "full" and "adaptive" (alpha between 0 and 1) bit-identical to "none" while every copy on the offloader's
   side stream is delayed (``torch.cuda._sleep``), so that a missing wait would change the gradients, with a
   negative control in which the waits are removed.
2. table: a ~1B model (``gpt-1b``, bf16 autocast) at each sequence length: plain, plain with full activation
   checkpointing, plain under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, and the engine at
   N in {1, 4, 16} with offload none / full / adaptive, and at the largest N with adaptive offload plus
   recompute selective, full, and full with K/V beyond S/4 on host. Columns: tokens/s, ratio to plain, peak
   allocated and reserved GiB, bytes on host per step (offloaded activations plus host-resident K/V), MFU.
3. longest: the longest sequence that fits for plain, checkpointing, the engine with adaptive offload, and the
   engine with adaptive offload, full recompute and all K/V on host (doubling, then bisection on multiples of a
   granule, up to a cap; an out-of-memory is a result).
4. a time budget: cells and probes that would overrun it are skipped and marked so.

Timing: warm-up steps first, then CUDA events around each timed step (perf_counter on CPU), median of the
repeats. MFU = training_flops_per_token(config, S) x tokens/s / dense bf16 peak (lightning_sppo.callbacks.
throughput: 6 P with P the matmul weights, plus causal attention 6 L S d counted once, i.e. half the square;
recomputation under checkpointing is not credited; peak 989 TFLOP/s on H100/H200, or --peak-tflops).

Writes ``gpu_suite.json`` and ``gpu_suite.md`` under ``--out``; exit status 1 when a check failed. Every engine row
of the JSON carries a ``planner`` entry (layout, partition, offload, recompute, K/V on host) beside its ``seconds`` and
``peak_reserved_bytes``, and the environment the device's ``total_memory_bytes`` and ``context_bytes``, so that
``sppo-plan --fit-suite gpu_suite.json --out fitted.json`` fits the planner's constants to these steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from gpu_checks import CheckSizes, autocast, batch, release_memory, run_checks, synchronize
from offload_bench import checkpointed_blocks, plain_loss_fn
from torch import Tensor

from lightning_sppo.attention import select_kernel
from lightning_sppo.attention.kernels import cpu_flash_takes_groups, flash_attn_status
from lightning_sppo.callbacks.throughput import peak_flops_per_second, training_flops_per_token
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT
from lightning_sppo.offload import DEFAULT_MIN_BYTES, HostMemoryError, Offloader
from lightning_sppo.recompute import apply_recompute
from lightning_sppo.runtime import SubsequenceEngine

GIB = 2**30
OFFLOADS = ("none", "full", "adaptive")


@dataclass(frozen=True)
class Sizes:
    """Everything ``--quick`` shrinks."""

    checks: CheckSizes = CheckSizes()
    bench_model: str = "gpt-1b"
    seq_lens: tuple[int, ...] = (16384, 32768, 65536)
    subsequences: tuple[int, ...] = (1, 4, 16)
    warmup: int = 1
    repeats: int = 3
    granule: int = 8192
    cap: int = 262144
    tokens_per_subsequence: int = 8192
    """The engine's N in "longest": S / this."""
    min_bytes: int = DEFAULT_MIN_BYTES
    """The offloader's smallest unit sent to the host in the table (tiny models: 0, or nothing is sent)."""
    budget_s: float = 450.0
    longest_reserve_s: float = 120.0


QUICK = Sizes(checks=CheckSizes(model="tiny-gqa", seq_len=256, head_size=16), bench_model="tiny-gqa",
              seq_lens=(128, 256), warmup=0, repeats=1, granule=128, cap=512, tokens_per_subsequence=64, min_bytes=0,
              budget_s=120.0, longest_reserve_s=20.0)  # fmt: skip


# -- measuring ------------------------------------------------------------------------------------------


class Budget:
    """Seconds left of the suite's time budget."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def timed(step: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one step: CUDA events around it on the compute stream (it waits for the copy stream)."""
    if device.type != "cuda":
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def measure(step: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> dict[str, float | None]:
    """Median seconds over ``repeats`` after ``warmup`` steps, and the peak memory of the timed steps."""
    for _ in range(warmup):
        step()
    synchronize(device)
    cuda = device.type == "cuda"
    host_stats = getattr(torch.cuda, "host_memory_stats", None) if cuda else None  # pinned allocator, torch >= 2.6
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        if host_stats is not None:
            torch.cuda.reset_peak_host_memory_stats()
    seconds = statistics.median(timed(step, device) for _ in range(repeats))
    pinned = host_stats().get("allocated_bytes.peak") if host_stats is not None else None
    allocated = torch.cuda.max_memory_allocated(device) if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) if cuda else None
    return {
        "seconds": seconds,
        "peak_allocated_gib": allocated / GIB if cuda else None,
        "peak_reserved_gib": reserved / GIB if cuda else None,
        "peak_allocated_bytes": allocated,
        "peak_reserved_bytes": reserved,
        "pinned_peak_gib": pinned / GIB if pinned is not None else None,
    }


@contextmanager
def stopwatch(into: dict[str, float], name: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        into[name] = time.monotonic() - start


# -- the table ------------------------------------------------------------------------------------------


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu`` that also counts the bytes it copies to the host."""

    def __init__(self, pin_memory: bool) -> None:
        super().__init__(pin_memory=pin_memory)
        self.nbytes = 0
        pack = self.pack_hook

        def counting(t: Tensor):
            self.nbytes += t.nbytes
            return pack(t)

        self.pack_hook = counting


@dataclass
class Run:
    """One way to train a step: the step itself, what it sent to the host, and how to clean up."""

    name: str
    step: Callable[[], None]
    host_bytes: Callable[[], int] = lambda: 0
    close: Callable[[], None] = lambda: None
    extra_warmup: int = 0
    """Steps the run needs before it is in its steady state (adaptive offload measures its first steps)."""
    planner: Callable[[], dict[str, Any]] | None = None
    """What ``sppo-plan --fit-suite`` needs to predict the run (``lightning_sppo.planner.fit``); None: the plain
    model, which the planner does not model."""


def plain_run(name: str, model: GPT, ids: Tensor, targets: Tensor, device: torch.device) -> Run:
    saved = {"bytes": 0}
    undo = checkpointed_blocks(model) if "AC" in name else (lambda: None)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        hooks = CountingSaveOnCpu(pin_memory=device.type == "cuda") if "save_on_cpu" in name else nullcontext()
        with autocast(device, torch.bfloat16)(), hooks:
            loss = plain_loss_fn(model, ids, targets)
        loss.backward()
        saved["bytes"] = getattr(hooks, "nbytes", 0)

    return Run(name, step, lambda: saved["bytes"], undo)


@dataclass(frozen=True)
class EngineVariant:
    """How an engine run keeps its activations: offload policy, recompute mode, and the share of K/V on the device."""

    offload: str = "none"
    recompute: str = "none"
    kv_device_share: float | None = None
    """Each layer's K/V (and dK/dV) tokens kept on the device, as a share of S; the rest on host. None: all."""

    def name(self, n: int) -> str:
        recompute = f" recompute={self.recompute}" if self.recompute != "none" else ""
        kv = f" kv_device={self.kv_device_share:g}S" if self.kv_device_share is not None else ""
        return f"engine N={n} offload={self.offload}{recompute}{kv}"


ISSUE_21_VARIANTS = (
    EngineVariant("adaptive", "selective"),
    EngineVariant("adaptive", "full"),
    EngineVariant("adaptive", "full", 0.25),
)
"""Recompute with offload, and K/V on host (issue 21), at the table's largest N."""


def engine_run(
    n: int, variant: EngineVariant | str, min_bytes: int, model: GPT, ids: Tensor, targets: Tensor, device: torch.device
) -> Run:
    variant = EngineVariant(variant) if isinstance(variant, str) else variant
    offload = variant.offload
    hooks = Offloader(offload, device, min_bytes=min_bytes) if offload != "none" else None
    share = variant.kv_device_share
    kv_device_tokens = None if share is None else int(share * ids.shape[1])
    engine = SubsequenceEngine(n, "flops", attention="auto", hooks=hooks, kv_device_tokens=kv_device_tokens)
    apply_recompute(model, variant.recompute)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        engine.forward_backward(model, ids, targets, forward_context=autocast(device, torch.bfloat16))

    def close() -> None:
        apply_recompute(model, "none")
        engine.release()
        if hooks is not None:
            hooks.release()

    def host_bytes() -> int:
        offloaded = hooks.last_stats.offloaded_bytes if hooks is not None and hooks.last_stats else 0
        return offloaded + engine.cache_host_nbytes()

    def planner() -> dict[str, Any]:  # the lengths the engine ran, read after the timed steps
        return {
            "schedule": "seq1f1b", "sp": 1, "pp": 1, "dp": 1, "gpus_per_node": 1, "batch_size": ids.shape[0],
            "precision": "bf16-mixed", "kv_grad_dtype": "fp32", "num_subsequences": n, "partition_policy": "flops",
            "partition": list(engine.last_lengths), "offload": offload, "recompute": variant.recompute,
            "kv_device_tokens": kv_device_tokens, "kv_chunk_tokens": engine.kv_chunk_tokens,
        }  # fmt: skip

    warm = hooks.measure_steps if offload == "adaptive" else 0
    return Run(variant.name(n), step, host_bytes, close, warm, planner)


def table_runs(sizes: Sizes) -> list[Callable[..., Run]]:
    runs = [partial(plain_run, name) for name in ("plain", "plain + AC", "plain + save_on_cpu")]
    runs += [partial(engine_run, n, offload, sizes.min_bytes) for n in sizes.subsequences for offload in OFFLOADS]
    return runs + [partial(engine_run, max(sizes.subsequences), v, sizes.min_bytes) for v in ISSUE_21_VARIANTS]


def cell(make: Callable[..., Run], model: GPT, seq_len: int, device: torch.device, sizes: Sizes, peak: float | None):
    """One (run, S) measurement; an out-of-memory (device or host) is a result."""
    ids, targets = batch(model.config, seq_len, device)
    run = make(model, ids, targets, device)
    row: dict[str, Any] = {"run": run.name, "seq_len": seq_len}
    try:
        row |= measure(run.step, device, sizes.warmup + run.extra_warmup, sizes.repeats)
        tokens_per_s = seq_len / row["seconds"]
        flops = training_flops_per_token(model.config, seq_len) * tokens_per_s
        row |= {"status": "ok", "tokens_per_s": tokens_per_s, "host_bytes": run.host_bytes(),
                "mfu": flops / peak if peak else None}  # fmt: skip
        if run.planner is not None:
            row["planner"] = run.planner()
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    except HostMemoryError as error:
        row |= {"status": "host OOM", "error": str(error)}
    except Exception as error:  # a broken path is a result too: the report must still be written
        row |= {"status": f"error: {type(error).__name__}", "error": str(error).splitlines()[0][:300]}
    finally:
        run.close()
        model.zero_grad(set_to_none=True)
        del run, ids, targets
        release_memory(device)
    return row


def run_table(model: GPT, device: torch.device, sizes: Sizes, budget: Budget, peak: float | None) -> list[dict]:
    """Shortest sequences first for every run, so a budget cut leaves whole columns; estimates skip cells."""
    rows, last_seconds, failed = [], {}, set()
    for seq_len in sizes.seq_lens:
        for make in table_runs(sizes):
            name = _run_name(make)
            estimate = _estimate(last_seconds, name, seq_len) * (sizes.warmup + sizes.repeats + 2)
            if name in failed:
                row = {"run": name, "seq_len": seq_len, "status": "skipped (failed at a shorter S)"}
            elif estimate > budget.left() - sizes.longest_reserve_s:
                row = {"run": name, "seq_len": seq_len, "status": "skipped (time budget)"}
            else:
                row = cell(make, model, seq_len, device, sizes, peak)
            rows.append(row)
            if row["status"] == "ok":
                last_seconds[name] = (seq_len, row["seconds"])
            elif not row["status"].startswith("skipped"):
                failed.add(name)
            print(_progress(row), flush=True)
        _add_ratios(rows, seq_len)
    return rows


def _run_name(make: partial) -> str:
    if make.func is plain_run:
        return make.args[0]
    n, variant = make.args[:2]
    return (EngineVariant(variant) if isinstance(variant, str) else variant).name(n)


def _estimate(last: dict[str, tuple[int, float]], name: str, seq_len: int) -> float:
    """Seconds of one step at ``seq_len``: this run's last time, scaled by (S / S_last)^2 (attention-bound)."""
    if name not in last:
        return 0.0
    s, seconds = last[name]
    return seconds * (seq_len / s) ** 2


def _add_ratios(rows: list[dict], seq_len: int) -> None:
    same = [r for r in rows if r["seq_len"] == seq_len]
    plain = next((r for r in same if r["run"] == "plain" and r["status"] == "ok"), None)
    for r in same:
        r["ratio_to_plain"] = r["tokens_per_s"] / plain["tokens_per_s"] if plain and r["status"] == "ok" else None


def _progress(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['run']:<28} S={row['seq_len']:>7}  {row['status']}"
    return f"{row['run']:<28} S={row['seq_len']:>7}  {row['tokens_per_s']:>10.0f} tok/s"


# -- the longest sequence that fits ----------------------------------------------------------------------


def longest_fitting(
    fits: Callable[[int], bool], known_fit: int, cap: int, granule: int, affordable: Callable[[int], bool]
) -> dict[str, Any]:
    """The longest multiple of ``granule`` up to ``cap`` for which ``fits`` holds, assuming it is monotone.

    ``known_fit`` (0 if none) already fits. Doubles from there until a failure or ``cap``, then bisects between
    the last fit and the first failure. ``affordable(S)`` says whether a probe at S still fits the time budget;
    when it does not, the search stops with the bracket found so far. Returns {"longest": fit or None,
    "first_failure": S or None, "probes": [(S, fits)], "stopped": why}.
    """
    lo, hi, probes, stopped = known_fit, None, [], "bracket closed"
    seq_len = min(max(granule, 2 * known_fit // granule * granule), cap)
    while hi is None and lo < cap:
        if not affordable(seq_len):
            stopped = "time budget"
            break
        ok = fits(seq_len)
        probes.append((seq_len, ok))
        lo, hi = (seq_len, None) if ok else (lo, seq_len)
        seq_len = min(2 * seq_len, cap)
    if hi is None and lo >= cap:
        stopped = "cap reached"
    while hi is not None and hi - lo > granule:
        mid = (lo + hi) // 2 // granule * granule
        if not affordable(mid):
            stopped = "time budget"
            break
        ok = fits(mid)
        probes.append((mid, ok))
        lo, hi = (mid, hi) if ok else (lo, mid)
    return {"longest": lo or None, "first_failure": hi, "probes": probes, "stopped": stopped}


LONGEST_RUNS = {
    "plain": partial(plain_run, "plain"),
    "plain + AC": partial(plain_run, "plain + AC"),
    "engine + adaptive offload": EngineVariant("adaptive"),  # N from --tokens-per-subsequence: built per S
    "engine + adaptive offload + full recompute + K/V on host": EngineVariant("adaptive", "full", 0.0),
}


def run_longest(model: GPT, device: torch.device, sizes: Sizes, budget: Budget, table: list[dict]) -> list[dict]:
    results = []
    for name in LONGEST_RUNS:
        fitted = [r["seq_len"] for r in table if r["status"] == "ok" and _longest_table_name(r["run"]) == name]
        timing: dict[str, float] = {}

        def fits(seq_len: int, name=name, timing=timing) -> bool:
            n = max(1, seq_len // sizes.tokens_per_subsequence)
            how = LONGEST_RUNS[name]
            make = partial(engine_run, n, how, sizes.min_bytes) if isinstance(how, EngineVariant) else how
            ids, targets = batch(model.config, seq_len, device)
            run = make(model, ids, targets, device)
            started = time.monotonic()
            try:
                for _ in range(1 + run.extra_warmup):  # adaptive: its measuring steps, then one adaptive step
                    run.step()
                synchronize(device)
                return True
            except (torch.OutOfMemoryError, HostMemoryError):
                return False
            finally:  # the slowest probe so far per token^2 predicts the next (a quick OOM predicts nothing)
                timing["per_token2"] = max(timing.get("per_token2", 0.0), (time.monotonic() - started) / seq_len**2)
                run.close()
                model.zero_grad(set_to_none=True)
                del run, ids, targets
                release_memory(device)

        def affordable(seq_len: int, timing=timing) -> bool:
            return timing.get("per_token2", 0.0) * seq_len**2 < budget.left()

        known = max(fitted, default=0)
        try:
            found = longest_fitting(fits, known, sizes.cap, sizes.granule, affordable)
        except Exception as error:  # a broken path is a result: say so and go on
            found = {"longest": known or None, "first_failure": None, "probes": [], "stopped": f"error: {error!r}"}
        results.append({"run": name, "granule": sizes.granule, "cap": sizes.cap, **found})
        print(f"longest {name}: {found['longest']} (first failure {found['first_failure']}, {found['stopped']})")
    return results


def _longest_table_name(run: str) -> str:
    """The longest-search run a table row is a lower bound for (its fitting lengths start the search)."""
    if run.startswith("engine") and run.endswith("adaptive"):
        return "engine + adaptive offload"
    if run.startswith("engine") and run.endswith("recompute=full kv_device=0.25S"):
        return "engine + adaptive offload + full recompute + K/V on host"
    return run


# -- output ---------------------------------------------------------------------------------------------


def context_bytes(device: torch.device) -> int | None:
    """Device bytes in use outside PyTorch's caching allocator: the CUDA context and the libraries' loaded kernels
    (what ``sppo-plan --fit-suite`` adds to the allocator's peak); read after the runs, when they are all loaded."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def environment(device: torch.device, peak: float | None) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "total_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "context_bytes": context_bytes(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "attention_auto": select_kernel("auto", device).name,
        "flash_attn": flash_attn_status() or "usable",
        "cpu_flash_takes_groups": cpu_flash_takes_groups(),
        "peak_flops": peak,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


TABLE_COLUMNS = ["S", "run", "tokens/s", "ratio to plain", "peak alloc GiB", "peak reserved GiB", "host bytes/step",
                 "MFU"]  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU suite: {report['environment']['device']}", ""]
    lines += [f"- {k}: {v}" for k, v in report["environment"].items()]
    lines += ["", "## Checks", "", "| check | result | value | limit | detail |", "|---|---|---|---|---|"]
    for c in report["checks"]:
        lines.append(
            f"| {c['name']} | {RESULT[c['passed']]} | {_fmt(c['value'])} | {_fmt(c['limit'])} | {c['detail']} |"
        )
    lines += ["", f"## Throughput ({report['model']}, bf16 autocast)", ""]
    lines += ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for r in report["table"]:
        if r["status"] != "ok":
            lines.append(f"| {r['seq_len']} | {r['run']} | {r['status']} |" + " |" * (len(TABLE_COLUMNS) - 3))
            continue
        cells = [r["seq_len"], r["run"], f"{r['tokens_per_s']:.0f}", _fmt(r["ratio_to_plain"], ".2f"),
                 _fmt(r["peak_allocated_gib"], ".1f"), _fmt(r["peak_reserved_gib"], ".1f"), f"{r['host_bytes']:,}",
                 _fmt(r["mfu"], ".1%")]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "## Longest sequence that fits", "", "| run | longest | first failure | stopped | probes |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in report["longest"]:
        probes = ", ".join(f"{s}{'' if ok else ' (no)'}" for s, ok in r["probes"])
        lines.append(f"| {r['run']} | {r['longest']} | {r['first_failure']} | {r['stopped']} | {probes} |")
    lines += ["", "Notes:", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


RESULT = {True: "pass", False: "FAIL", None: "n/a"}


def _fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


NOTES = [
    "tokens/s: median of the timed steps (CUDA events) after warm-up; adaptive offload first runs its measuring"
    " steps. ratio to plain: tokens/s over the plain model's at the same S.",
    "peak alloc / reserved: torch.cuda.max_memory_allocated / max_memory_reserved over the timed steps.",
    "host bytes/step: bytes copied to host memory in one step (save_on_cpu: every saved tensor, weights included;"
    " offload: the offloader's level-2 bytes sent).",
    "MFU: training_flops_per_token (6 P + 6 L S d, causal attention counted once, no recomputation credit) x"
    " tokens/s / dense bf16 peak.",
    "longest: one step per probe (adaptive offload: its measuring steps and one adaptive step); the engine runs"
    " S / tokens-per-subsequence subsequences, flops partition.",
]


def write(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_suite.md").write_text(markdown(report))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds): what CI runs with --device cpu")
    p.add_argument("--out", default="benchmarks/results/gpu_suite")
    p.add_argument("--seq-lens", type=int, nargs="+", help="table sequence lengths (default 16K 32K 64K)")
    p.add_argument("--budget-s", type=float, help="time budget of the whole suite (default 450 s)")
    p.add_argument("--cap", type=int, help="longest sequence probed (default 256K)")
    p.add_argument("--tokens-per-subsequence", type=int, help="the engine's N in 'longest' is S / this (8192)")
    p.add_argument("--copy-delay-ms", type=float, default=20.0, help="delay of each copy batch in the offload check")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak for MFU (default: the device's, if known)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available; use --device cpu --quick")
    return args


def sizes_for(args: argparse.Namespace) -> Sizes:
    sizes = QUICK if args.quick else Sizes()
    overrides = {"seq_lens": tuple(args.seq_lens) if args.seq_lens else None, "budget_s": args.budget_s,
                 "cap": args.cap, "tokens_per_subsequence": args.tokens_per_subsequence}  # fmt: skip
    return replace(sizes, **{k: v for k, v in overrides.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; read at its first use
    device, sizes = torch.device(args.device), sizes_for(args)
    if device.type == "cpu" and args.quick:
        torch.set_num_threads(1)  # tiny tensors gain nothing from threads; on a busy machine they spin-wait
    budget, seconds = Budget(sizes.budget_s), {}
    torch.manual_seed(0)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops_per_second(device)
    with stopwatch(seconds, "checks"):
        checks = [asdict(c) for c in run_checks(device, sizes.checks, args.copy_delay_ms)]
    for c in checks:
        print(f"{RESULT[c['passed']]:<4}  {c['name']}: {_fmt(c['value'])}")
    config = GPTConfig.from_name(sizes.bench_model, block_size=max(sizes.cap, *sizes.seq_lens))
    model = GPT(config).to(device)
    with stopwatch(seconds, "table"):
        table = run_table(model, device, sizes, budget, peak)
    with stopwatch(seconds, "longest"):
        longest = run_longest(model, device, sizes, budget, table)
    report = {
        "environment": environment(device, peak), "quick": args.quick, "model": config.name,
        "model_block_size": config.block_size,
        "sizes": asdict(sizes), "all_checks_passed": all(c["passed"] is not False for c in checks),
        "checks": checks, "table": table, "longest": longest, "notes": NOTES,
        "elapsed_s": sizes.budget_s - budget.left(), "section_s": seconds,
    }  # fmt: skip
    write(Path(args.out), report)
    print(markdown(report).split("## Throughput")[1] if table else "")
    print(f"wrote {Path(args.out) / 'gpu_suite.json'} and gpu_suite.md ({report['elapsed_s']:.0f} s)")
    return 0 if report["all_checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
