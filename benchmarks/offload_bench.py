"""Activation offloading: bytes per policy on CPU; tokens/s, MFU and peak GPU memory on one GPU.

CPU (default; bytes only): one step of the small model cut into N subsequences (flops partition) under
offload none / full / adaptive. "adaptive hide=f" gives the alpha rule costs under which one balanced forward
hides f times the mean subsequence's level-2 bytes (forward times proportional to each subsequence's FLOPs);
"+ adaptive partition" also lets those costs choose the lengths. Per run: level-2, offloaded and prefetched
bytes, the peak level-2 bytes on the device (measured by the offloader, and by the memory-dynamics formula
max_i M_{i-1} + A_i), host pool size, alpha per subsequence. Gradients must be bit-identical to "none"
(same partition) and the loss equal to the plain model's (exit status 1 otherwise).

CUDA (--device cuda; one GPU, bf16 autocast): for each S, plain full sequence, plain with full activation
checkpointing, plain under torch.autograd.graph.save_on_cpu, and the subsequence engine (S / --tokens-per-
subsequence subsequences, flops partition) without offload, with full and with adaptive offload. Reports
tokens/s (median of --steps after --warmup), MFU, peak allocated GPU memory, and the longest S that fits.
MFU = (6 P B S + 6 L d B S^2) / time / peak, with P the weights a token multiplies with (all but the
embedding) and 6 L d S^2 the causal attention of forward and backward; peak defaults to 989 TFLOP/s
(dense bf16, H100/H200).

Run:  python benchmarks/offload_bench.py
      python benchmarks/offload_bench.py --device cuda --model gpt-1b --seq-lens 16384 32768 65536 131072
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
from cuda_timing import time_steps
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lightning_sppo.loss import chunked_cross_entropy
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT
from lightning_sppo.offload import (
    AdaptivePartition,
    HostMemoryError,
    OffloadCosts,
    Offloader,
    adaptive_partition,
    peak_saved_bytes,
)
from lightning_sppo.partition import register_partition_policy
from lightning_sppo.partition import spans as to_spans
from lightning_sppo.runtime import SubsequenceEngine

MIB, GIB = 2**20, 2**30
CPU_COLUMNS = ["run", "lengths", "level-2 MiB", "offloaded MiB", "prefetched MiB", "peak saved MiB",
               "formula MiB", "peak / none", "host pool MiB", "alpha", "grads"]  # fmt: skip
CPU_OPTIONS = {"seq_len", "num_subsequences", "hide", "min_bytes", "rtol"}
GPU_OPTIONS = {"seq_lens", "runs", "tokens_per_subsequence", "attention", "warmup", "steps", "peak_tflops"}
GPU_RUNS = ["plain", "plain + full AC", "plain + save_on_cpu", "sppo", "sppo + full offload", "sppo + adaptive offload"]


# -- CPU: bytes ----------------------------------------------------------------------------------------


def flops_per_subsequence(config: GPTConfig, lengths: list[int]) -> list[float]:
    """Seq1F1B's count, as the flops partition uses it: 2 s P + 2 L d s (o + s) for s tokens at offset o."""
    params, ld = config.num_parameters() - config.vocab_size * config.n_embd, config.n_layer * config.n_embd
    return [2.0 * s * params + 2.0 * ld * s * (o + s) for o, s in to_spans(lengths)]


def emulated_costs(config: GPTConfig, lengths: list[int], seconds_per_flop: float, level2=None) -> OffloadCosts:
    """Costs with BW = 1 byte/s and forward time = FLOPs x ``seconds_per_flop``."""
    return OffloadCosts(
        d2h_bytes_per_s=1.0,
        forward_s=tuple(w * seconds_per_flop for w in flops_per_subsequence(config, lengths)),
        spans=tuple(to_spans(lengths)),
        level2_bytes=None if level2 is None else tuple(level2),
    )


def cpu_step(model: GPT, ids: Tensor, targets: Tensor, n: int, partition: str, offloader: Offloader) -> dict:
    """One engine step; returns lengths, loss, gradients and the offloader's stats."""
    model.zero_grad(set_to_none=True)
    engine = SubsequenceEngine(n, partition, hooks=offloader)
    plan = engine.plan(ids, model.config)  # before the step: "adaptive" lengths follow what the step measures
    loss = engine.forward_backward(model, ids, targets, plan=plan).item()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"lengths": list(plan.lengths), "loss": loss, "grads": grads, "stats": offloader.last_stats}


