"""Parts g and h of the decisive preset: the shipped long-context config trained through ``sppo fit``, and
``sppo-plan --calibrate`` written as a profile.

**g, sppo fit**: ``configs/llama-3.2-1b-128k.yaml`` as shipped, run as ``sppo fit --config <shipped> --config
<overrides>`` (``python -m lightning_sppo.training.cli``, the ``sppo`` script's own module: the device machine has the
checkout, not an installed package) in a child process. The overrides change only what a lent GPU needs: two steps,
random weights (``model.init_from: null``: no download), a synthetic token file of packed documents (random ids, mean
length 8K, as the config assumes) in a temporary folder, no validation, no checkpoint (a 1B model's AdamW state is
15 GB to write), and the CSV logger alone (the device image has no wandb). Everything else (the strategy's settings,
precision, the model, the sequence length) is the config's. The step time is ``perf/step_s`` of the last step
(``SPPOMetrics``), beside ``sppo-plan``'s prediction for exactly those settings (documents and AdamW included).
``sppo fit`` needs jsonargparse (``LightningCLI``), which the device image lacks: docs/benchmarks.md says how the GPU
session carries its wheels; without it the row says so.

**h, calibrate**: ``sppo-plan --calibrate --out <report folder>/profile.json`` (on CPU: ``--device cpu --quick``, which
checks the code, not a profile), beside the values of the built-in profile the preset planned with.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from gpu_checks import release_memory
from suite_alloc import allocation_failure
from suite_state import ROOT, Context, first_line

from lightning_sppo.data.token_file import write_tokens
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner import NoFeasiblePlan, Plan, PlanRequest, solve

__all__ = ["DOCUMENT_LENGTH", "fit_plan", "predict_fit", "run_calibrate", "run_sppo_fit", "shipped_settings"]

DOCUMENT_LENGTH = 8192
"""Mean length of the synthetic packed documents: what the shipped config was planned for (``--document-length 8K``)."""
PROFILE_KEYS = (
    "mfu",
    "d2h_gbps",
    "h2d_gbps",
    "hbm_bytes",
    "elementwise_gbps",
    "host_op_s",
    "kernel_s",
    "context_bytes",
)


def shipped_settings(sizes: Any) -> dict[str, Any]:
    """The shipped config's model, sequence length and strategy settings, with the tiny sizes' replacements."""
    import yaml  # PyYAML: jsonargparse's own dependency, on every machine that can run `sppo fit`

    shipped = yaml.safe_load((ROOT / sizes.fit_config).read_text())
    strategy = dict(shipped["trainer"]["strategy"]["init_args"]) | dict(sizes.fit_strategy)
    return {"model": sizes.fit_model or shipped["model"]["model"],
            "seq_len": sizes.fit_seq_len or shipped["data"]["seq_len"], "strategy": strategy}  # fmt: skip


def fit_plan(sizes: Any, profile: Any) -> Plan | NoFeasiblePlan:
    """``sppo-plan``'s prediction for the config's own settings on one GPU, packed documents and AdamW included."""
    shipped = shipped_settings(sizes)
    s, config = shipped["strategy"], GPTConfig.from_name(shipped["model"])
    try:
        return solve(PlanRequest(
            config=config, seq_len=shipped["seq_len"], nodes=1, profile=profile, precision="bf16-mixed", sp=1, pp=1,
            num_subsequences=s["num_subsequences"], offload=(s["offload"],), recompute=(s["recompute"],),
            partition=(s["partition"],), granularity=s["granularity"], schedule=(s["schedule"],),
            document_length=min(DOCUMENT_LENGTH, shipped["seq_len"]), model_state=("device",), order=("subsequence",),
        ))  # fmt: skip
    except NoFeasiblePlan as error:
        return error


def predict_fit(sizes: Any, profile: Any) -> float:
    """Seconds of part g: the process's start and set-up (``Overheads.fit_startup_s``) and every step as planned."""
    plan = fit_plan(sizes, profile)
    step_s = plan.step_time_s if isinstance(plan, Plan) else 0.0
    return sizes.overheads.fit_startup_s + sizes.fit_steps * step_s


