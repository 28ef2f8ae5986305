"""The GPU suite: is the GPU path right, and what decides between this project and activation checkpointing, in one
device call of about 8 minutes.

The next GPU session runs exactly this, as one device call (the machine has torch 2.11, lightning, transformers,
pytest and hypothesis, and no flash-attn, jsonargparse or wandb; only the checkout travels, without ``.git``, so the
commit is written into the command; nothing needs ``carry``)::

    run(timeout_s=540, command="set -o pipefail; PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py
        --out $OUT --commit <git rev-parse --short HEAD> 2>&1 | tee $OUT/log")

then copies ``gpu_suite.json``, ``gpu_suite.md`` and ``log`` into ``benchmarks/results/gpu/<gpu>-<date>/`` and
commits them (without ``--out`` the suite writes there itself). One call cannot also find the longest sequences (one
step of gpt-1b with activation checkpointing at 512K would take about 3 minutes on an H100: 12 s at 128K, scaled
by its FLOPs); if device time is left, a second call does:
``--parts calibrate longest --longest-from <the first call's longest> --budget-s 480``.
On CPU the same code runs on tiny sizes in seconds (CI): ``python benchmarks/gpu_suite.py --device cpu --quick``.

Parts, in this order, each with its own share of ``--budget-s`` (default 420 s; what a part leaves unused goes to
the next), the report written after every part and every row:

1. checks (``gpu_checks.py``): kernels, subsequence attention, engine = plain model (fp32, bf16), packed documents,
   the layer order = plain model (and unchanged by late copies), offload "full"/"adaptive" bit-identical to "none" with
   every copy delayed.
2. calibrate: ``sppo-plan --calibrate``'s matmul and copy rates on this GPU; the planner plans with this profile
   (``--planner-profile``), else with the built-in one.
3. profile: one step of plain, plain with SDPA pinned to FA2, and engine N=1 at 16K under ``torch.profiler``: top
   kernels, attention kernels, and where the engine's extra time goes.
4. table: gpt-1b, then llama-3.2-1b, at 16K..128K (then both at 256K): plain, plain + full activation checkpointing
   ("AC"), engine N=1, the layer order (``order="layer"``, 16K chunks, selective, checkpoints on host), and the
   planner's own choice for that length on this GPU (``suite_runs.py``).
5. kernels: attention forward+backward TFLOP/s per backend the kernels module offers, 16K..128K
   (``suite_kernels.py``).
6. longest: the longest sequence of the planner's choice (its own longest probed first), then of plain + AC, up to
   1M, one step per probe.
7. negative_control: offload with the compute stream's waits removed must change the gradients; floating-point
   payloads only, and last, so nothing it does can cost the parts before it.

Writes ``gpu_suite.json`` and ``gpu_suite.md`` (targets first); exit status 1 when a check fails or a part breaks.
The JSON keeps what ``sppo-plan --fit-suite`` reads: ``model``, ``model_block_size``, the primary model's ``table``
whose engine rows carry a ``planner`` entry beside ``seconds`` and ``peak_reserved_bytes``, and the environment's
``total_memory_bytes`` and ``context_bytes``; every row also names the attention kernel it ran (``attention``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from gpu_checks import CheckSizes, check_offload_negative_control, release_memory, run_checks
from kernel_bench import available_backends
from suite_decisive import (
    DECISIVE,
    DECISIVE_CPU,
    GPU_BACKENDS,
    DecisiveSizes,
    decisive_parts,
    predict_parts,
    print_prediction,
    tiny_planner_profile,
)
from suite_kernels import run_kernels, run_profile
from suite_markdown import RESULT, decisive_markdown, decisive_targets, markdown, targets
from suite_runs import SuitePlanner, describe_kernel, longest_fitting, run_longest, run_table, sdpa_backend
from suite_state import (
    Budget,
    Context,
    PartOverBudget,
    Report,
    base_environment,
    context_bytes,
    default_out,
    first_line,
    git_commit,
    host_memory_bytes,
    process_age_s,
)

from lightning_sppo.attention import select_kernel
from lightning_sppo.attention.kernels import cpu_flash_takes_groups, flash_attn_status
from lightning_sppo.callbacks.mfu import peak_flops_per_second
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.offload import DEFAULT_MIN_BYTES
from lightning_sppo.planner import HardwareProfile, resolve_profile
from lightning_sppo.planner.calibrate import CalibrationUnavailable, calibrate
from lightning_sppo.planner.profile import with_host_memory
from lightning_sppo.strategy.autoplan import device_profile

__all__ = ["PARTS", "QUICK", "Sizes", "longest_fitting", "main", "run_parts"]

K = 1024


@dataclass(frozen=True)
class Sizes:
    """Everything ``--quick`` shrinks."""

    checks: CheckSizes = CheckSizes()
    models: tuple[str, ...] = ("gpt-1b", "llama-3.2-1b")
    """The table's models; the first is the primary one (profile, kernels, longest, ``sppo-plan --fit-suite``)."""
    seq_lens: tuple[int, ...] = (16 * K, 32 * K, 64 * K, 128 * K, 256 * K)
    warmup: int = 1
    repeats: int = 3
    long_step_s: float = 2.0
    """Steps longer than this are timed twice, not three times."""
    very_long_step_s: float = 30.0
    """Steps longer than this are timed once."""
    cell_overhead_s: float = 2.0
    """Seconds around a cell besides its steps (memory released, garbage collected), for the budget's estimates."""
    estimate_margin: float = 1.15
    """A cell or probe starts only if its estimated time, times this, fits what its part has left."""
    kernel_seq_lens: tuple[int, ...] = (16 * K, 32 * K, 64 * K, 128 * K)
    profile_seq_len: int = 16 * K
    cap: int = 1024 * K
    granule: int = 16 * K
    longest_from: int = 0
    """A length already known to fit for both longest searches (``--longest-from``: a second call's start)."""
    min_bytes: int = DEFAULT_MIN_BYTES
    """The offloader's smallest unit sent to the host (tiny models: 0, or nothing is sent)."""
    budget_s: float = 420.0
    allotments: tuple[tuple[str, float], ...] = (
        ("checks", 20), ("calibrate", 10), ("profile", 20), ("table", 180), ("kernels", 30), ("longest", 140),
        ("negative_control", 20),
    )  # fmt: skip
    """Each part's share of ``budget_s``, in the order the parts run (scaled to ``--budget-s``)."""
    target_n1_lens: tuple[int, ...] = (16 * K, 32 * K)
    target_planner_lens: tuple[int, ...] = (64 * K, 128 * K)
    planner_hbm_bytes: int | None = None
    """Quick only: the planner's device memory, squeezed so that it must cut, offload and recompute tiny models."""
    planner_options: tuple[tuple[str, Any], ...] = ()
    """Quick only: further ``PlanRequest`` fields (adaptive offload pinned, so that its path runs on CPU too)."""

    @property
    def block_size(self) -> int:
        """The models' block size: every length the suite may run."""
        return max(self.cap, *self.seq_lens, self.profile_seq_len)