def cpu_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    config = GPTConfig.from_name(args.model)
    model = GPT(config)
    tokens = torch.randint(config.vocab_size, (args.batch_size, args.seq_len + 1))
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with torch.no_grad():
        plain_loss = chunked_cross_entropy(model.hidden_states(ids), model.lm_head.weight, targets, targets.numel())
    step = partial(cpu_step, model, ids, targets, args.num_subsequences)
    make = partial(Offloader, device="cpu", min_bytes=args.min_bytes)
    none = step("flops", make("none"))
    level2 = [s.level2_bytes for s in none["stats"].subsequences]
    results = [cpu_result("none", none, none, plain_loss.item()), cpu_result("full", step("flops", make("full")),
               none, plain_loss.item())]  # fmt: skip
    work = flops_per_subsequence(config, none["lengths"])
    for hide in args.hide:
        # One forward of mean FLOPs hides `hide` x the mean subsequence's level-2 bytes.
        seconds_per_flop = hide * (sum(level2) / len(level2)) / (sum(work) / len(work))
        costs = emulated_costs(config, none["lengths"], seconds_per_flop, level2)
        out = step("flops", make("adaptive", costs=costs))
        results.append(cpu_result(f"adaptive hide={hide:g}", out, none, plain_loss.item()))
        partition = AdaptivePartition(costs)
        register_partition_policy("adaptive", partition)  # as the strategy wires it
        lengths = partition(args.seq_len, args.num_subsequences, 1, config)
        out = step("adaptive", make("adaptive", costs=emulated_costs(config, lengths, seconds_per_flop)))
        results.append(cpu_result(f"adaptive hide={hide:g} + adaptive partition", out, none, plain_loss.item()))
    register_partition_policy("adaptive", adaptive_partition)
    return results


def cpu_result(name: str, out: dict, none: dict, plain_loss: float) -> dict[str, Any]:
    stats = out["stats"]
    level2 = [s.level2_bytes for s in stats.subsequences]
    offloaded = [s.offloaded_bytes for s in stats.subsequences]
    same_partition = out["lengths"] == none["lengths"]
    identical = all(torch.equal(g, none["grads"][k]) for k, g in out["grads"].items()) if same_partition else None
    return {
        "run": name,
        "lengths": out["lengths"],
        "loss": out["loss"],
        "plain_loss": plain_loss,
        "level2_bytes": level2,
        "offloaded_bytes": offloaded,
        "prefetched_bytes": stats.prefetched_bytes,
        "peak_saved_bytes": stats.peak_saved_bytes,
        "formula_peak_bytes": peak_saved_bytes(level2, offloaded),
        "host_pool_bytes": stats.host_pool_bytes,
        "alphas": list(stats.alphas),
        "grads_bit_identical_to_none": identical,
    }


def cpu_table(results: list[dict]) -> str:
    rows = ["| " + " | ".join(CPU_COLUMNS) + " |", "|" + "---|" * len(CPU_COLUMNS)]
    base = results[0]["peak_saved_bytes"]
    for r in results:
        grads = {True: "identical", False: "DIFFER", None: "other partition"}[r["grads_bit_identical_to_none"]]
        cells = [r["run"], ",".join(map(str, r["lengths"]))]
        cells += [f"{b / MIB:.1f}" for b in (sum(r["level2_bytes"]), sum(r["offloaded_bytes"]), r["prefetched_bytes"],
                                             r["peak_saved_bytes"], r["formula_peak_bytes"])]  # fmt: skip
        cells += [f"{r['peak_saved_bytes'] / base:.3f}", f"{r['host_pool_bytes'] / MIB:.1f}"]
        cells += [" ".join(f"{a:.2f}" for a in r["alphas"]), grads]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def cpu_problems(results: list[dict], rtol: float) -> list[str]:
    problems = []
    for r in results:
        if abs(r["loss"] - r["plain_loss"]) > rtol * abs(r["plain_loss"]):
            problems.append(f"{r['run']}: loss {r['loss']:.8f} vs plain {r['plain_loss']:.8f}")
        if r["grads_bit_identical_to_none"] is False:
            problems.append(f"{r['run']}: gradients differ from offload='none'")
        if r["peak_saved_bytes"] != r["formula_peak_bytes"]:
            problems.append(f"{r['run']}: peak {r['peak_saved_bytes']} != formula {r['formula_peak_bytes']}")
    return problems


# -- CUDA: time and memory ------------------------------------------------------------------------------


def plain_loss_fn(model: GPT, ids: Tensor, targets: Tensor) -> Tensor:
    """Full-sequence loss through the same chunked cross-entropy the engine uses (no [S, V] logits)."""
    hidden = model.hidden_states(ids)
    return chunked_cross_entropy(hidden, model.lm_head.weight, targets, targets.numel())


