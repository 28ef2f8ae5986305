"""The GPU suite's training runs, and the two parts that time them: the table and the longest sequence that fits.

The runs (``step()`` trains one step of one sequence, bf16 autocast, gradients into ``.grad``, no optimizer):

* "plain": the model's own full-sequence forward and backward (``F.scaled_dot_product_attention``);
* "plain + AC": the same with every block under ``torch.utils.checkpoint`` (non-reentrant), i.e. full activation
  checkpointing: the simplest thing a user could do instead of this project;
* "engine N=1": the strategy's own one-device path (``SPPOCore``) with one subsequence, nothing offloaded or recomputed:
  the plain model's work, through the engine;
* "planner's choice": what the planner chooses for this model and length on one GPU of this kind (``solve`` with one
  node of one GPU, the profile the suite calibrated or the built-in one), turned into strategy settings by
  ``lightning_sppo.strategy.autoplan.plan_settings`` and run through the same ``SPPOCore``: whatever the strategy
  learns to run from a plan, this runs too, without a change here.

Table: those four at every length (shortest first, the primary model first), each cell timed after one warm-up step
(adaptive offload first runs its measuring steps): 3 timed steps where a step is short, 2 where it takes over
``Sizes.long_step_s``, 1 beyond ``Sizes.very_long_step_s``. A cell whose estimated time would overrun the part's budget
is skipped and says so; a run that failed at a shorter length is not tried longer.

Longest: for "plain + AC" and the planner's choice (re-planned at every length), one step per probe (adaptive
offload: its measuring steps, then one adaptive step), doubling from the longest the table ran, then bisecting on a
granule, up to a cap; an out-of-memory (device or host) or "no plan" is a result, and every probe releases what it
held before the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from cuda_timing import measure
from cuda_timing import timed as timed_step
from gpu_checks import autocast, batch, release_memory, synchronize
from offload_bench import checkpointed_blocks, plain_loss_fn
from suite_alloc import does_not_fit
from suite_predict import AC, ENGINE_N1, LAYER, PLAIN, PLANNER, run_prediction
from suite_profiler import AttentionRecorder
from suite_state import Context, PartBudget, PartOverBudget, first_line
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_sppo.attention import kernels, subsequence_cores
from lightning_sppo.callbacks.mfu import training_flops_per_token
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT
from lightning_sppo.offload import OffloadCallback, Offloader
from lightning_sppo.offload.pool import HostPool
from lightning_sppo.parallel.parallelize import materialize
from lightning_sppo.planner import HardwareProfile, NoFeasiblePlan, Plan, PlanRequest, solve
from lightning_sppo.planner.longest import longest_sequence
from lightning_sppo.recompute import apply_recompute
from lightning_sppo.runtime import LayerMajorEngine
from lightning_sppo.strategy.autoplan import plan_settings
from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.core import SPPOCore

__all__ = [
    "AC",
    "ENGINE_N1",
    "LAYER",
    "PLAIN",
    "PLANNER",
    "Run",
    "SuitePlanner",
    "add_ratios",
    "close_run",
    "describe_kernel",
    "host_allocations",
    "longest_fitting",
    "make_run",
    "plain_run",
    "profiled_measure",
    "run_longest",
    "run_settings",
    "run_table",
    "sdpa_backend",
    "strategy_run",
    "suite_config",
    "suite_model",
]

TABLE_RUNS = (PLAIN, AC, ENGINE_N1, LAYER, PLANNER)
ENGINE_N1_SETTINGS: dict[str, Any] = {
    "num_subsequences": 1,
    "partition": "flops",
    "offload": "none",
    "recompute": "none",
}
LAYER_SETTINGS: dict[str, Any] = {"order": "layer", "recompute": "selective", "offload": "full"}
"""The layer order as a long-context run would use it: 16K-token chunks (``num_subsequences="auto"``), the attention
kept (its forward runs once), every layer's checkpoints but the last's on host."""
ADAPTIVE_MEASURE_STEPS = 2
"""Steps adaptive offload measures before its steady state (``Offloader``'s default ``measure_steps``)."""
PRIOR_MFU = 0.3
"""MFU assumed for an estimate before any step of the run was measured (whole steps measured 30-38% on the first
H100 run); the first measured step replaces it."""


# -- attention: which kernel a run uses ------------------------------------------------------------------

_OPS = {"CudaFlashOp": "ATen flash, FA2", "CudaEfficientOp": "ATen memory-efficient", "CpuFlashOp": "ATen CPU flash"}


def describe_kernel(kernel: Any, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The engine's attention backend and, for "sdpa", the ATen op it calls for ``dtype`` on ``device``."""
    fused_op = getattr(kernels, "fused_op", None)
    if kernel.name != "sdpa" or fused_op is None:
        return kernel.name
    op = type(fused_op(device, dtype)).__name__
    return f"sdpa ({_OPS.get(op, op)})"


def sdpa_backend(config: GPTConfig, seq_len: int, device: torch.device, backends: list | None = None) -> str:
    """The backend ``F.scaled_dot_product_attention`` dispatches the plain model's attention to (bf16, causal, the
    model's heads, training), as PyTorch's own selection says (``torch._fused_sdp_choice``)."""
    key = (config.name, seq_len, device.type, tuple(backends or ()))
    if key not in _SDPA_CHOICES:
        _SDPA_CHOICES[key] = _ask_sdpa(config, seq_len, device, backends)
    return _SDPA_CHOICES[key]


_SDPA_CHOICES: dict[tuple, str] = {}


def _ask_sdpa(config: GPTConfig, seq_len: int, device: torch.device, backends: list | None) -> str:
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None:
        return "F.scaled_dot_product_attention (backend unknown: no torch._fused_sdp_choice)"
    heads, groups, dh = config.n_head, config.n_query_groups, config.head_size
    try:  # empty tensors laid out as the model's q, k, v ([B, S, heads, Dh] memory): the choice reads shapes only
        q = torch.empty(1, seq_len, heads, dh, device=device, dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.empty(1, seq_len, groups, dh, device=device, dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))  # fmt: skip
    except torch.OutOfMemoryError:
        return "F.scaled_dot_product_attention (backend unknown: no memory to ask)"
    with sdpa_kernel(backends) if backends else nullcontext():
        index = choice(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), is_causal=True,
                       enable_gqa=heads != groups)  # fmt: skip
    del q, k, v
    if device.type == "cuda":
        torch.cuda.empty_cache()  # not counted as reserved by the cell measured next
    return f"F.scaled_dot_product_attention ({SDPBackend(index).name})"


# -- the runs ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One way to train a step: the step, how to clean up, and what the report says about it."""

    name: str
    step: Callable[[], None]
    close: Callable[[], None]
    attention: str
    host_bytes: Callable[[], int] = lambda: 0
    extra_warmup: int = 0
    """Steps before the steady state (adaptive offload measures its first steps)."""
    planner: Callable[[], dict[str, Any]] | None = None
    """What ``sppo-plan --fit-suite`` needs to predict the run (``lightning_sppo.planner.fit``); None for the plain
    model, which the planner does not model."""
    settings: dict[str, Any] | None = None


def plain_run(
    name: str, model: GPT, ids: Tensor, targets: Tensor, device: torch.device, *, checkpointed: bool = False,
    backends: list | None = None,
) -> Run:  # fmt: skip
    """The plain model; ``checkpointed``: every block under activation checkpointing; ``backends``: the SDPA backends
    allowed (``torch.nn.attention.sdpa_kernel``), None for PyTorch's own choice."""
    undo = checkpointed_blocks(model) if checkpointed else (lambda: None)
    pinned = partial(sdpa_kernel, backends) if backends else nullcontext

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with pinned():  # the backward runs the op the forward chose; both inside for clarity
            with autocast(device, torch.bfloat16)():
                loss = plain_loss_fn(model, ids, targets)
            loss.backward()

    return Run(name, step, undo, sdpa_backend(model.config, ids.shape[1], device, backends))


def strategy_run(
    name: str, settings: dict[str, Any], model: GPT, ids: Tensor, targets: Tensor, device: torch.device, min_bytes: int,
    **options: Any,
) -> Run:  # fmt: skip
    """``settings`` (``SPPOConfig`` keywords) run as the strategy runs them on one device: ``SPPOCore`` prepares the
    model (subsequence attention, recompute; a sharded stage when model state lives on host) and trains the step.
    ``options``: the offloader's (``Offloader``'s keywords)."""
    config = SPPOConfig(**settings)
    core = SPPOCore(config, OffloadCallback(config.offload, min_bytes=min_bytes, **options))
    core.set_world_size(1)
    core.set_precision("bf16-mixed")
    core.setup_layout(model, device)
    module = core.prepare_model(model, device)
    hooks = core.hooks

    def step() -> None:
        module.zero_grad(set_to_none=True)
        core.forward_backward(module, ids, targets, forward_context=autocast(device, torch.bfloat16))

    def close() -> None:
        core.teardown()
        apply_recompute(model, "none")

    def host_bytes() -> int:
        offloaded = hooks.last_stats.offloaded_bytes if isinstance(hooks, Offloader) and hooks.last_stats else 0
        kept = core.engine.kept_host_nbytes() if isinstance(core.engine, LayerMajorEngine) else 0  # order="layer"
        return offloaded + kept + core.engine.cache_host_nbytes()

    warm = hooks.measure_steps if isinstance(hooks, Offloader) and config.offload == "adaptive" else 0
    planner = partial(planner_entry, config, core, ids.shape[0])
    kernel = describe_kernel(subsequence_cores(module)[0].kernel, device)
    return Run(name, step, close, kernel, host_bytes, warm, planner, dict(settings))


def planner_entry(config: SPPOConfig, core: SPPOCore, batch_size: int) -> dict[str, Any]:
    """The run as ``sppo-plan --fit-suite`` predicts it: its settings and the lengths the engine ran (read after the
    timed steps)."""
    lengths = list(core.last_plan.lengths)
    return {
        "schedule": config.schedule, "sp": config.sequence_parallel or 1, "pp": config.pipeline_parallel or 1,
        "dp": 1, "gpus_per_node": 1, "batch_size": batch_size, "precision": "bf16-mixed",
        "kv_grad_dtype": config.kv_grad_dtype, "num_subsequences": len(lengths),
        "partition_policy": config.partition or "length", "partition": lengths, "offload": config.offload,
        "recompute": config.recompute, "kv_device_tokens": config.kv_device_tokens,
        "kv_chunk_tokens": config.kv_chunk_tokens, "model_state": config.model_state, "fsdp_sync": config.fsdp_sync,
        "order": config.order, "kv_grads": "before_last",
    }  # fmt: skip


@dataclass
class SuitePlanner:
    """The planner as ``sppo-plan --nodes 1 --gpus-per-node 1`` asks it, on the suite's profile; plans are cached."""

    profile: HardwareProfile
    source: str
    options: dict[str, Any] = field(default_factory=dict)
    """Further ``PlanRequest`` fields (the quick sizes only: tiny models need shorter subsequences)."""
    plans: dict[tuple[str, int], Plan | NoFeasiblePlan] = field(default_factory=dict)

    def plan(self, config: GPTConfig, seq_len: int) -> Plan:
        """The plan for one sequence of ``seq_len`` tokens; raises ``NoFeasiblePlan`` when nothing fits."""
        key = (config.name, seq_len)
        if key not in self.plans:
            try:
                self.plans[key] = solve(PlanRequest(config=config, seq_len=seq_len, nodes=1, profile=self.profile,
                                                    precision="bf16-mixed", **self.options))  # fmt: skip
            except NoFeasiblePlan as error:
                self.plans[key] = error
        answer = self.plans[key]
        if isinstance(answer, NoFeasiblePlan):
            raise answer
        return answer

    def longest(self, config: GPTConfig, granule: int, cap: int) -> int | None:
        """The longest multiple of ``granule`` up to ``cap`` the planner finds a plan for (``sppo-plan --max-seq-len``),
        or None when not even ``granule`` tokens fit."""
        request = PlanRequest(config=config, seq_len=granule, nodes=1, profile=self.profile, precision="bf16-mixed",
                              **self.options)  # fmt: skip
        start = max(granule, min(64 * 1024, cap) // granule * granule)
        try:
            return longest_sequence(request, granularity=granule, start=start, limit=cap).seq_len
        except NoFeasiblePlan:
            return None

    def prediction(self, plan: Plan) -> dict[str, Any]:
        return {"step_time_s": plan.step_time_s, "tokens_per_s": plan.tokens_per_gpu_per_s,
                "peak_gpu_bytes": plan.peak_gpu_bytes, "profile": self.source}  # fmt: skip


def describe_settings(settings: dict[str, Any]) -> str:
    """The settings that differ from the engine's defaults, briefly: "N=8 flops, recompute selective, K/V on device
    68608"."""
    parts = [f"N={settings['num_subsequences']} {settings.get('partition') or 'length'}"]
    for key, default in (("offload", "none"), ("recompute", "none"), ("model_state", "device"),
                         ("schedule", "seq1f1b"), ("kv_grad_dtype", "fp32")):  # fmt: skip
        if settings.get(key, default) != default:
            parts.append(f"{key.replace('_', ' ')} {settings[key]}")
    if settings.get("kv_device_tokens") is not None:
        parts.append(f"K/V on device {settings['kv_device_tokens']}")
    return ", ".join(parts)


# -- models and cells -----------------------------------------------------------------------------------


def suite_model(ctx: Context, name: str) -> GPT:
    """The model ``name``, built once (on the device, seeded) and shared by every cell and part until another is
    asked for; its block size covers the longest length the suite may run."""
    held = ctx.cache.get("model")
    if held is not None and held.config.name == name:
        return held
    ctx.cache.pop("model", None)
    del held
    release_memory(ctx.device)
    model = _build(suite_config(ctx, name), ctx.device)
    ctx.cache["model"] = model
    return model


def suite_config(ctx: Context, name: str) -> GPTConfig:
    """The model ``name`` with a block size that covers every length the suite's sizes may run."""
    return GPTConfig.from_name(name, block_size=ctx.sizes.block_size)


def _build(config: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    return materialize(model, device)  # initialised on the device: seconds, where a 1B model on the CPU takes long


def run_settings(name: str, plan: Plan | None) -> dict[str, Any] | None:
    """The ``SPPOConfig`` keywords a run trains with (None: the plain model)."""
    if name in (PLAIN, AC):
        return None
    return {ENGINE_N1: ENGINE_N1_SETTINGS, LAYER: LAYER_SETTINGS}.get(name) or plan_settings(plan)


def make_run(
    ctx: Context, name: str, model: GPT, ids: Tensor, targets: Tensor, settings: dict[str, Any] | None, **options: Any
) -> Run:
    """The run ``name`` of ``model``: the plain model (``settings`` None; "plain + AC" checkpoints every block), else
    the strategy's one-device path with ``settings`` (``options``: the offloader's)."""
    device, min_bytes = ctx.device, ctx.sizes.min_bytes
    apply_recompute(model, "none")  # a clean model: no recompute and no checkpointing left by a cell cut short
    if settings is None:
        return plain_run(name, model, ids, targets, device, checkpointed=name == AC)
    if settings.get("model_state", "device") != "device":  # FSDP shards the model it is given: a model of its own
        with torch.device("meta"):
            model = GPT(model.config)  # the stage materializes it
    return strategy_run(name, settings, model, ids, targets, device, min_bytes, **options)


def profiled_measure(run: Run, device: torch.device, untimed: int, timed: int) -> dict[str, Any]:
    """``timed`` steps timed after ``untimed`` ones, the attention kernels the run ran (``suite_profiler``: read from
    its last untimed step; with none, from the timed steps, and the row says so) and each untimed step's seconds."""
    untimed_s = []
    for index in range(untimed):
        if index == untimed - 1:
            with AttentionRecorder(device) as recorder:
                untimed_s.append(timed_step(run.step, device))
        else:
            untimed_s.append(timed_step(run.step, device))
    with host_allocations() as pinned:
        if untimed:
            out = measure(run.step, device, 0, timed)
        else:
            with AttentionRecorder(device) as recorder:
                out = measure(run.step, device, 0, timed)
            out["timed_under_profiler"] = True
    if pinned["calls"]:  # host memory the timed steps allocated (pinned on CUDA): a one-time cost inside them
        out["host_allocations"] = pinned
    return out | recorder.record.to_dict() | {"untimed_steps_s": untimed_s}


@contextmanager
def host_allocations() -> Iterator[dict[str, float]]:
    """Counts the host pools' new slabs inside (``HostPool._allocate``: the offloader's and the layer order's host
    memory, page-locked on CUDA, synchronously): calls, bytes and host seconds."""
    allocate, counted = HostPool._allocate, {"calls": 0, "bytes": 0, "seconds": 0.0}

    def timed_allocate(self: HostPool, nbytes: int):
        started = time.perf_counter()
        slab = allocate(self, nbytes)
        counted["calls"] += 1
        counted["bytes"] += slab.numel()
        counted["seconds"] += time.perf_counter() - started
        return slab

    HostPool._allocate = timed_allocate
    try:
        yield counted
    finally:
        HostPool._allocate = allocate


def measure_cell(ctx: Context, make: Callable[[], Run], row: dict[str, Any], steps: tuple[int, int]) -> dict[str, Any]:
    """Times one (run, S); a failed allocation of any kind (``suite_alloc``) or a broken path is a result, not a crash.
    The row names the attention kernel that ran (``attention``) and the one the run asked for (``attention_asked``)."""
    started, run, model = time.monotonic(), None, ctx.cache.get("model")
    try:
        run = make()
        row["attention_asked"] = run.attention
        row |= profiled_measure(run, ctx.device, steps[0] + run.extra_warmup, steps[1])
        tokens_per_s = row["seq_len"] / row["seconds"]
        flops = training_flops_per_token(model.config, row["seq_len"]) * tokens_per_s
        row |= {"status": "ok", "tokens_per_s": tokens_per_s, "host_bytes": run.host_bytes(),
                "mfu": flops / ctx.peak_flops if ctx.peak_flops else None,
                "steps": {"warmup": steps[0] + run.extra_warmup, "timed": steps[1]}}  # fmt: skip
        if run.planner is not None:
            row["planner"] = run.planner()
    except Exception as error:  # a failed allocation, or a broken path: a result too, the report must still be written
        row |= does_not_fit(error) or {"status": f"error: {type(error).__name__}", "error": first_line(error)}
    finally:
        close_run(run, row)
        del run
        if model is not None:
            model.zero_grad(set_to_none=True)
        release_memory(ctx.device)
    row["wall_s"] = time.monotonic() - started
    return row


def close_run(run: Run | None, row: dict[str, Any]) -> None:
    """Undo a run's changes to the model and free what it holds; a failure here is noted, not raised (the row and
    the cells after it matter more)."""
    if run is None:
        return
    try:
        run.close()
    except Exception as error:
        row["close_error"] = f"{type(error).__name__}: {first_line(error, 200)}"


def _work(config: GPTConfig, seq_len: int) -> float:
    """FLOPs of one step at ``seq_len``: what step times scale with from one length to another."""
    return training_flops_per_token(config, seq_len) * seq_len


def _steps(sizes: Any, step_s: float) -> tuple[int, int]:
    """(warm-up, timed) steps for a step of about ``step_s`` seconds."""
    timed = sizes.repeats if step_s < sizes.long_step_s else 2 if step_s < sizes.very_long_step_s else 1
    return sizes.warmup, min(timed, sizes.repeats)


# -- the table ------------------------------------------------------------------------------------------


def table_rows(ctx: Context, name: str) -> list[dict[str, Any]]:
    """The table of model ``name``: ``table`` for the primary model (what ``sppo-plan --fit-suite`` reads with the
    report's ``model``), ``other_models[i].table`` for the others."""
    data = ctx.data
    if name == data["model"]:
        return data["table"]
    for other in data["other_models"]:
        if other["model"] == name:
            return other["table"]
    config = suite_config(ctx, name)
    data["other_models"].append({"model": name, "model_block_size": config.block_size, "table": []})
    return data["other_models"][-1]["table"]


def run_table(ctx: Context) -> None:
    """Every model at the lengths the targets name and shorter first, then every model at the longer lengths: a budget
    cut leaves whole columns, and the second model's target rows come before the first model's longest."""
    sizes, states = ctx.sizes, {}
    last_target = max(sizes.target_n1_lens + sizes.target_planner_lens)
    order = [(m, s) for m in sizes.models for s in sizes.seq_lens if s <= last_target]
    order += [(m, s) for m in sizes.models for s in sizes.seq_lens if s > last_target]
    for name, seq_len in order:
        rows, state = table_rows(ctx, name), states.setdefault(name, _TableState())
        for run in TABLE_RUNS:
            row = _cell(ctx, name, run, seq_len, state)
            rows.append(row)
            state.record(row)
            add_ratios(rows, seq_len)
            ctx.save()
            print(_progress(row), flush=True)


@dataclass
class _TableState:
    """What the table learned so far for one model: each run's last good (S, seconds), failures, plan accuracy."""

    last: dict[str, tuple[int, float]] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    plan_ratio: float | None = None
    """Measured over predicted step time of the planner's choice, at the latest length it ran."""

    def record(self, row: dict[str, Any]) -> None:
        if row["status"] == "ok":
            self.last[row["run"]] = (row["seq_len"], row["seconds"])
            if "plan" in row:
                self.plan_ratio = row["seconds"] / row["plan"]["step_time_s"]
        elif not row["status"].startswith("skipped"):
            self.failed.add(row["run"])


def _cell(ctx: Context, name: str, run: str, seq_len: int, state: _TableState) -> dict[str, Any]:
    row: dict[str, Any] = {"run": run, "model": name, "seq_len": seq_len}
    if run in state.failed:
        return row | {"status": "skipped (failed at a shorter S)"}
    config, plan = suite_config(ctx, name), None
    if run == PLANNER:
        try:
            plan = ctx.cache["planner"].plan(config, seq_len)
        except NoFeasiblePlan as error:
            return row | {"status": "no plan", "error": first_line(error)}
        settings = plan_settings(plan)
        row |= {"settings": settings, "plan": ctx.cache["planner"].prediction(plan)}
    step_s = _estimate(state, run, seq_len, config, plan, ctx.cache["planner"].profile)
    steps = _steps(ctx.sizes, step_s)
    needed = (step_s * (sum(steps) + run_extra(plan)) + ctx.sizes.cell_overhead_s) * ctx.sizes.estimate_margin
    if not ctx.budget.affords(needed):
        return row | {"status": f"skipped (time budget: ~{needed:.0f} s needed, {ctx.budget.left():.0f} s left)"}
    model = suite_model(ctx, name)
    ids, targets = batch(model.config, seq_len, ctx.device)
    return measure_cell(ctx, partial(make_run, ctx, run, model, ids, targets, run_settings(run, plan)), row, steps)


def _estimate(
    state: _TableState, run: str, seq_len: int, config: GPTConfig, plan: Plan | None, profile: HardwareProfile
) -> float:
    """Seconds of one step: the plan's prediction corrected by how far off it was at the last length; else this run's
    last good step scaled by the FLOPs; else the planner's prediction of the run (``suite_predict``): never 0, so a
    cell that was never measured is budgeted too."""
    if plan is not None:
        return _plan_step_s(plan, state.plan_ratio)
    if run in state.last:
        s, seconds = state.last[run]
        return seconds * _work(config, seq_len) / _work(config, s)
    return run_prediction(config, run, seq_len, profile).step_s


def _plan_step_s(plan: Plan, ratio: float | None) -> float:
    """The plan's step time, times how far off the plans were at the last measured length; before any, as if at
    ``PRIOR_MFU`` where the plan predicts a higher MFU (a calibrated profile's matmul rate is far above a step's)."""
    return plan.step_time_s * (ratio if ratio is not None else max(1.0, plan.mfu / PRIOR_MFU))


def add_ratios(rows: list[dict], seq_len: int) -> None:
    """Each row of ``seq_len`` gets its tokens/s over the plain model's and over plain + AC's (None unless both ran)."""
    same = {r["run"]: r for r in rows if r["seq_len"] == seq_len}
    for key, base in (("ratio_to_plain", PLAIN), ("ratio_to_ac", AC)):
        ref = same.get(base)
        for r in same.values():
            ok = ref is not None and ref["status"] == "ok" and r["status"] == "ok"
            r[key] = r["tokens_per_s"] / ref["tokens_per_s"] if ok else None


def _progress(row: dict) -> str:
    what = f"{row['model']} {row['run']:<18} S={row['seq_len']:>8}"
    if row["status"] != "ok":
        return f"{what}  {row['status']}"
    return f"{what}  {row['tokens_per_s']:>9.0f} tok/s  {row['seconds']:.3f} s/step  {row['attention']}"


# -- the longest sequence that fits ----------------------------------------------------------------------


def longest_fitting(
    fits: Callable[[int], bool], known_fit: int, cap: int, granule: int, affordable: Callable[[int], bool],
    first: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The longest multiple of ``granule`` up to ``cap`` for which ``fits`` holds, assuming it is monotone.

    ``known_fit`` (0 if none) already fits. Doubles from there (or from ``first``, when it is longer: a length
    expected to be the answer, such as the planner's own longest) until a failure or ``cap``, then bisects between
    the last fit and the first failure. ``affordable(S)`` says whether a probe at S still fits the time budget;
    when it does not, the search stops with the bracket found so far. Returns {"longest": fit or None,
    "first_failure": S or None, "probes": [(S, fits)], "stopped": why}.
    """
    lo, hi, probes, stopped = known_fit, None, [], "bracket closed"
    start = first if first is not None and first > known_fit else 2 * known_fit
    seq_len = min(max(granule, start // granule * granule), cap)
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


def run_longest(ctx: Context) -> None:
    """The longest sequence of the planner's choice, then of "plain + AC", for the primary model. The planner's choice
    goes first: its longest is what is not known yet (plain + AC's was measured to fit 256K on the first H100 run),
    and its first probe, at the planner's own longest, may need most of the part's time."""
    name = ctx.data["model"]
    for run in (PLANNER, AC):
        result: dict[str, Any] = {"run": run, "model": name, "granule": ctx.sizes.granule, "cap": ctx.sizes.cap,
                                  "longest": None, "first_failure": None, "probes": [], "stopped": "running",
                                  "probe_detail": []}  # fmt: skip
        ctx.data["longest"].append(result)
        ctx.save()
        _Probe(ctx, name, run, result, ctx.budget).search()
        ctx.save()
        print(f"longest {run}: {result['longest']} (first failure {result['first_failure']}, {result['stopped']})")


class _Probe:
    """One run's search: each probe trains one step (plus the offloader's measuring steps) at one length."""

    def __init__(self, ctx: Context, name: str, run: str, result: dict[str, Any], budget: PartBudget) -> None:
        self.ctx, self.run, self.result, self.budget = ctx, run, result, budget
        self.config = suite_config(ctx, name)
        table = table_rows(ctx, name)
        good = sorted((r for r in table if r["run"] == run and r["status"] == "ok"), key=lambda r: r["seq_len"])
        self.known = max([r["seq_len"] for r in good] + [ctx.sizes.longest_from])
        # Seconds per FLOP at the longest good step (the closest to what comes), else the prior; probes only raise it.
        prior = 1 / (PRIOR_MFU * ctx.peak_flops) if ctx.peak_flops else 0.0
        self.rate = good[-1]["seconds"] / _work(self.config, good[-1]["seq_len"]) if good else prior
        ratios = [r["seconds"] / r["plan"]["step_time_s"] for r in good if "plan" in r]
        self.plan_ratio = ratios[-1] if ratios else None
        self.first = None
        if run == PLANNER:  # probe the planner's own longest first: one step checks its prediction, longer is no plan
            self.first = ctx.cache["planner"].longest(self.config, ctx.sizes.granule, ctx.sizes.cap)
            result["planned_longest"] = self.first

    def search(self) -> None:
        ctx, result = self.ctx, self.result
        try:
            found = longest_fitting(
                self.fits, self.known, ctx.sizes.cap, ctx.sizes.granule, self.affordable, first=self.first
            )
        except PartOverBudget:
            result["stopped"] = "time budget"
            raise
        except Exception as error:  # a broken path is a result: say so and go on
            found = {"longest": self.known or None, "first_failure": None, "probes": result["probes"],
                     "stopped": f"error: {type(error).__name__}: {first_line(error, 200)}"}  # fmt: skip
        result.update(found)

    def _plan(self, seq_len: int) -> Plan | None:
        if self.run != PLANNER:
            return None
        return self.ctx.cache["planner"].plan(self.config, seq_len)

    def affordable(self, seq_len: int) -> bool:
        try:
            plan = self._plan(seq_len)
        except NoFeasiblePlan:
            return True  # answered without a step
        step_s = self.rate * _work(self.config, seq_len) if plan is None else _plan_step_s(plan, self.plan_ratio)
        needed = ((1 + run_extra(plan)) * step_s + self.ctx.sizes.cell_overhead_s) * self.ctx.sizes.estimate_margin
        self.result["next_probe_estimate_s"] = needed
        return self.budget.affords(needed)

    def fits(self, seq_len: int) -> bool:
        ctx, detail = self.ctx, {"seq_len": seq_len}
        self.result["probe_detail"].append(detail)
        try:
            plan = self._plan(seq_len)
        except NoFeasiblePlan as error:
            detail |= {"fits": False, "status": "no plan", "error": first_line(error)}
            return self._done(detail)
        if plan is not None:
            detail["settings"] = plan_settings(plan)
        model = suite_model(ctx, self.config.name)
        ids, targets = batch(model.config, seq_len, ctx.device)
        started, run = time.monotonic(), None
        try:
            run = make_run(ctx, self.run, model, ids, targets, run_settings(self.run, plan))
            for _ in range(1 + run.extra_warmup):  # adaptive: its measuring steps, then one adaptive step
                run.step()
            synchronize(ctx.device)
            detail |= {"fits": True, "status": "ok"}
        except Exception as error:  # a failed allocation of any kind does not fit; anything else is a broken path
            failed = does_not_fit(error)
            if failed is None:
                raise
            detail |= {"fits": False, **failed}
        finally:
            seconds = time.monotonic() - started
            detail["seconds"] = seconds
            close_run(run, detail)
            del run, ids, targets
            model.zero_grad(set_to_none=True)
            release_memory(ctx.device)
        if detail["fits"] and plan is None:  # the slower of the table's rate and this probe's predicts the next
            self.rate = max(self.rate, seconds / _work(self.config, seq_len))
        elif detail["fits"]:
            self.plan_ratio = seconds / (plan.step_time_s * (1 + run_extra(plan)))
        return self._done(detail)

    def _done(self, detail: dict[str, Any]) -> bool:
        self.result["probes"].append((detail["seq_len"], detail["fits"]))
        self.ctx.save()
        return detail["fits"]


def run_extra(plan: Plan | None) -> int:
    """Steps the planner's choice trains before its steady state (adaptive offload measures its first steps)."""
    return ADAPTIVE_MEASURE_STEPS if plan is not None and plan.offload == "adaptive" else 0