QUICK = Sizes(
    checks=CheckSizes(model="tiny-gqa", seq_len=256, head_size=16), models=("tiny-gqa", "tiny"), seq_lens=(256, 512),
    warmup=0, repeats=1, cell_overhead_s=0.0, kernel_seq_lens=(128, 256), profile_seq_len=256, cap=4096, granule=1024,
    min_bytes=0, budget_s=900.0, target_n1_lens=(256,), target_planner_lens=(512,), planner_hbm_bytes=6 * 2**20,
    planner_options=(("min_tokens_per_device", 128), ("model_state", ("device",)), ("offload", ("adaptive",))),
)  # fmt: skip


# -- the parts --------------------------------------------------------------------------------------------


def part_checks(ctx: Context) -> None:
    checks = [asdict(c) for c in run_checks(ctx.device, ctx.sizes.checks, ctx.cache["copy_delay_ms"])]
    _add_checks(ctx, checks)


def part_calibrate(ctx: Context) -> str | None:
    """The matmul and copy rates of this GPU (``sppo-plan --calibrate``); the planner's profile if so asked."""
    try:
        profile = replace(calibrate(), gpus_per_node=1)
    except CalibrationUnavailable as why:
        ctx.data["calibration"] = {"status": f"n/a: {str(why).split(';')[0]}"}
        return "n/a (no CUDA device): the planner keeps the built-in profile"
    ctx.data["calibration"] = {"status": "ok", "profile": profile.to_dict()}
    if ctx.cache["planner_profile"] == "calibrated":
        _set_planner(ctx, profile, f"calibrated in this run ({profile.name})")
    return None