def checkpointed_blocks(model: GPT) -> Callable[[], None]:
    """Wrap every block in non-reentrant activation checkpointing; returns the undo."""
    originals = {name: block.forward for name, block in model.blocks.items()}
    for block in model.blocks.values():
        block.forward = partial(checkpoint, block.forward, use_reentrant=False)

    def undo() -> None:
        for name, block in model.blocks.items():
            block.forward = originals[name]

    return undo


def gpu_step_fn(run: str, model: GPT, ids: Tensor, targets: Tensor, args: argparse.Namespace):
    """A zero-argument training step for ``run``, and what to call afterwards (undo, offloader)."""
    autocast = partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    if run.startswith("plain"):
        context = partial(torch.autograd.graph.save_on_cpu, pin_memory=True) if "save_on_cpu" in run else nullcontext
        undo = checkpointed_blocks(model) if "AC" in run else (lambda: None)

        def plain_step() -> None:
            model.zero_grad(set_to_none=True)
            with autocast(), context():
                loss = plain_loss_fn(model, ids, targets)
            loss.backward()

        return plain_step, undo, None
    policy = "full" if "full" in run else "adaptive" if "adaptive" in run else "none"
    offloader = Offloader(policy, "cuda") if policy != "none" else None
    n = max(1, ids.shape[1] // args.tokens_per_subsequence)
    engine = SubsequenceEngine(n, "flops", attention=args.attention, hooks=offloader)

    def sppo_step() -> None:
        model.zero_grad(set_to_none=True)
        engine.forward_backward(model, ids, targets, forward_context=autocast)

    def undo() -> None:
        engine.release()
        if offloader is not None:
            offloader.release()

    return sppo_step, undo, offloader


def model_flops(config: GPTConfig, batch: int, seq_len: int) -> float:
    params = config.num_parameters() - config.vocab_size * config.n_embd
    return 6.0 * params * batch * seq_len + 6.0 * config.n_layer * config.n_embd * batch * seq_len**2


def gpu_measure(run: str, model: GPT, seq_len: int, args: argparse.Namespace) -> dict[str, Any]:
    """One (run, S) cell; out-of-memory (device or host) is a result, not a crash."""
    tokens = torch.randint(model.config.vocab_size, (args.batch_size, seq_len + 1), device="cuda")
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    result: dict[str, Any] = {"run": run, "seq_len": seq_len}
    step, undo, offloader = gpu_step_fn(run, model, ids, targets, args)
    try:
        seconds, peak = time_steps(step, args.warmup, args.steps)
        tokens_per_s = args.batch_size * seq_len / seconds
        mfu = model_flops(model.config, args.batch_size, seq_len) / seconds / (args.peak_tflops * 1e12)
        result |= {"status": "ok", "seconds": seconds, "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_bytes": peak}
        if offloader is not None and offloader.last_stats is not None:
            stats = offloader.last_stats
            result |= {"offloaded_bytes": stats.offloaded_bytes, "wait_s": stats.wait_s, "alphas": stats.alphas}
    except torch.OutOfMemoryError:
        result["status"] = "OOM"
    except HostMemoryError as error:
        result |= {"status": "host OOM", "error": str(error)}
    finally:
        undo()
        del step, offloader, ids, targets, tokens
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
    return result


def gpu_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name(args.model)).cuda()
    results = []
    for run in args.runs:
        for seq_len in sorted(args.seq_lens):
            result = gpu_measure(run, model, seq_len, args)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "error"}), flush=True)
            if result["status"] != "ok":
                break  # longer sequences will not fit either
    return results


