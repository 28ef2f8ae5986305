"""What the planner predicts of each run the GPU suite measures, and how long each cell and part will take.

Why: every row of the decisive preset carries the planner's prediction beside its measurement (the planner is what is
being tested), and the preset budgets by prediction: a cell's time is the planner's predicted step time times its
steps, plus a fixed set-up (never 0 s: a cell that was never measured still has a prediction), and the preset prints
its predicted GPU time before it starts.

One function predicts every kind of run: ``lightning_sppo.planner.fit.predict`` (what ``sppo-plan --fit-suite`` checks
measured steps against), which models the plain model with and without full activation checkpointing, the engine in
the subsequence order and the layer order, with the run's own partition, offload, recompute, K/V spill and attention
kernel, and no optimizer step (the suite's steps have none).

The fixed costs are not the planner's: ``Overheads`` says where each comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner import HardwareProfile, Plan
from lightning_sppo.planner.costs import CostModel, resolve_attention
from lightning_sppo.planner.fit import SuiteRun, predict
from lightning_sppo.planner.precision import precision_bytes
from lightning_sppo.step_plan import LAYER_CHUNK_TOKENS

__all__ = [
    "AC",
    "CPU_OVERHEADS",
    "ENGINE_N1",
    "LAYER",
    "PLAIN",
    "PLANNER",
    "LAYER_CHUNK",
    "OVERHEADS",
    "Overheads",
    "attention_call_seconds",
    "planner_kernel",
    "prediction_entry",
    "run_prediction",
    "steps_for",
]

PLAIN, AC, ENGINE_N1, PLANNER, LAYER = "plain", "plain + AC", "engine N=1", "planner's choice", "layer order"
"""The runs the suite measures (row labels): the plain model, with every block checkpointed, the engine at N=1, the
planner's own choice, the layer order."""
LAYER_CHUNK = LAYER_CHUNK_TOKENS
"""Tokens per chunk of the layer order under ``num_subsequences="auto"`` on one device (the step plan's): the
prediction before a run; after it, the engine's own lengths."""


@dataclass(frozen=True)
class Overheads:
    """Seconds the planner does not model, on one H100 (CPU runs: the same code, other figures)."""

    startup_s: float = 15.0
    """Python, torch and lightning_sppo imports, the CUDA context, the environment (the first H100 run: its parts took
    301 s of its 311 s)."""
    cell_s: float = 5.0
    """Around one cell of runs besides its steps: building the run (the strategy's set-up), memory released, garbage
    collected (the first H100 run: 187 s for 15 cells at 16K whose steps predict about 60 s: ~8 s each, its
    offloaded rows pinning host memory included)."""
    probe_s: float = 3.0
    """Around one step of the longest part's slices (a model of one or two layers, no strategy for AC)."""
    child_s: float = 15.0
    """Starting the checks' child process: imports and its own CUDA context."""
    check_run_s: float = 0.4
    """One step of a check model (3 layers, 4K tokens) with its comparison: launches, not FLOPs (the first H100 run:
    its ~20 check steps in 6 s)."""
    legacy_checks_s: float = 8.0
    """``gpu_checks.run_checks`` on its own (the first H100 run: 6 s; more checks since)."""
    kernel_row_s: float = 0.5
    """Around one attention-kernel row: inputs made, a profiled call, memory released."""
    fit_startup_s: float = 40.0
    """``sppo fit`` before its first step: a new process (imports, jsonargparse, Lightning's Trainer), the model built
    and placed, the data module."""
    calibrate_s: float = 60.0
    """``sppo-plan --calibrate``: "about a minute on a GPU" (``planner.calibrate``)."""
    warm_limit_s: float = 20.0
    """A predicted step longer than this is timed on its first step, without a warm-up (it says so): at 256K a
    warm-up would double the cell."""


OVERHEADS = Overheads()
CPU_OVERHEADS = Overheads(startup_s=10.0, cell_s=0.5, probe_s=0.3, child_s=10.0, check_run_s=0.1,
                          legacy_checks_s=5.0, kernel_row_s=0.05, fit_startup_s=15.0, calibrate_s=5.0,
                          warm_limit_s=20.0)  # fmt: skip
"""The same on this repository's 2-core CI machine, tiny sizes (what ``--device cpu`` budgets with)."""

_FAMILY_KERNELS = (("cudnn", "cudnn"), ("efficient", "efficient"), ("math", "math"), ("flash", "flash"))


def planner_kernel(label: str | None, default: str) -> str:
    """The planner's kernel (``planner.kernels.ATTENTION_KERNELS``) for the kernel a run was seen to run (its first,
    most used family: "cuDNN", "FA2 (ATen flash)", "flash-attn", "CPU flash", ...), else ``default``."""
    first = (label or "").split(" + ")[0].lower()
    return next((kernel for tag, kernel in _FAMILY_KERNELS if tag in first), default)


