"""The GPU suite's decisive preset: what settles "faster and longer than activation checkpointing?" in one device
call of at most 8 minutes on one H100, ordered by what decides (``python benchmarks/gpu_suite.py --preset decisive``).

Parts, in this order, the report (JSON and Markdown) written after every check and row:

a. ``checks``: correctness, in a child process (``suite_paths.py``): kernels against float64, the engine, documents,
   offload with delayed copies, and every memory path against the plain model in bf16, with negative controls; a
   device-side assert there cannot poison this process's CUDA context;
b. ``kernels``: the attention kernel each backend runs at the decisive shapes (16K and 32K chunks, causal and not:
   the layer order's calls), with its TFLOP/s and the planner's prediction (``suite_kernels.py``);
c. ``long``: gpt-1b at 128K: plain + full activation checkpointing ("AC"), the planner's own choice, the layer order;
d. ``longer``: the same three at 256K;
e. ``n1_overhead``: engine N=1 against the plain model at 16K and 32K;
f. ``longest``: the longest sequence of the layer order and of AC, measured on slices of the model (full width, one
   and two layers) and extrapolated to all layers, the method printed beside the figures (``suite_slice.py``);
g. ``sppo_fit``: llama-3.2-1b at 128K with the shipped ``configs/llama-3.2-1b-128k.yaml`` through ``sppo fit`` (two
   steps, random weights, CSV logger, synthetic packed documents; ``suite_fit.py``);
h. ``calibrate``: ``sppo-plan --calibrate``, written as ``profile.json`` beside the report.

Every row carries the planner's prediction (``suite_predict``) beside the measurement and the attention kernels that
ran (``suite_profiler``). The budget is the prediction: a part's share of the 8 minutes is its predicted time, a cell
starts only if its predicted time fits what its part has left (else it says so), and a part predicted to overrun what
is left is not started. A failed allocation of any kind is "does not fit" and names what failed (``suite_alloc``).

``--device cpu`` runs every part on tiny sizes (``DECISIVE_CPU``) and prints the real preset's predicted GPU time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from gpu_checks import batch, release_memory
from suite_alloc import does_not_fit
from suite_fit import predict_fit, run_calibrate, run_sppo_fit, shipped_settings
from suite_kernels import predict_decisive_kernels, run_decisive_kernels
from suite_paths import ENDED, PATHS
from suite_predict import (
    AC,
    CPU_OVERHEADS,
    ENGINE_N1,
    LAYER,
    OVERHEADS,
    PLAIN,
    PLANNER,
    Overheads,
    planner_kernel,
    prediction_entry,
    run_prediction,
    steps_for,
)
from suite_runs import (
    ADAPTIVE_MEASURE_STEPS,
    ENGINE_N1_SETTINGS,
    LAYER_SETTINGS,
    SuitePlanner,
    add_ratios,
    close_run,
    make_run,
    profiled_measure,
    suite_config,
    suite_model,
)
from suite_slice import predict_slices, run_slice_longest
from suite_state import ROOT, Context, first_line

from lightning_sppo.callbacks.mfu import training_flops_per_token
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.offload import DEFAULT_MIN_BYTES
from lightning_sppo.planner import NoFeasiblePlan, Plan
from lightning_sppo.planner.costs import resolve_attention
from lightning_sppo.strategy.autoplan import plan_settings

__all__ = [
    "DECISIVE",
    "DECISIVE_CPU",
    "LIMIT_S",
    "PART_TITLES",
    "DecisiveSizes",
    "cell_prediction",
    "decisive_cells",
    "decisive_parts",
    "predict_parts",
    "print_prediction",
    "follow_child",
    "run_cells",
    "run_checks_child",
]

K = 1024
LIMIT_S = 480.0
"""One device call: at most 8 minutes of the preset (the call's own timeout leaves room for one cell's overrun)."""
CHECKS_LIMIT_S = 60.0
"""The checks may run this long on one H100 even where their share of the budget is less (issue 40: at most 60 s)."""


@dataclass(frozen=True)
class DecisiveSizes:
    """What the decisive preset measures; ``DECISIVE_CPU`` is the same on tiny sizes."""

    tiny: bool = False
    model: str = "gpt-1b"
    long_lens: tuple[int, int] = (128 * K, 256 * K)
    """Parts c and d."""
    overhead_lens: tuple[int, ...] = (16 * K, 32 * K)
    """Part e."""
    layer_chunk_count: int | None = None
    """Chunks of the layer order's rows; None: ``num_subsequences="auto"`` (16K-token chunks)."""
    kernel_lens: tuple[int, ...] = (16 * K, 32 * K)
    """Part b: square calls of these lengths, causal (a diagonal chunk) and not (a prefix block)."""
    kernel_repeats: int = 2
    slice_layers: tuple[int, int] = (1, 2)
    slice_lens: tuple[int, int] = (32 * K, 64 * K)
    """Part f: each slice at these lengths (the fit), then the longer slice at ``slice_check_len`` (its check)."""
    slice_check_len: int = 256 * K
    fit_config: str = "configs/llama-3.2-1b-128k.yaml"
    fit_model: str | None = None
    """Part g: the config's model, or (tiny) this one."""
    fit_seq_len: int | None = None
    fit_strategy: tuple[tuple[str, Any], ...] = ()
    """Tiny only: strategy settings replaced (a 256-token sequence cannot take the config's 128-token granules)."""
    fit_steps: int = 2
    """The first warms up; ``perf/step_s`` of the last is the measurement."""
    budget_s: float = LIMIT_S
    repeats: int = 3
    min_bytes: int = DEFAULT_MIN_BYTES
    """The offloader's smallest unit sent to the host (tiny models: 0, or nothing is sent)."""
    planner_hbm_bytes: int | None = None
    """Tiny only: the planner's device memory, squeezed so that it must cut, offload and recompute tiny models."""
    planner_options: tuple[tuple[str, Any], ...] = ()

    @property
    def block_size(self) -> int:
        return max(*self.long_lens, *self.overhead_lens, self.slice_check_len)

    @property
    def overheads(self) -> Overheads:
        return CPU_OVERHEADS if self.tiny else OVERHEADS