def part_negative_control(ctx: Context) -> None:
    checks = check_offload_negative_control(ctx.device, ctx.sizes.checks, ctx.cache["copy_delay_ms"])
    _add_checks(ctx, [asdict(c) for c in checks])


def _add_checks(ctx: Context, checks: list[dict[str, Any]]) -> None:
    ctx.data["checks"] += checks
    ctx.data["all_checks_passed"] = all(c["passed"] is not False for c in ctx.data["checks"])
    for c in checks:
        print(f"{RESULT[c['passed']]:<4}  {c['name']}: {c['value']}", flush=True)


PARTS: dict[str, Callable[[Context], str | None]] = {
    "checks": part_checks,
    "calibrate": part_calibrate,
    "profile": run_profile,
    "table": run_table,
    "kernels": run_kernels,
    "longest": run_longest,
    "negative_control": part_negative_control,
}


def run_parts(
    ctx: Context, budget: Budget, parts: dict[str, Callable[[Context], str | None]],
    predicted: dict[str, float] | None = None,
) -> None:  # fmt: skip
    """Each part in turn under its budget; its status, time and the report are written when it ends, whatever the
    end. A part over its budget or broken is a result; a lost CUDA context skips the parts after it; a part whose
    ``predicted`` seconds exceed what its budget has left is not started (it says so). A part returns None when done,
    or a status that says more ("n/a ...")."""
    for name, part in parts.items():
        entry = {"name": name, "status": "running", "seconds": None, "allotted_s": budget.allotments[name]}
        if predicted is not None:
            entry["predicted_s"] = predicted[name]
        ctx.data["parts"].append(entry)
        if ctx.lost:
            entry["status"] = f"skipped (the CUDA context was lost: {ctx.lost})"
            continue
        left = budget.part(name).left()
        if predicted is not None and predicted[name] > left:
            entry["status"] = f"skipped (predicted {predicted[name]:.0f} s, {left:.0f} s left for it)"
            ctx.save()
            print(f"part {name}: {entry['status']}", flush=True)
            continue
        ctx.budget, started = budget.part(name), time.monotonic()
        ctx.save()
        try:
            entry["status"] = part(ctx) or "done"
        except PartOverBudget as why:
            entry["status"] = f"stopped: {why}"
        except Exception as error:  # the failure is a result; the parts after it still run
            entry["status"] = f"error: {type(error).__name__}: {first_line(error)}"
            if _cuda_lost(ctx.device) is None:
                release_memory(ctx.device)
        entry["seconds"] = time.monotonic() - started
        ctx.lost = _cuda_lost(ctx.device)
        if ctx.lost is None and ctx.device.type == "cuda":
            ctx.data["environment"]["context_bytes"] = context_bytes(ctx.device)
        ctx.data["elapsed_s"] = budget.elapsed()
        ctx.save()
        print(f"part {name}: {entry['status']} ({entry['seconds']:.1f} s)", flush=True)