def layer_chunks(seq_len: int, chunks: int | None) -> tuple[int, ...]:
    """The layer order's chunk lengths: ``chunks`` of them, or as ``num_subsequences="auto"`` cuts."""
    n = chunks if chunks is not None else max(1, math.ceil(seq_len / LAYER_CHUNK))
    return tuple(split_sequence(seq_len, n, "length"))


def run_prediction(
    config: GPTConfig, run: str, seq_len: int, profile: HardwareProfile, *, kernel: str | None = None,
    settings: dict[str, Any] | None = None, lengths: list[int] | None = None, layer_chunk_count: int | None = None,
) -> Any:  # fmt: skip
    """The planner's ``Prediction`` (step seconds, allocated bytes at the peak, the allocator's slack) of one run:
    ``settings`` (``SPPOConfig`` keywords) for the planner's choice, ``lengths`` the engine's own cut where it ran.
    ``kernel``: the planner's kernel name; None: what the profile says each side runs (the engine's "auto", the plain
    model's SDPA pick)."""
    engine_kernel = kernel or resolve_attention("auto", profile)
    if run in (PLAIN, AC):
        spec = SuiteRun(name=run, config=config, partition=(seq_len,), plain=run == AC,
                        attention=kernel or profile.sdpa_attention, step_s=None)  # fmt: skip
    elif run == ENGINE_N1:
        spec = SuiteRun(name=run, config=config, partition=tuple(lengths or (seq_len,)), attention=engine_kernel,
                        kv_grads="before_last", step_s=None)  # fmt: skip
    elif run == LAYER:
        spec = SuiteRun(name=run, config=config, order="layer", recompute="selective", offload="full",
                        partition=tuple(lengths or layer_chunks(seq_len, layer_chunk_count)), attention=engine_kernel,
                        kv_grads="before_last", step_s=None)  # fmt: skip
    else:
        s = settings or {}
        partition = lengths or split_sequence(seq_len, s.get("num_subsequences", 1), s.get("partition") or "length",
                                              granularity=s.get("granularity", 1), config=config)  # fmt: skip
        spec = SuiteRun(name=run, config=config, partition=tuple(partition), offload=s.get("offload", "none"),
                        recompute=s.get("recompute", "none"), kv_device_tokens=s.get("kv_device_tokens"),
                        kv_chunk_tokens=s.get("kv_chunk_tokens") or 16384, kv_grad_dtype=s.get("kv_grad_dtype", "fp32"),
                        order=s.get("order", "subsequence"), attention=engine_kernel, kv_grads="before_last",
                        step_s=None)  # fmt: skip
    return predict(spec, profile)


def prediction_entry(prediction: Any, kernel: str, source: str) -> dict[str, Any]:
    """The ``planner`` entry a row carries beside its measurement."""
    return {"step_s": prediction.step_s, "peak_allocated_bytes": prediction.allocated_bytes,
            "peak_reserved_bytes": prediction.reserved_bytes, "kernel": kernel, "profile": source}  # fmt: skip


def plan_settings_prediction(config: GPTConfig, plan: Plan, profile: HardwareProfile) -> Any:
    """The planner's choice as a suite step predicts it (no optimizer), from the plan's own partition."""
    from lightning_sppo.strategy.autoplan import plan_settings

    return run_prediction(config, PLANNER, plan.seq_len, profile, settings=plan_settings(plan),
                          lengths=list(plan.partition))  # fmt: skip


def steps_for(step_s: float, *, measuring: int, overheads: Overheads, repeats: int = 3) -> tuple[int, int]:
    """(untimed, timed) steps of a cell whose step is predicted at ``step_s``: the offloader's ``measuring`` steps
    (which warm up too) or one warm-up, then 3 timed steps under 2 s, 2 under 8 s, else 1; a step over
    ``warm_limit_s`` (and nothing to measure) is timed on its first run."""
    timed = min(repeats, 3 if step_s < 2.0 else 2 if step_s < 8.0 else 1)
    if measuring:
        return measuring, timed
    return (0 if step_s > overheads.warm_limit_s else 1), timed


def attention_call_seconds(
    config: GPTConfig, profile: HardwareProfile, kernel: str, queries: int, keys: int, causal: bool
) -> tuple[float, float]:
    """(forward, backward) seconds the planner predicts for one attention call of ``kernel`` at the model's heads."""
    costs = CostModel(config, precision_bytes("bf16-mixed", False, "fp32"), profile, None, "none", "device", kernel,
                      optimizer=False)  # fmt: skip
    return tuple(
        costs.attention_call(kernel, queries, keys, causal, config.n_head, backward) for backward in (False, True)
    )