DECISIVE = DecisiveSizes()
DECISIVE_CPU = DecisiveSizes(
    tiny=True, model="tiny-gqa", long_lens=(512, 1024), overhead_lens=(128, 256), layer_chunk_count=4,
    kernel_lens=(128, 256), kernel_repeats=1, slice_lens=(256, 512), slice_check_len=1024, fit_model="tiny-gqa",
    fit_seq_len=256, fit_strategy=(("num_subsequences", 2), ("granularity", 1)), budget_s=900.0, repeats=1,
    min_bytes=0, planner_hbm_bytes=6 * 2**20,
    planner_options=(("min_tokens_per_device", 128), ("model_state", ("device",)), ("offload", ("adaptive",))),
)  # fmt: skip
"""``--device cpu``: every part on tiny sizes, in well under 2 minutes on 2 cores (budget 900 s: a slow machine
skips nothing)."""

PART_TITLES = {
    "checks": "a. correctness: every memory path against the plain model (child process)",
    "kernels": "b. the attention kernel each backend runs at the decisive shapes, TFLOP/s",
    "long": "c. {model} at {long}: plain + AC, the planner's choice, the layer order",
    "longer": "d. {model} at {longer}: the same three",
    "n1_overhead": "e. engine N=1 against the plain model at {overhead}",
    "longest": "f. the longest sequence of the layer order and of AC, from slices of the model",
    "sppo_fit": "g. {fit_model} at {fit_len} through `sppo fit` ({fit_config})",
    "calibrate": "h. `sppo-plan --calibrate`, written as profile.json",
}