def _cuda_lost(device: torch.device) -> str | None:
    """Why the CUDA context is unusable (a device-side assert or an illegal access poisons it for good), or None."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except RuntimeError as error:
        return first_line(error)
    return None


# -- the planner's profile ------------------------------------------------------------------------------------


def _set_planner(ctx: Context, profile: HardwareProfile, source: str) -> None:
    sizes = ctx.sizes
    if sizes.planner_hbm_bytes is not None:  # quick: a device small enough that the tiny models need the options
        profile = replace(profile, hbm_bytes=sizes.planner_hbm_bytes, reserved_bytes=2**20, host_bytes_per_gpu=2**30,
                          allocator_slack_bytes=0, context_bytes=0)  # fmt: skip
        source += f", squeezed to {sizes.planner_hbm_bytes / 2**20:g} MiB for the quick sizes"
    ctx.cache["planner"] = SuitePlanner(profile, source, dict(sizes.planner_options))
    ctx.data["planner"] = {"source": source, "profile": profile.to_dict(), "request": dict(sizes.planner_options)}


def _initial_planner(ctx: Context, choice: str) -> None:
    """The built-in profile of this device (``planner_profile`` unset in a run), or the named one; "calibrated" starts
    from the built-in one and the calibrate part replaces it."""
    if choice in ("calibrated", "builtin"):
        profile, source = device_profile(ctx.device, None, 1)
        _set_planner(
            ctx, profile, source + ("" if choice == "builtin" else "; replaced if the calibrate part measures")
        )
    else:
        _set_planner(ctx, resolve_profile(choice, 1), f"--planner-profile {choice}")


# -- command line -----------------------------------------------------------------------------------------------

NOTES = [
    "tokens/s: one sequence per step; median of the timed steps (CUDA events) after one warm-up step (adaptive offload"
    " first runs its measuring steps); 3 timed steps, 2 where a step takes over 2 s, 1 over 30 s.",
    "plain + AC: every block under torch.utils.checkpoint (non-reentrant). engine N=1 and the planner's choice run"
    " through the strategy's one-device path (SPPOCore); the planner's choice is solve() for one node of one GPU,"
    " turned into settings by lightning_sppo.strategy.autoplan.plan_settings.",
    "peak alloc / reserved: torch.cuda.max_memory_allocated / max_memory_reserved over the timed steps; no optimizer"
    " state is allocated (the planner counts AdamW's).",
    "host bytes/step: activations the offloader sent to host memory plus K/V kept on host.",
    "MFU: training_flops_per_token (6 P + 6 L S d, causal attention counted once, no recomputation credit) x tokens/s /"
    " dense bf16 peak.",
    "attention: the kernel a row ran; plain rows: the backend F.scaled_dot_product_attention dispatches to"
    " (torch._fused_sdp_choice), engine rows: the engine's backend and the ATen op it calls.",
    "kernels: forward+backward of one attention call, TFLOP/s counted as 7 B H Dh S^2 (causal half, backward 2.5x"
    " forward).",
    "longest: one step per probe (adaptive offload: its measuring steps and one adaptive step); OOM or no plan is a"
    " failure; a search stopped by the time budget or the cap gives a lower bound.",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="full", choices=["full", "decisive"],
                   help="'decisive': what settles the question in one 8-minute device call (suite_decisive.py;"
                        " with --device cpu on tiny sizes); 'full': every part below")  # fmt: skip
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds): what CI runs with --device cpu")
    p.add_argument("--out", help="output folder (default benchmarks/results/gpu/<gpu>-<date>/)")
    p.add_argument("--commit", help="the checkout's commit, where it has no .git (the device machine's copy)")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), help="run only these parts (default: all, in order)")
    p.add_argument(
        "--budget-s",
        type=float,
        help="time of all parts together (default 420 s; --quick 900 s, so that a slow CI machine skips nothing)",
    )
    p.add_argument("--models", nargs="+", choices=GPTConfig.available(), help="table models (first: primary)")
    p.add_argument("--seq-lens", type=int, nargs="+", help="table sequence lengths (default 16K 32K 64K 128K 256K)")
    p.add_argument("--cap", type=int, help="longest sequence probed (default 1M)")
    p.add_argument("--longest-from", type=int, help="a length known to fit: the longest searches start there")
    p.add_argument("--planner-profile", default=None,
                   help="'calibrated' (this run's calibration, else built-in; the full suite's default), 'builtin'"
                        " (the decisive preset's default: it calibrates last), or a profile name/JSON")  # fmt: skip
    p.add_argument("--copy-delay-ms", type=float, default=20.0, help="delay of each copy batch in the offload checks")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak for MFU (default: the device's, if known)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available; use --device cpu --quick (or --preset decisive --device cpu)")
    if args.planner_profile is None:
        args.planner_profile = "builtin" if args.preset == "decisive" else "calibrated"
    return args


def sizes_for(args: argparse.Namespace) -> Sizes:
    sizes = QUICK if args.quick else Sizes()
    overrides = {"models": tuple(args.models) if args.models else None, "budget_s": args.budget_s,
                 "seq_lens": tuple(args.seq_lens) if args.seq_lens else None, "cap": args.cap,
                 "longest_from": args.longest_from}  # fmt: skip
    sizes = replace(sizes, **{k: v for k, v in overrides.items() if v is not None})
    chosen = [(name, s) for name, s in sizes.allotments if not args.parts or name in args.parts]
    scale = sizes.budget_s / sum(s for _, s in chosen)
    return replace(sizes, allotments=tuple((name, round(s * scale, 1)) for name, s in chosen))


def _report(args: argparse.Namespace, device: torch.device, sizes: Sizes, peak: float | None) -> Report:
    primary = GPTConfig.from_name(sizes.models[0])
    env = base_environment(device, peak, git_commit(args.commit))
    env |= {"attention_auto": describe_kernel(select_kernel("auto", device), device),
            "attention_backends": available_backends(device),
            "plain_sdpa_backend": sdpa_backend(primary, sizes.profile_seq_len, device),
            "flash_attn": flash_attn_status() or "usable", "cpu_flash_takes_groups": cpu_flash_takes_groups()}  # fmt: skip
    data = {
        "environment": env, "quick": args.quick, "model": primary.name,
        "model_block_size": max(sizes.cap, *sizes.seq_lens, sizes.profile_seq_len), "sizes": asdict(sizes),
        "budget": {"total_s": sizes.budget_s, "allotments": dict(sizes.allotments)}, "parts": [], "targets": [],
        "all_checks_passed": None, "checks": [], "calibration": None, "planner": None, "profile": {}, "table": [],
        "other_models": [], "kernels": [], "longest": [], "notes": NOTES, "elapsed_s": 0.0,
    }  # fmt: skip
    out = Path(args.out) if args.out else default_out(device, args.quick)
    return Report(out, data, _render)


def _render(data: dict[str, Any]) -> str:
    data["targets"] = targets(data)  # refreshed with every write: the JSON's and the Markdown's agree
    return markdown(data)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault(
        "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
    )  # deterministic cuBLAS for the checks; read at first use
    if args.preset == "decisive":
        return run_decisive(args)
    device, sizes = torch.device(args.device), sizes_for(args)
    if device.type == "cpu" and args.quick:
        torch.set_num_threads(1)  # tiny tensors gain nothing from threads; on a busy machine they spin-wait
    torch.manual_seed(0)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops_per_second(device)
    budget = Budget(sizes.budget_s, dict(sizes.allotments))
    report = _report(args, device, sizes, peak)
    ctx = Context(device, sizes, report, peak)
    ctx.cache |= {"copy_delay_ms": args.copy_delay_ms, "planner_profile": args.planner_profile}
    _initial_planner(ctx, args.planner_profile)
    run_parts(ctx, budget, {name: PARTS[name] for name, _ in sizes.allotments})
    print(f"\nwrote {report.out / 'gpu_suite.json'} and gpu_suite.md ({budget.elapsed():.0f} s)")
    for t in report.data["targets"]:
        print(f"target {t['target']}: {t['value']} ({t['verdict']})")
    broken = ctx.lost or any(p["status"].startswith("error") for p in report.data["parts"])
    return 1 if report.data["all_checks_passed"] is False or broken else 0


# -- the decisive preset ------------------------------------------------------------------------------------

DEVICE_HOST_BYTES = 125 * 2**30
"""Host memory of the lent H100 machine (the first run: 125 GiB): the real preset's prediction made elsewhere."""
DECISIVE_NOTES = [
    "Every row: the planner's prediction (planner.fit.predict: no optimizer step, the suite's profile) beside the"
    " measurement; 'as ran': predicted again with the kernel that ran and the engine's own lengths, with the errors.",
    "attention: the kernels that ran, from torch.profiler's CUDA kernel names (on CPU the ATen ops dispatched), read on"
    " the last untimed step (a cell timed on its first step is profiled while timed, and says so).",
    "Steps: the offloader's measuring steps or one warm-up, then 3 timed steps under 2 s, 2 under 8 s, else 1; a step"
    " predicted over 20 s is timed on its first run (no warm-up: one-time costs included, against the run).",
    "A cell, probe or part starts only if its predicted time fits what is left; a failed allocation of any kind is"
    " 'does not fit' (OOM / host OOM) and names what failed.",
]


