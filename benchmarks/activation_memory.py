"""Activation memory held for backward: plain full-sequence training vs. SPPO subsequences.

For one model and sequence length it runs a plain forward/backward and, for each N, the
``SubsequenceEngine`` step (forward 0..N-1, backward N-1..0), and reports:

* held activation bytes: distinct non-parameter storages that autograd saves for backward, recorded by a
  ``saved_tensors_hooks`` pack hook around the forward (nothing is freed in forward, so this is the peak);
* for the engine, the bytes each subsequence adds (level 2) and the K/V cache bytes (level 1) after
  forward, and K/V plus its fp32 gradient buffers after backward;
* on CUDA also tokens/s (median of timed steps) and ``torch.cuda.max_memory_allocated``.

It also checks that every engine loss matches the plain loss (exit status 1 otherwise).

Run:  python benchmarks/activation_memory.py                      # small model, S=4096, CPU
      python benchmarks/activation_memory.py --device cuda --model gpt-1b --seq-len 32768 -n 1 4 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from cuda_timing import time_steps
from torch import Tensor, nn

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT
from lightning_sppo.runtime import SubsequenceEngine

MIB = 2**20
COLUMNS = ["run", "N", "lengths", "held MiB", "ratio to plain", "max/subseq MiB", "K/V MiB", "K/V+grad MiB"]
NOTES = [
    "Held bytes count each saved storage once (a view counts its whole storage); parameter storages are"
    " skipped, and autocast copies of parameters are reported apart as param_cast_bytes (JSON only).",
    "chunked_cross_entropy runs each loss chunk under non-reentrant checkpointing: the ops inside a chunk"
    " save into the checkpoint's own hooks and are not seen; what the checkpoint keeps (its inputs: the"
    " final hidden states and targets) is seen and counted.",
    "The K/V cache is written outside autograd, so it is not part of the held bytes; it is reported"
    " separately (level 1). 'max/subseq' is the largest level-2 share of one subsequence.",
    "All subsequences' level-2 activations stay on the device here (no offloading), so total held bytes"
    " barely depend on N; 'max/subseq' is what one subsequence needs if the others are offloaded.",
]


class SavedBytes:
    """Pack hook bookkeeping: bytes of distinct non-parameter storages saved for backward.

    Autocast copies of parameters are tallied apart, in ``cast_total``: they are weights, not activations.
    """

    def __init__(self, model: nn.Module) -> None:
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.total = self.cast_total = 0

    def pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.param_ptrs and ptr not in self.seen:
            self.seen.add(ptr)
            if _is_param_cast(t):
                self.cast_total += storage.nbytes()
            else:
                self.total += storage.nbytes()
        return t

    @contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield


def _is_param_cast(t: Tensor) -> bool:
    """True for (a view of) an autocast copy of a parameter: a ToCopy whose input is a leaf needing grad."""
    fn = (t._base if t._base is not None else t).grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions if f is not None)


def _hooks(meter: SavedBytes | None) -> AbstractContextManager:
    return meter.hooks() if meter is not None else nullcontext()


def plain_step(
    model: GPT, ids: Tensor, targets: Tensor, autocast: Callable, meter: SavedBytes | None = None
) -> dict[str, Any]:
    """Full-sequence forward/backward; returns loss and held bytes."""
    model.zero_grad(set_to_none=True)
    with autocast(), _hooks(meter):
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten())
    held, casts = (meter.total, meter.cast_total) if meter else (0, 0)
    loss.backward()
    return {"loss": loss.item(), "held_bytes": held, "param_cast_bytes": casts, "lengths": [ids.shape[1]]}


def engine_step(engine: SubsequenceEngine, model: GPT, ids: Tensor, targets: Tensor, autocast: Callable,
                meter: SavedBytes | None = None) -> dict[str, Any]:  # fmt: skip
    """One engine step through its action API; returns loss, held bytes per subsequence and K/V bytes."""
    model.zero_grad(set_to_none=True)
    state = engine.begin(model, ids, targets)
    per_sub: list[int] = []
    try:
        with autocast():  # one context for all forwards, as SubsequenceEngine.forward_backward does
            for i in range(len(state.spans)):
                before = meter.total if meter else 0
                with _hooks(meter):
                    engine.forward(state, i)
                per_sub.append((meter.total if meter else 0) - before)
        kv_bytes = engine.cache_nbytes()
        loss = sum(engine.backward(state, i) for i in reversed(range(len(state.spans))))
        kv_grad_bytes = engine.cache_peak_nbytes()  # with the dK/dV accumulators (let go after the backward)
    finally:
        engine.end(state)
    return {"loss": float(loss), "held_bytes": sum(per_sub), "per_subsequence_bytes": per_sub,
            "param_cast_bytes": meter.cast_total if meter else 0, "kv_bytes": kv_bytes,
            "kv_grad_bytes": kv_grad_bytes, "lengths": [n for _, n in state.spans]}  # fmt: skip


def measure(name: str, n: int, step: Callable[..., dict], model: GPT, args: argparse.Namespace) -> dict:
    """One measured (hooked) step, plus timing and peak memory on CUDA."""
    result = {"run": name, "N": n, **step(SavedBytes(model))}
    if args.device == "cuda":
        seconds, peak = time_steps(step, args.warmup, args.steps)
        result |= {"tokens_per_s": args.batch_size * args.seq_len / seconds, "peak_bytes": peak}
    return result


def run_all(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = GPT(GPTConfig.from_name(args.model)).to(device)
    tokens = torch.randint(model.config.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    dtype = getattr(torch, args.dtype)
    autocast = partial(torch.autocast, device.type, dtype=dtype) if dtype != torch.float32 else nullcontext
    # Plain first: the engine swaps the attention cores (they behave as plain ones outside a step).
    results = [measure("plain", 1, partial(plain_step, model, ids, targets, autocast), model, args)]
    for n in args.num_subsequences:
        engine = SubsequenceEngine(num_subsequences=n, partition=args.partition)
        step = partial(engine_step, engine, model, ids, targets, autocast)
        results.append(measure(f"sppo N={n}", n, step, model, args))
        engine.release()
    return results


def check_losses(results: list[dict], rtol: float) -> list[str]:
    ref = results[0]["loss"]
    return [f"{r['run']}: loss {r['loss']:.8f} vs plain {ref:.8f}" for r in results[1:]
            if abs(r["loss"] - ref) > rtol * abs(ref)]  # fmt: skip


def _fmt_lengths(lengths: list[int]) -> str:
    if len(set(lengths)) == 1:
        return f"{len(lengths)}×{lengths[0]}"
    return ",".join(map(str, lengths))


def markdown_table(results: list[dict], cuda: bool) -> str:
    head = COLUMNS + (["tokens/s", "peak MiB"] if cuda else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    plain = results[0]["held_bytes"]
    for r in results:
        held, sppo = r["held_bytes"], "per_subsequence_bytes" in r  # plain has no subsequences, no cache
        cells = [r["run"], str(r["N"]), _fmt_lengths(r["lengths"]), f"{held / MIB:.1f}", f"{held / plain:.3f}"]
        extra = [max(r["per_subsequence_bytes"]), r["kv_bytes"], r["kv_grad_bytes"]] if sppo else []
        cells += [f"{b / MIB:.1f}" for b in extra] if sppo else ["-"] * 3
        if cuda:
            cells += [f"{r['tokens_per_s']:.0f}", f"{r['peak_bytes'] / MIB:.0f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")]
    return f"{names[0] if names else platform.machine()} (torch threads: {torch.get_num_threads()})"


def write_outputs(args: argparse.Namespace, results: list[dict], table: str) -> Path:
    meta = {"model": args.model, "model_config": GPTConfig.from_name(args.model).to_dict(),
            "seq_len": args.seq_len, "batch_size": args.batch_size, "partition": args.partition,
            "num_subsequences": args.num_subsequences, "loss_rtol": args.rtol,
            "device": args.device, "dtype": args.dtype, "device_name": device_name(args.device),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"activation_memory_{args.model}_{args.device}"
    report = {**meta, "notes": NOTES, "results": results}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    header = [f"# Activation memory: {args.model}, S={args.seq_len}, B={args.batch_size}", ""]
    header += [f"- {key}: {value}" for key, value in meta.items() if key != "model_config"]
    notes = ["", "Notes:", ""] + [f"- {note}" for note in NOTES]
    stem.with_suffix(".md").write_text("\n".join(header + ["", table] + notes) + "\n")
    return stem


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=GPTConfig.available())
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("-n", "--num-subsequences", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--partition", default="length", choices=["length", "flops"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype; default bfloat16 on CUDA, float32 (no autocast) on CPU")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2, help="CUDA only: untimed steps before timing")
    p.add_argument("--steps", type=int, default=5, help="CUDA only: timed steps (median reported)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance of the loss check")
    p.add_argument("--out", default="benchmarks/results/")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run_all(args)
    table = markdown_table(results, args.device == "cuda")
    print(table)
    print(f"\nwrote {write_outputs(args, results, table)}.{{json,md}}")
    mismatches = check_losses(results, args.rtol)
    for line in mismatches:
        print(f"LOSS MISMATCH (rtol={args.rtol}): {line}", file=sys.stderr)
    if not mismatches:
        worst = max(abs(r["loss"] / results[0]["loss"] - 1) for r in results[1:]) if len(results) > 1 else 0.0
        print(f"loss check passed: max relative difference to plain {worst:.2e} (rtol={args.rtol})")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