def tokens(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n // K}K" if n % K == 0 and n >= K else str(n)


def part_title(name: str, sizes: DecisiveSizes, fit_model: str, fit_len: int) -> str:
    return PART_TITLES[name].format(
        model=sizes.model, long=tokens(sizes.long_lens[0]), longer=tokens(sizes.long_lens[1]),
        overhead=" and ".join(tokens(s) for s in sizes.overhead_lens), fit_model=fit_model, fit_len=tokens(fit_len),
        fit_config=sizes.fit_config,
    )  # fmt: skip


# -- the parts and their predicted time ------------------------------------------------------------------------

GPU_BACKENDS = ["flash", "cudnn", "sdpa_autograd"]
"""The kernel part's backends on the lent H100 (its image has no flash-attn), for a prediction made elsewhere."""


def decisive_parts() -> dict[str, Callable[[Context], str | None]]:
    """Each part's function, in the order the preset runs them."""
    return {
        "checks": run_checks_child, "kernels": run_decisive_kernels, "long": partial(run_cells, part="long"),
        "longer": partial(run_cells, part="longer"), "n1_overhead": partial(run_cells, part="n1_overhead"),
        "longest": run_slice_longest, "sppo_fit": run_sppo_fit, "calibrate": run_calibrate,
    }  # fmt: skip


def check_runs() -> int:
    """Steps the checks' path comparisons take (``suite_paths``): two per model (fp32 truth, plain bf16), one per
    path (two for adaptive offload, which measures first), the negative control, and the offload negative control's
    three."""
    models = {(p.variant, p.documents) for p in PATHS}
    return 2 * len(models) + len(PATHS) + sum(p.offload == "adaptive" for p in PATHS) + 1 + 3


def predict_parts(sizes: DecisiveSizes, planner: SuitePlanner, backends: list[str]) -> dict[str, Any]:
    """Every part's predicted seconds (and the start's), their total, and whether it fits ``LIMIT_S``: what the
    preset prints before it starts and budgets each part with."""
    overheads, profile = sizes.overheads, planner.profile
    config = GPTConfig.from_name(sizes.model, block_size=sizes.block_size)
    shipped = shipped_settings(sizes)
    seconds = {
        "checks": overheads.child_s + overheads.legacy_checks_s + check_runs() * overheads.check_run_s,
        "kernels": predict_decisive_kernels(sizes, profile, backends),
        **{part: sum(cell_prediction(config, run, s, sizes, planner).seconds for run, s in decisive_cells(sizes, part))
           for part in ("long", "longer", "n1_overhead")},
        "longest": predict_slices(sizes, config, profile),
        "sppo_fit": predict_fit(sizes, profile),
        "calibrate": overheads.calibrate_s,
    }  # fmt: skip
    parts = [
        {"part": "start", "title": "imports, the CUDA context, the environment", "predicted_s": overheads.startup_s}
    ]
    parts += [{"part": name, "title": part_title(name, sizes, shipped["model"], shipped["seq_len"]), "predicted_s": s}
              for name, s in seconds.items()]  # fmt: skip
    total = sum(p["predicted_s"] for p in parts)
    return {"profile": planner.source, "parts": parts, "total_s": total, "limit_s": sizes.budget_s,
            "fits": total <= sizes.budget_s}  # fmt: skip


def print_prediction(prediction: dict[str, Any], what: str) -> None:
    print(f"predicted GPU time, {what} ({prediction['profile']}):", flush=True)
    for p in prediction["parts"]:
        print(f"  {p['predicted_s']:6.0f} s  {p['part']:<12} {p['title']}")
    verdict = "within" if prediction["fits"] else "OVER"
    print(f"  {prediction['total_s']:6.0f} s  total, {verdict} the {prediction['limit_s']:.0f} s limit", flush=True)


# -- the cells of parts c, d, e ---------------------------------------------------------------------------------


def decisive_cells(sizes: DecisiveSizes, part: str) -> list[tuple[str, int]]:
    """(run, S) of each cell of part c ("long"), d ("longer") or e ("n1_overhead"), in order."""
    if part in ("long", "longer"):
        seq_len = sizes.long_lens[part == "longer"]
        return [(AC, seq_len), (PLANNER, seq_len), (LAYER, seq_len)]
    return [(run, s) for s in sizes.overhead_lens for run in (PLAIN, ENGINE_N1)]


def layer_settings(sizes: DecisiveSizes) -> dict[str, Any]:
    chunks = {} if sizes.layer_chunk_count is None else {"num_subsequences": sizes.layer_chunk_count}
    return LAYER_SETTINGS | chunks


@dataclass
class CellPrediction:
    """What the planner predicts of one cell, and what the cell will cost."""

    settings: dict[str, Any] | None
    plan: Plan | None
    step: Any
    """``planner.fit.Prediction``; None when the planner has no plan."""
    kernel: str
    untimed: int
    timed: int
    seconds: float
    why_not: str | None = None

    def entry(self, source: str) -> dict[str, Any]:
        if self.step is None:
            return {"why_not": self.why_not, "cell_s": self.seconds}
        steps = {"untimed": self.untimed, "timed": self.timed}
        return prediction_entry(self.step, self.kernel, source) | {"cell_s": self.seconds, "steps": steps}


def cell_prediction(
    config: GPTConfig, run: str, seq_len: int, sizes: DecisiveSizes, planner: SuitePlanner
) -> CellPrediction:
    """The planner's step time and peak for a cell, its steps (``suite_predict.steps_for``) and its predicted seconds:
    the steps times the predicted step, plus the cell's fixed set-up (``Overheads.cell_s``)."""
    profile, overheads, plan, settings = planner.profile, sizes.overheads, None, None
    if run == PLANNER:
        try:
            plan = planner.plan(config, seq_len)
        except NoFeasiblePlan as error:
            return CellPrediction(None, None, None, "", 0, 0, 0.0, f"no plan: {first_line(error)}")
        settings = plan_settings(plan)
    elif run == LAYER:
        settings = layer_settings(sizes)
    elif run == ENGINE_N1:
        settings = ENGINE_N1_SETTINGS
    lengths = list(plan.partition) if plan is not None else None
    step = run_prediction(config, run, seq_len, profile, settings=settings, lengths=lengths,
                          layer_chunk_count=sizes.layer_chunk_count)  # fmt: skip
    kernel = profile.sdpa_attention if settings is None else resolve_attention("auto", profile)
    measuring = ADAPTIVE_MEASURE_STEPS if (settings or {}).get("offload") == "adaptive" else 0
    untimed, timed = steps_for(step.step_s, measuring=measuring, overheads=overheads, repeats=sizes.repeats)
    seconds = step.step_s * (untimed + timed) + overheads.cell_s
    return CellPrediction(settings, plan, step, kernel, untimed, timed, seconds)


def run_cells(ctx: Context, part: str) -> None:
    """Part c, d or e: each cell in turn, budgeted by its prediction; the report is written after each."""
    failed: set[str] = ctx.cache.setdefault("failed_runs", set())
    try:
        for run, seq_len in decisive_cells(ctx.sizes, part):
            row = _cell(ctx, part, run, seq_len, failed)
            ctx.data["table"].append(row)
            add_ratios(ctx.data["table"], seq_len)
            ctx.save()
            print(_progress(row), flush=True)
    finally:
        if part != "long":  # 128K's pinned host blocks serve 256K's first (and only) step: steady state, not pinning
            release_memory(ctx.device)


def _cell(ctx: Context, part: str, run: str, seq_len: int, failed: set[str]) -> dict[str, Any]:
    sizes, planner = ctx.sizes, ctx.cache["planner"]
    config = suite_config(ctx, sizes.model)
    row: dict[str, Any] = {"part": part, "run": run, "model": config.name, "seq_len": seq_len}
    if run in failed:
        return row | {"status": "skipped (did not fit at a shorter S)"}
    predicted = cell_prediction(config, run, seq_len, sizes, planner)
    row["prediction"] = predicted.entry(planner.source)
    if predicted.step is None:
        return row | {"status": "no plan", "error": predicted.why_not}
    if predicted.settings is not None:
        row["settings"] = predicted.settings
    if not ctx.budget.affords(predicted.seconds):
        return row | {"status": f"skipped (predicted {predicted.seconds:.0f} s, {ctx.budget.left():.0f} s left in"
                                f" the part)"}  # fmt: skip
    model = suite_model(ctx, sizes.model)
    ids, targets = batch(model.config, seq_len, ctx.device)
    started, made = time.monotonic(), None
    try:
        made = make_run(ctx, run, model, ids, targets, predicted.settings)
        row["attention_asked"] = made.attention
        row |= profiled_measure(made, ctx.device, predicted.untimed, predicted.timed)
        row |= _measured(ctx, config, made, row)
    except Exception as error:  # a failed allocation, or a broken path: a result, the report must still be written
        not_fit = does_not_fit(error)
        if not_fit is not None:
            failed.add(run)
        row |= not_fit or {"status": f"error: {type(error).__name__}", "error": first_line(error)}
    finally:
        close_run(made, row)
        del made, ids, targets
        model.zero_grad(set_to_none=True)
        release_memory(ctx.device, host=False)  # pinned blocks stay cached: the next cell's run reuses them
    row["wall_s"] = time.monotonic() - started
    return row


def _measured(ctx: Context, config: GPTConfig, made: Any, row: dict[str, Any]) -> dict[str, Any]:
    """Throughput, MFU and host bytes of a timed cell, and the planner's prediction again with the kernel that ran
    and the engine's own lengths, each error beside it."""
    seq_len, planner = row["seq_len"], ctx.cache["planner"]
    tokens_per_s = seq_len / row["seconds"]
    flops = training_flops_per_token(config, seq_len) * tokens_per_s
    out: dict[str, Any] = {"status": "ok", "tokens_per_s": tokens_per_s, "host_bytes": made.host_bytes(),
                           "mfu": flops / ctx.peak_flops if ctx.peak_flops else None}  # fmt: skip
    if made.planner is not None:
        out["planner"] = made.planner()  # the run as sppo-plan --fit-suite predicts it
    default = row["prediction"]["kernel"]
    kernel = planner_kernel(row.get("attention"), default)
    lengths = (out.get("planner") or {}).get("partition")
    again = run_prediction(config, row["run"], seq_len, planner.profile, kernel=kernel, settings=row.get("settings"),
                           lengths=lengths, layer_chunk_count=ctx.sizes.layer_chunk_count)  # fmt: skip
    as_ran = prediction_entry(again, kernel, planner.source)
    as_ran["time_error"] = row["seconds"] / again.step_s - 1
    if row.get("peak_allocated_bytes"):
        as_ran["peak_error"] = row["peak_allocated_bytes"] / again.allocated_bytes - 1
    out["prediction_as_ran"] = as_ran
    return out


def _progress(row: dict[str, Any]) -> str:
    what = f"{row['model']} {row['run']:<18} S={tokens(row['seq_len']):>6}"
    predicted = (row.get("prediction") or {}).get("step_s")
    beside = f" (planner {predicted:.3g} s)" if predicted else ""
    if row["status"] != "ok":
        return f"{what}  {row['status']}{beside}"
    return f"{what}  {row['tokens_per_s']:>9.0f} tok/s  {row['seconds']:.3f} s/step{beside}  {row['attention']}"


# -- part a: the checks, in a child process ----------------------------------------------------------------


def run_checks_child(ctx: Context) -> str | None:
    """``suite_paths.py`` in a child process (``follow_child``)."""
    command = [sys.executable, str(ROOT / "benchmarks" / "suite_paths.py"), "--device", ctx.device.type,
               "--copy-delay-ms", str(ctx.cache["copy_delay_ms"])]  # fmt: skip
    if ctx.sizes.tiny:
        command.append("--tiny")
    return follow_child(ctx, command)


def follow_child(ctx: Context, command: list[str]) -> str | None:
    """Runs ``command --out FILE``; each check it writes to FILE (one JSON line) joins the report as it lands. A child
    that dies (a device-side assert, a crash) is a failed check with the end of its output, after the checks it wrote;
    one that would overrun the part is stopped, and says so."""
    with tempfile.TemporaryDirectory(prefix="gpu_suite_checks_") as folder:
        lines, log = Path(folder) / "checks.jsonl", Path(folder) / "log"
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with log.open("w") as out:
            child = subprocess.Popen([*command, "--out", str(lines)], cwd=ROOT, env=env, stdout=out,
                                     stderr=subprocess.STDOUT)  # fmt: skip
            stopped = _follow(ctx, child, lines)
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    if stopped:
        _add_checks(ctx, [{"name": ENDED, "passed": False, "detail": stopped}])
        return f"stopped: {stopped}"
    ended = [c for c in ctx.data["checks"] if c["name"] == ENDED]
    if not ended:  # killed or crashed before its last line (a device-side assert aborts the process)
        detail = f"exit status {child.returncode}; its last lines: {' | '.join(tail)[:600]}"
        _add_checks(ctx, [{"name": ENDED, "passed": False, "detail": detail}])
    if not ended or ended[-1]["passed"] is False:
        return f"error: the checks' child process ended with status {child.returncode}"
    return None


def _follow(ctx: Context, child: subprocess.Popen, lines: Path) -> str | None:
    """Reads the child's checks as they land until it ends; stops it (returns why) when its time is up: the part's,
    or ``CHECKS_LIMIT_S`` where that is longer (correctness comes first; the later parts give way)."""
    offset, limit, started = 0, max(ctx.budget.left(), CHECKS_LIMIT_S), time.monotonic()
    while True:
        ended = child.poll() is not None
        offset = _read_new(ctx, lines, offset)
        if ended:
            return None
        if time.monotonic() - started > limit:
            child.kill()  # the child this part started, by its handle
            child.wait()
            _read_new(ctx, lines, offset)
            return f"its time ran out ({limit:.0f} s); the checks after the last one here did not run"
        time.sleep(0.25)


def _read_new(ctx: Context, lines: Path, offset: int) -> int:
    """Adds the complete lines written after ``offset``; returns the new offset."""
    if not lines.exists():
        return offset
    with lines.open("rb") as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]  # a line the child is still writing waits for the next read
    checks = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
    if checks:
        _add_checks(ctx, checks)
    return offset + len(complete)


def _add_checks(ctx: Context, checks: list[dict[str, Any]]) -> None:
    ctx.data["checks"] += checks
    ctx.data["all_checks_passed"] = all(c["passed"] is not False for c in ctx.data["checks"])
    ctx.save()
    for c in checks:
        result = {True: "pass", False: "FAIL", None: "n/a"}[c["passed"]]
        ran = f" [{c['attention']}]" if c.get("attention") else ""
        print(f"{result:<4}  {c['name']}{ran}", flush=True)


def tiny_planner_profile(sizes: DecisiveSizes, profile: Any) -> Any:
    """The tiny sizes' planner device: squeezed so that the planner cuts, offloads and recomputes tiny models."""
    if sizes.planner_hbm_bytes is None:
        return profile
    return replace(profile, hbm_bytes=sizes.planner_hbm_bytes, reserved_bytes=2**20, host_bytes_per_gpu=2**30,
                   allocator_slack_bytes=0, context_bytes=0)  # fmt: skip