def allotments(predicted: dict[str, float], total_s: float) -> dict[str, float]:
    """Each part's share of ``total_s``: its prediction, the time left over shared in proportion; when the predictions
    do not fit, each part in order that still fits whole, and nothing for the others (they are not started: the order
    is what decides, so later parts give way)."""
    whole = sum(predicted.values())
    if whole <= total_s:
        return {name: s * total_s / whole for name, s in predicted.items()} if whole else dict(predicted)
    out, used = {}, 0.0
    for name, s in predicted.items():
        out[name] = s if used + s <= total_s else 0.0
        used += out[name]
    return out


def decisive_planner(device: torch.device, sizes: DecisiveSizes, choice: str) -> SuitePlanner:
    """The planner the preset plans and predicts with: the device's built-in profile with this machine's host memory
    (or the named profile); the tiny sizes squeeze its device memory so that it cuts, offloads and recomputes."""
    if choice == "builtin":
        profile, source = device_profile(device, None, 1)
        total = host_memory_bytes()
        if total and device.type == "cuda":
            profile, source = with_host_memory(profile, total), source + f", host {total / 2**30:.0f} GiB"
    else:
        profile, source = resolve_profile(choice, 1), f"--planner-profile {choice}"
    if sizes.planner_hbm_bytes is not None:
        profile = tiny_planner_profile(sizes, profile)
        source += f", squeezed to {sizes.planner_hbm_bytes / 2**20:g} MiB for the tiny sizes"
    return SuitePlanner(profile, source, dict(sizes.planner_options))