def gpu_table(results: list[dict], seq_lens: list[int]) -> str:
    head = ["run", *[f"S={s // 1024}K" for s in seq_lens], "longest S that fits"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in dict.fromkeys(r["run"] for r in results):
        cells, fits = [run], 0
        by_len = {r["seq_len"]: r for r in results if r["run"] == run}
        for s in seq_lens:
            r = by_len.get(s)
            if r is None:
                cells.append("-")
            elif r["status"] != "ok":
                cells.append(r["status"])
            else:
                fits = s
                cells.append(f"{r['tokens_per_s']:.0f} tok/s, MFU {r['mfu']:.1%}, {r['peak_bytes'] / GIB:.1f} GiB")
        rows.append("| " + " | ".join([*cells, f"{fits // 1024}K" if fits else "none"]) + " |")
    return "\n".join(rows)


def gpu_plot(results: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in dict.fromkeys(r["run"] for r in results):
        ok = [r for r in results if r["run"] == run and r["status"] == "ok"]
        xs = [r["seq_len"] // 1024 for r in ok]
        left.plot(xs, [r["tokens_per_s"] for r in ok], marker="o", label=run)
        right.plot(xs, [r["peak_bytes"] / GIB for r in ok], marker="o", label=run)
    left.set(xlabel="sequence length (K tokens)", ylabel="tokens/s", xscale="log", title="throughput")
    right.set(xlabel="sequence length (K tokens)", ylabel="peak allocated GiB", xscale="log", title="GPU memory")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


# -- output ---------------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")]
    return f"{names[0] if names else platform.machine()} (torch threads: {torch.get_num_threads()})"


def write_outputs(args: argparse.Namespace, results: list[dict], table: str, notes: list[str]) -> Path:
    other = GPU_OPTIONS if args.device == "cpu" else CPU_OPTIONS
    meta = {key: value for key, value in vars(args).items() if key != "out" and key not in other}
    meta |= {"device_name": device_name(args.device), "torch": torch.__version__, "python": platform.python_version(),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"offload_{args.model}_{args.device}"
    stem.with_suffix(".json").write_text(json.dumps({**meta, "notes": notes, "results": results}, indent=2) + "\n")
    header = [f"# Activation offloading: {args.model} on {args.device}", ""]
    header += [f"- {key}: {value}" for key, value in meta.items()]
    body = ["", table, "", "Notes:", ""] + [f"- {note}" for note in notes]
    stem.with_suffix(".md").write_text("\n".join(header + body) + "\n")
    return stem


CPU_NOTES = [
    "Bytes are level-2 activations as the offloader counts them: spans of saved storages, not weights, not the"
    " K/V cache (level 1, on the device throughout). min_bytes is the smallest span offloaded.",
    "peak saved = the offloader's bookkeeping of level-2 bytes on the device; formula = max_i M_{i-1} + A_i with"
    " M_i = M_{i-1} + A_i - alpha_{i-1} A_{i-1} from the measured A_i and offloaded bytes. They must agree.",
    "On CPU the host copy is a separate CPU buffer; the bytes are what a GPU run would move, times are not reported.",
    "adaptive hide=f: one balanced forward hides f x the mean subsequence's level-2 bytes; the last subsequence"
    " is never offloaded (its backward follows at once) and alpha is non-increasing.",
]
GPU_NOTES = [
    "peak = torch.cuda.max_memory_allocated over the timed steps (weights, gradients, activations, K/V cache).",
    "MFU counts model FLOPs only (recomputation under activation checkpointing is not credited).",
    "save_on_cpu copies every saved tensor (weights included) on the compute stream into freshly pinned memory.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None, choices=GPTConfig.available(), help="default: small (CPU), gpt-1b (CUDA)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/")
    cpu = p.add_argument_group("CPU")
    cpu.add_argument("--seq-len", type=int, default=4096)
    cpu.add_argument("-n", "--num-subsequences", type=int, default=8)
    cpu.add_argument("--hide", type=float, nargs="+", default=[0.5, 1.0], help="adaptive runs: see above")
    cpu.add_argument("--min-bytes", type=int, default=0, help="smallest span offloaded (CPU runs)")
    cpu.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance of the loss check")
    gpu = p.add_argument_group("CUDA")
    gpu.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    gpu.add_argument("--runs", nargs="+", default=GPU_RUNS, choices=GPU_RUNS)
    gpu.add_argument("--tokens-per-subsequence", type=int, default=8192)
    gpu.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flash_attn"])
    gpu.add_argument("--warmup", type=int, default=3, help="untimed steps (adaptive offload measures in the first 2)")
    gpu.add_argument("--steps", type=int, default=3)
    gpu.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    args = p.parse_args(argv)
    args.model = args.model or ("gpt-1b" if args.device == "cuda" else "small")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        results = cpu_runs(args)
        table, notes, problems = cpu_table(results), CPU_NOTES, cpu_problems(results, args.rtol)
    else:
        results = gpu_runs(args)
        table, notes, problems = gpu_table(results, sorted(args.seq_lens)), GPU_NOTES, []
    print(table)
    stem = write_outputs(args, results, table, notes)
    print(f"\nwrote {stem}.{{json,md}}")
    if args.device == "cuda":
        print(gpu_plot(results, stem.with_suffix(".png")))
    for line in problems:
        print(f"CHECK FAILED: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