def run_sppo_fit(ctx: Context) -> str | None:
    sizes, planner = ctx.sizes, ctx.cache["planner"]
    shipped = shipped_settings(sizes)
    plan = fit_plan(sizes, planner.profile)
    entry: dict[str, Any] = {"config": sizes.fit_config, "model": shipped["model"], "seq_len": shipped["seq_len"],
                             "steps": sizes.fit_steps, "settings": shipped["strategy"]}  # fmt: skip
    if isinstance(plan, Plan):
        entry["prediction"] = {"step_s": plan.step_time_s, "peak_gpu_bytes": plan.peak_gpu_bytes,
                               "tokens_per_gpu_per_s": plan.tokens_per_gpu_per_s, "kernel": plan.attention_kernel,
                               "profile": planner.source, "document_length": DOCUMENT_LENGTH}  # fmt: skip
    else:
        entry["prediction"] = {"why_not": first_line(plan)}
    ctx.data["fit"] = entry
    needed = predict_fit(sizes, planner.profile)
    if importlib.util.find_spec("jsonargparse") is None:
        entry["status"] = (
            "skipped: jsonargparse is not installed here (`sppo fit` needs it; docs/benchmarks.md: carry its wheels)"
        )
    elif not ctx.budget.affords(needed):
        entry["status"] = f"skipped (predicted {needed:.0f} s, {ctx.budget.left():.0f} s left in the part)"
    else:
        ctx.cache.pop("model", None)  # the suite's model and cached blocks leave the device to the child
        release_memory(ctx.device)
        entry |= _fit(ctx, shipped, entry["prediction"].get("step_s"))
    ctx.save()
    print(f"sppo fit: {entry['status']} {entry.get('step_s') or ''}", flush=True)
    return None if entry["status"] == "ok" or entry["status"].startswith(("skipped", "OOM")) else entry["status"]


def _fit(ctx: Context, shipped: dict[str, Any], predicted_s: float | None) -> dict[str, Any]:
    sizes = ctx.sizes
    with tempfile.TemporaryDirectory(prefix="gpu_suite_fit_") as folder:
        work = Path(folder)
        config = GPTConfig.from_name(shipped["model"])
        _write_documents(work / "tokens", config.vocab_size, (sizes.fit_steps + 2) * (shipped["seq_len"] + 1))
        overrides = work / "overrides.yaml"  # JSON is YAML: jsonargparse reads it as a config file
        overrides.write_text(json.dumps(_overrides(sizes, work, ctx.device.type), indent=1))
        command = [sys.executable, "-m", "lightning_sppo.training.cli", "fit", "--config", str(ROOT / sizes.fit_config),
                   "--config", str(overrides)]  # fmt: skip
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        started = time.monotonic()
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(1.0, ctx.budget.left()))  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"status": "stopped: the part's time ran out", "wall_s": time.monotonic() - started}
        out: dict[str, Any] = {"wall_s": time.monotonic() - started, "exit_status": done.returncode,
                               "command": "sppo fit --config " + sizes.fit_config + " --config <overrides>",
                               "overrides": json.loads(overrides.read_text())}  # fmt: skip
        metrics = sorted(work.glob("run/csv/*/metrics.csv"))
        if done.returncode != 0 or not metrics:
            return out | _failure(done.stdout + done.stderr)
        return out | _metrics(metrics[-1], shipped["seq_len"], predicted_s)