def run_decisive(args: argparse.Namespace) -> int:
    """``--preset decisive`` (``suite_decisive``): the predicted GPU time first, then every part in order."""
    device = torch.device(args.device)
    sizes = DECISIVE_CPU if device.type == "cpu" else DECISIVE
    if args.budget_s:
        sizes = replace(sizes, budget_s=args.budget_s)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors gain nothing from threads; on a busy machine they spin-wait
    torch.manual_seed(0)
    planner = decisive_planner(device, sizes, args.planner_profile)
    here = [name for name, why in available_backends(device).items() if why is None]
    prediction = predict_parts(sizes, planner, here)
    print_prediction(prediction, "this run" + (" (tiny sizes)" if sizes.tiny else ""))
    gpu = prediction
    if device.type != "cuda":
        h100 = SuitePlanner(
            resolve_profile("h100", 1, DEVICE_HOST_BYTES), f"built-in h100, host {DEVICE_HOST_BYTES / 2**30:.0f} GiB"
        )
        gpu = predict_parts(DECISIVE, h100, GPU_BACKENDS)
        print_prediction(gpu, "the real preset on one H100")
    predicted = {p["part"]: p["predicted_s"] for p in prediction["parts"] if p["part"] != "start"}
    total = sizes.budget_s - process_age_s()
    budget = Budget(total, allotments(predicted, total))
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops_per_second(device)
    report = _decisive_report(args, device, sizes, peak, prediction, gpu)
    ctx = Context(device, sizes, report, peak)
    ctx.cache |= {"copy_delay_ms": args.copy_delay_ms, "planner": planner}
    run_parts(ctx, budget, decisive_parts(), predicted)
    print(f"\nwrote {report.out / 'gpu_suite.json'} and gpu_suite.md ({process_age_s():.0f} s since the start)")
    for t in report.data["targets"]:
        print(f"target {t['target']}: {t['value']} ({t['verdict']})")
    broken = ctx.lost or any(p["status"].startswith("error") for p in report.data["parts"])
    return 1 if report.data["all_checks_passed"] is False or broken else 0


def _decisive_report(args, device, sizes: DecisiveSizes, peak, prediction: dict, gpu: dict) -> Report:
    primary = GPTConfig.from_name(sizes.model, block_size=sizes.block_size)
    env = base_environment(device, peak, git_commit(args.commit))
    env |= {"attention_auto_asked": describe_kernel(select_kernel("auto", device), device),
            "attention_backends": available_backends(device), "flash_attn": flash_attn_status() or "usable",
            "jsonargparse": "installed" if importlib.util.find_spec("jsonargparse") else "not installed"}  # fmt: skip
    data = {
        "preset": "decisive", "tiny": sizes.tiny, "environment": env, "model": primary.name,
        "model_block_size": primary.block_size, "sizes": asdict(sizes), "prediction": prediction,
        "gpu_prediction": gpu, "budget": {"total_s": sizes.budget_s}, "parts": [], "targets": [],
        "all_checks_passed": None, "checks": [], "kernels": [], "table": [], "longest": {}, "fit": {},
        "calibration": {}, "notes": DECISIVE_NOTES,
    }  # fmt: skip
    out = Path(args.out) if args.out else default_out(device, sizes.tiny)
    return Report(out, data, _render_decisive)


def _render_decisive(data: dict[str, Any]) -> str:
    data["targets"] = decisive_targets(data)
    data["elapsed_s"] = process_age_s()
    return decisive_markdown(data)


if __name__ == "__main__":
    sys.exit(main())