def _overrides(sizes: Any, work: Path, device: str) -> dict[str, Any]:
    """What the lent GPU changes in the shipped config (module docstring); the tiny sizes change the model too."""
    trainer: dict[str, Any] = {
        "max_steps": sizes.fit_steps, "limit_val_batches": 0, "default_root_dir": str(work / "run"),
        "enable_checkpointing": False, "log_every_n_steps": 1,
        "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "", "name": "csv"}}],
        "callbacks": [{"class_path": "lightning_sppo.callbacks.SPPOMetrics"}],
    }  # fmt: skip
    if device == "cpu":
        trainer["accelerator"] = "cpu"
    if sizes.fit_strategy:
        trainer["strategy"] = {"init_args": dict(sizes.fit_strategy)}
    model: dict[str, Any] = {"init_from": None}
    data: dict[str, Any] = {"path": str(work / "tokens"), "val_fraction": 0.0}
    if sizes.fit_model:
        model["model"] = sizes.fit_model
    if sizes.fit_seq_len:
        data["seq_len"] = sizes.fit_seq_len
    return {"trainer": trainer, "model": model, "data": data}


def _write_documents(path: Path, vocab_size: int, total: int) -> None:
    """Random ids in documents of geometric lengths (mean ``DOCUMENT_LENGTH``, at least 1), ``total`` tokens or more."""
    rng = np.random.default_rng(0)
    documents, written = [], 0
    while written < total:
        n = int(rng.geometric(1 / DOCUMENT_LENGTH))
        documents.append(rng.integers(0, vocab_size, n, dtype=np.int64))
        written += n
    write_tokens(path, documents, vocab_size, tokenizer="random ids (gpu_suite)")


def _metrics(path: Path, seq_len: int, predicted_s: float | None) -> dict[str, Any]:
    """The last logged step's ``perf/step_s`` (the first step warms up) and what was logged beside it."""
    rows = [r for r in csv.DictReader(path.open()) if r.get("perf/step_s")]
    if not rows:
        return {"status": "error: no perf/step_s in metrics.csv"}
    last = rows[-1]
    keep = ("perf/step_s", "perf/tokens_per_s", "perf/mfu", "memory/peak_allocated_gib_max",
            "memory/peak_reserved_gib_max", "train/loss", "pipeline/num_subsequences")  # fmt: skip
    logged = {k: float(last[k]) for k in keep if last.get(k) not in (None, "")}
    step_s = logged["perf/step_s"]
    result = {"status": "ok", "step_s": step_s, "tokens_per_s": seq_len / step_s, "logged": logged,
              "steps_logged": len(rows)}  # fmt: skip
    if predicted_s:
        result["time_error"] = step_s / predicted_s - 1
    return result


def _failure(output: str) -> dict[str, Any]:
    """A run that ended without metrics: "OOM" and what failed when its output names a failed allocation."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        what = allocation_failure(RuntimeError(line)) if "memory" in line.lower() or "alloc" in line.lower() else None
        if what is not None:
            return {"status": "OOM", "does_not_fit": what, "log_tail": lines[-5:]}
    return {"status": "error: sppo fit failed", "log_tail": lines[-8:]}


def run_calibrate(ctx: Context) -> str | None:
    """Part h: ``sppo-plan --calibrate`` into ``profile.json`` beside the report, and the profile's values beside
    those of the built-in profile the preset planned with."""
    from lightning_sppo.planner.cli import main as sppo_plan

    out = ctx.report.out / "profile.json"
    args = ["--calibrate", "--out", str(out)] + (["--device", "cpu", "--quick"] if ctx.device.type == "cpu" else [])
    started = time.monotonic()
    status = sppo_plan(args)
    entry: dict[str, Any] = {"command": "sppo-plan " + " ".join(args).replace(str(ctx.report.out) + "/", ""),
                             "exit_status": status, "seconds": time.monotonic() - started}  # fmt: skip
    ctx.data["calibration"] = entry
    if status != 0 or not out.exists():
        entry["status"] = f"error: sppo-plan --calibrate exited {status}"
        return entry["status"]
    measured = json.loads(out.read_text())
    builtin = ctx.cache["planner"].profile.to_dict()
    entry |= {"status": "ok", "profile": "profile.json",
              "values": {k: {"calibrated": measured.get(k), "planned_with": builtin.get(k)} for k in PROFILE_KEYS
                         if k in measured or k in builtin}}  # fmt: skip
    ctx.save()
    return None
