"""``sppo-plan --fit-suite``: the cost model checked against whole measured steps, then the few terms the calibration
cannot see fitted to them.

``sppo-plan --calibrate`` measures each term of the cost model on its own (``planner.calibrate``). Whole steps,
measured by ``benchmarks/gpu_suite.py``, check the model built from them: every run of the suite is predicted with
the planner's own functions (``planner.evaluate`` and ``planner.step_time`` for the engine, ``planner.plain`` for the
plain model with and without full activation checkpointing), with the attention kernel the run used, and printed
beside what it measured: step time, peak allocated and peak reserved bytes. Runs that ran out of memory are checked
too: the prediction must not fit the device.

Then only what the profile does not measure is fitted (a term whose ``HardwareProfile.source`` says "measured" is
held): of the time terms ``FITTED`` (host seconds per op, elementwise HBM GB/s, the copy rate), by least squares on
relative step-time errors (Levenberg-Marquardt), each checked for whether the runs determine it (relative standard
error from the Jacobian at the optimum, with the residual spread but never less than ``NOISE_FLOOR``; a term beyond
``MAX_RELATIVE_ERROR`` is held and says why); and the allocator's slack, the mean of measured reserved minus predicted
allocated bytes, which no kernel timing sees.

The suite's rows carry what a prediction needs: an engine row a ``"planner"`` entry (layout, partition, offload,
recompute, K/V on host, precision, and the attention backend when the suite records it), a plain row its name
("plain", "plain + AC"). A row without a recorded kernel ran the environment's ``attention_auto`` (the engine) or
PyTorch's SDPA pick for the device (the plain model: cuDNN on Hopper, FlashAttention-2 before it). Rows of other runs
("plain + save_on_cpu") are listed as skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.costs import ENGINE_KERNELS, CostModel
from lightning_sppo.planner.evaluate import OFFLOAD_ORDER, SCHEDULE_ORDER, Limits, evaluate
from lightning_sppo.planner.layer_order import LayerOrderSetup
from lightning_sppo.planner.layer_plan import layer_order_step
from lightning_sppo.planner.layout import Layout, placement, stage_specs
from lightning_sppo.planner.options import DEFAULT_KV_CHUNK_TOKENS, RECOMPUTE_ORDER
from lightning_sppo.planner.plain import plain_step
from lightning_sppo.planner.plan import ORDERS
from lightning_sppo.planner.precision import KV_GRAD_DTYPES, PRECISIONS, precision_bytes
from lightning_sppo.planner.profile import BUILTIN_PROFILES, HardwareProfile
from lightning_sppo.planner.step_time import simulate_step_time
from lightning_sppo.planner.units import format_bytes

__all__ = [
    "FITTED",
    "MAX_RELATIVE_ERROR",
    "NOISE_FLOOR",
    "PLAIN_RUNS",
    "Constant",
    "FitResult",
    "Prediction",
    "RunFit",
    "Suite",
    "SuiteError",
    "SuiteRun",
    "base_profile",
    "check_suite",
    "fit_suite",
    "format_fit",
    "load_suite",
    "predict",
]

FITTED = ("host_op_s", "elementwise_gbps", "copy_gbps")
"""Time terms the fit may set, in this order, when the profile does not say they were measured."""
PLAIN_RUNS = {"plain": False, "plain + AC": True}
"""Plain-model rows the planner predicts (``planner.plain``), and whether each checkpoints every block."""
NOISE_FLOOR = 0.005
"""Relative spread assumed of a measured step time at least (0.5%), when judging what the runs determine."""
MAX_RELATIVE_ERROR = 0.10
"""A term whose relative standard error exceeds this is not determined by the suite and is held."""
_MAX_ITERATIONS = 60
_NO_LIMIT = 2**62
_SUITE_HINT = "run `python benchmarks/gpu_suite.py` on the GPU (it writes these fields)"


class SuiteError(ValueError):
    """A suite JSON the fit cannot use; the message names the file, the run and the field to fix."""


@dataclass(frozen=True, kw_only=True)
class SuiteRun:
    """One measured step of the suite and everything the planner needs to predict it."""

    name: str
    config: GPTConfig
    partition: tuple[int, ...]
    """Subsequence lengths the engine ran (their sum is the sequence length); the plain model: the whole sequence."""
    offload: str = "none"
    recompute: str = "none"
    kv_device_tokens: int | None = None
    """Tokens of each layer's K/V kept on the device (None: all)."""
    kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS
    precision: str = "bf16-mixed"
    kv_grad_dtype: str = "fp32"
    batch_size: int = 1
    layout: Layout = Layout(1, 1, 1)
    gpus_per_node: int = 1
    schedule: str = "seq1f1b"
    fsdp_sync: str = "step"
    plain: bool | None = None
    """None: the engine; False: the plain model; True: the plain model with every block checkpointed (AC)."""
    attention: str = "flash"
    """The attention kernel the run used (``planner.kernels.ATTENTION_KERNELS``)."""
    kv_grads: str = "before_last"
    """The dK/dV buffers the engine held (``CostModel.kv_grads``): a row that does not say predates the engine's
    "before_last" and held the whole sequence's."""
    order: str = "subsequence"
    """How the engine ran the sequence: "subsequence", or "layer" (``planner.layer_order`` predicts it)."""
    step_s: float | None
    """Measured seconds of one step (median); None when it was not timed (``status``)."""
    status: str = "ok"
    """"ok" (timed), "OOM" (ran out of device memory), or "fits" (a probe that fit, untimed: the suite's longest
    sequence search)."""
    peak_bytes: int | None = None
    """Measured peak bytes the caching allocator reserved (``torch.cuda.max_memory_reserved``); None off CUDA."""
    allocated_bytes: int | None = None
    """Measured peak bytes allocated to tensors (``torch.cuda.max_memory_allocated``)."""
    source: str = ""
    """Where the row comes from (a file)."""

    @property
    def seq_len(self) -> int:
        return sum(self.partition)

    @property
    def label(self) -> str:
        return f"{self.name} S={self.seq_len}"

    @property
    def out_of_memory(self) -> bool:
        return self.status == "OOM"

    @property
    def timed(self) -> bool:
        return self.step_s is not None


@dataclass(frozen=True)
class Suite:
    """The runs of one ``gpu_suite.json`` the planner can predict, and what it cannot (with why)."""

    runs: tuple[SuiteRun, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    """(run, why) for every row left out."""
    device: str = "unknown device"
    hbm_bytes: int | None = None
    """The device's memory (``torch.cuda.get_device_properties().total_memory``)."""
    context_bytes: int | None = None
    """Device bytes in use outside PyTorch's allocator (CUDA context, libraries' kernels), measured once."""

    def __add__(self, other: Suite) -> Suite:
        return Suite(
            self.runs + other.runs, self.skipped + other.skipped, self.device, self.hbm_bytes or other.hbm_bytes,
            self.context_bytes if self.context_bytes is not None else other.context_bytes,
        )  # fmt: skip


@dataclass(frozen=True)
class Prediction:
    """What the planner predicts of one run."""

    step_s: float
    allocated_bytes: int
    """Live tensors and temporaries at the peak (without the allocator's slack and the profile's reserve)."""
    slack_bytes: int
    """The allocator's slack the profile predicts (``HardwareProfile.allocator_slack_bytes``)."""

    @property
    def reserved_bytes(self) -> int:
        return self.allocated_bytes + self.slack_bytes


@dataclass(frozen=True)
class Constant:
    """One fitted (or held) term of the profile."""

    name: str
    value: float
    base: float
    fitted: bool
    relative_error: float | None = None
    """Standard error over the value (None when held, or when no run measured it)."""
    why: str = ""
    """Why it was held at the base profile's value (empty when fitted)."""


@dataclass(frozen=True)
class RunFit:
    """Predicted against measured, for one run."""

    run: SuiteRun
    predicted: Prediction
    device_bytes: int | None = None
    """What the device holds for the allocator (total memory minus the context), to judge out-of-memory runs."""

    @property
    def predicted_s(self) -> float:
        return self.predicted.step_s

    @property
    def time_error(self) -> float | None:
        return None if self.run.step_s is None else self.predicted.step_s / self.run.step_s - 1

    @property
    def memory_error(self) -> float | None:
        """Predicted over measured peak reserved bytes, minus 1."""
        return None if not self.run.peak_bytes else self.predicted.reserved_bytes / self.run.peak_bytes - 1

    @property
    def allocated_error(self) -> float | None:
        """Predicted over measured peak allocated bytes, minus 1."""
        measured = self.run.allocated_bytes
        return None if not measured else self.predicted.allocated_bytes / measured - 1

    @property
    def fit_agrees(self) -> bool | None:
        """For a run that ran out of memory, or a probe that fit: whether the prediction says the same (its reserved
        peak over, or within, the device's memory less the context); None for a timed run."""
        if self.run.status == "ok" or self.device_bytes is None:
            return None
        return (self.predicted.reserved_bytes > self.device_bytes) == self.run.out_of_memory


@dataclass(frozen=True)
class FitResult:
    profile: HardwareProfile
    constants: tuple[Constant, ...]
    runs: tuple[RunFit, ...]
    """Every run predicted with the fitted profile."""
    checked: tuple[RunFit, ...] = ()
    """Every run predicted with the profile as given, before any fit."""
    skipped: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def constant(self, name: str) -> Constant:
        return next(c for c in self.constants if c.name == name)


# -- reading a suite ------------------------------------------------------------------------------------


def load_suite(source: str | Path | dict[str, Any], origin: str | None = None) -> Suite:
    """The predictable runs of a ``gpu_suite.json`` (a path, or the parsed object; ``origin`` names where it came
    from, default the path); ``SuiteError`` names the field to fix when the file is not a suite, a row lacks what a
    prediction needs, or no row is usable."""
    where = "suite" if isinstance(source, dict) else f"--fit-suite={str(source)!r}"
    data = source if isinstance(source, dict) else _read_json(Path(source), where)
    if not isinstance(data, dict) or not isinstance(data.get("table"), list):
        raise SuiteError(f"{where}: no 'table' list of runs; is it a gpu_suite.json? ({_SUITE_HINT})")
    model = data.get("model")
    if model not in GPTConfig.available():
        raise SuiteError(f"{where}: 'model' is {model!r}, not a registered model name ({_SUITE_HINT}).")
    overrides = {"block_size": data["model_block_size"]} if data.get("model_block_size") else {}
    config = GPTConfig.from_name(model, **overrides)
    env = data.get("environment") or {}
    device = str(env.get("device", "unknown device"))
    runs, skipped = [], []
    for index, row in enumerate(data["table"]):
        if not isinstance(row, dict):
            raise SuiteError(f"{where}: table[{index}] is {type(row).__name__}, not an object.")
        label = f"{row.get('run', '?')} S={row.get('seq_len', '?')}"
        status = row.get("status")
        if status not in ("ok", "OOM", "fits"):
            skipped.append((label, f"status {status!r}"))
        elif "planner" not in row and row.get("run") not in PLAIN_RUNS:
            skipped.append((label, "no 'planner' entry, and not a plain run the planner predicts (plain, plain + AC)"))
        else:
            came = origin or (str(source) if not isinstance(source, dict) else "suite")
            runs.append(_run(row, config, env, device, f"{where}: table[{index}] ({label})", came))
    if not runs:
        raise SuiteError(
            f"{where}: no run to check: every row is skipped ({len(skipped)} rows; a row needs status 'ok' or 'OOM' and"
            f" a 'planner' entry or a plain run's name); {_SUITE_HINT}."
        )
    return Suite(
        tuple(runs), tuple(skipped), device, _optional_int(env, "total_memory_bytes", where),
        _optional_int(env, "context_bytes", where),
    )  # fmt: skip


def _read_json(path: Path, where: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SuiteError(f"{where}: cannot read a suite JSON file ({error}).") from error


def _optional_int(data: dict, key: str, where: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SuiteError(f"{where}: {key} must be a byte count >= 0, got {key}={value!r}.")
    return value


def row_kernel(row: dict, env: dict, device: str, plain: bool) -> str:
    """The attention kernel a row ran: as recorded (``attention`` in the row or its ``planner`` entry: an engine
    backend or a kernel name), else the engine's ``attention_auto`` of the environment, else (the plain model)
    PyTorch's SDPA pick for the device: cuDNN on Hopper (H100, H200), FlashAttention-2 before it."""
    recorded = (row.get("planner") or {}).get("attention") or row.get("attention") or row.get("kernel")
    kernel = _kernel_named(str(recorded)) if recorded is not None else None
    if kernel is None and not plain:
        kernel = _kernel_named(str(env.get("attention_auto", "sdpa")))
    if kernel is None:
        return "cudnn" if any(tag in device.upper() for tag in ("H100", "H200")) else "flash"
    return kernel


def _kernel_named(text: str) -> str | None:
    """The kernel a recorded description names: an engine backend ("sdpa", "cudnn", ...), a kernel name, or the
    suite's descriptions ("sdpa (ATen flash, FA2)", "F.scaled_dot_product_attention (CUDNN_ATTENTION)"); None when it
    says the backend is unknown."""
    if text in ENGINE_KERNELS:
        return ENGINE_KERNELS[text]
    lower = text.lower()
    if "unknown" in lower:
        return None
    for tag, kernel in (("cudnn", "cudnn"), ("efficient", "efficient"), ("math", "math"), ("flash", "flash"),
                        ("fa2", "flash"), ("reference", "reference")):  # fmt: skip
        if tag in lower:
            return kernel
    return text  # checked against the kernels by the caller


def _run(row: dict, config: GPTConfig, env: dict, device: str, where: str, source: str) -> SuiteRun:
    status = row.get("status")
    ok = status == "ok"
    seconds = row.get("seconds") if ok else None
    if ok and (
        isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0
    ):
        raise SuiteError(f"{where}: seconds must be a measured step time > 0, got seconds={seconds!r}.")
    measured = {}
    for key in ("peak_reserved_bytes", "peak_allocated_bytes"):
        value = row.get(key) if ok else None
        if value is not None and not _positive_int(value):
            raise SuiteError(f"{where}: {key} must be null or a byte count > 0, got {value!r}.")
        measured[key] = value
    common = dict(
        name=str(row.get("run", "?")), config=config, step_s=None if seconds is None else float(seconds), status=status,
        peak_bytes=measured["peak_reserved_bytes"], allocated_bytes=measured["peak_allocated_bytes"], source=source,
    )  # fmt: skip
    if "planner" not in row:
        seq_len = row.get("seq_len")
        if not _positive_int(seq_len):
            raise SuiteError(f"{where}: a plain run needs seq_len, a token count > 0, got {seq_len!r}.")
        kernel = _kernel(row_kernel(row, env, device, plain=True), where)
        return SuiteRun(partition=(seq_len,), plain=PLAIN_RUNS[row["run"]], attention=kernel, **common)
    return _engine_run(row, env, device, where, common)


def _kernel(name: str, where: str) -> str:
    from lightning_sppo.planner.kernels import ATTENTION_KERNELS

    if name not in ATTENTION_KERNELS:
        raise SuiteError(f"{where}: attention={name!r} is neither an engine backend {list(ENGINE_KERNELS)} nor a kernel"
                         f" {list(ATTENTION_KERNELS)}.")  # fmt: skip
    return name


def _engine_run(row: dict, env: dict, device: str, where: str, common: dict) -> SuiteRun:
    spec = row["planner"]
    if not isinstance(spec, dict):
        raise SuiteError(f"{where}: 'planner' must be an object, got {type(spec).__name__}.")
    missing = [k for k in ("partition", "offload", "recompute") if k not in spec]
    missing += [k for k in ("seconds",) if k not in row and row.get("status") == "ok"]
    if missing:
        raise SuiteError(f"{where}: missing {missing}; {_SUITE_HINT}.")
    partition = spec["partition"]
    if not isinstance(partition, list) or not partition or not all(_positive_int(n) for n in partition):
        raise SuiteError(f"{where}: planner.partition must be a non-empty list of token counts, got {partition!r}.")
    if row.get("seq_len") is not None and sum(partition) != row["seq_len"]:
        raise SuiteError(f"{where}: planner.partition sums to {sum(partition)}, not seq_len={row['seq_len']}.")
    for key, choices in (("offload", OFFLOAD_ORDER), ("recompute", RECOMPUTE_ORDER),
                         ("precision", PRECISIONS), ("kv_grad_dtype", KV_GRAD_DTYPES), ("schedule", SCHEDULE_ORDER)):  # fmt: skip
        if key in spec and spec[key] not in choices:
            raise SuiteError(f"{where}: planner.{key}={spec[key]!r} is not one of {list(choices)}.")
    if spec.get("order", "subsequence") not in ORDERS:
        raise SuiteError(f"{where}: planner.order={spec['order']!r} is not one of {list(ORDERS)}.")
    if spec.get("kv_grads", "sequence") not in ("before_last", "sequence"):
        raise SuiteError(f"{where}: planner.kv_grads={spec['kv_grads']!r} is not one of ['before_last', 'sequence'].")
    kv = spec.get("kv_device_tokens")
    if kv is not None and not (_positive_int(kv) or kv == 0):
        raise SuiteError(f"{where}: planner.kv_device_tokens must be null or a token count >= 0, got {kv!r}.")
    sizes = {k: spec.get(k, 1) for k in ("sp", "pp", "dp", "batch_size", "gpus_per_node")}
    bad = {k: v for k, v in sizes.items() if not _positive_int(v)}
    if bad:
        raise SuiteError(f"{where}: planner {bad} must be positive integers.")
    return SuiteRun(
        partition=tuple(partition), offload=spec["offload"], recompute=spec["recompute"], kv_device_tokens=kv,
        kv_chunk_tokens=spec.get("kv_chunk_tokens", DEFAULT_KV_CHUNK_TOKENS),
        precision=spec.get("precision", "bf16-mixed"), kv_grad_dtype=spec.get("kv_grad_dtype", "fp32"),
        batch_size=sizes["batch_size"], layout=Layout(sizes["sp"], sizes["pp"], sizes["dp"]),
        gpus_per_node=sizes["gpus_per_node"], schedule=spec.get("schedule", "seq1f1b"),
        fsdp_sync=spec.get("fsdp_sync", "step"), attention=_kernel(row_kernel(row, env, device, False), where),
        kv_grads=spec.get("kv_grads", "sequence"), order=spec.get("order", "subsequence"), **common,
    )  # fmt: skip


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def base_profile(suite: Suite) -> HardwareProfile:
    """The built-in profile of the suite's GPU, or ``SuiteError`` asking for ``--gpu`` when the device is none of
    those."""
    upper = suite.device.upper()
    for tag, key in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb")):
        if tag in upper:
            return BUILTIN_PROFILES[key]
    raise SuiteError(
        f"the suite's device {suite.device!r} is none of A100, H100, H200: give --gpu a built-in profile"
        f" {sorted(BUILTIN_PROFILES)} or a profile JSON to start from (its peak_bf16_tflops is what mfu divides)."
    )


# -- predicting a run -----------------------------------------------------------------------------------


def predict(run: SuiteRun, profile: HardwareProfile) -> Prediction:
    """What the planner predicts of ``run`` on ``profile``: the engine's run with its own layout, partition, offload
    policy, recompute, K/V spill and attention kernel, evaluated and simulated as ``sppo-plan`` does for the
    candidates it reports; the plain model's by ``planner.plain``. The suite's step has no optimizer step and no
    AdamW state (``CostModel.optimizer``)."""
    profile = replace(profile, gpus_per_node=run.gpus_per_node)
    layout = run.layout
    sharded = layout.dp * layout.sp > 1
    dtypes = precision_bytes(run.precision, sharded, run.kv_grad_dtype)
    costs = CostModel(run.config, dtypes, profile, None, run.recompute, "device", run.attention, optimizer=False,
                      kv_grads=run.kv_grads)  # fmt: skip
    if run.plain is not None:
        step = plain_step(costs, run.seq_len, run.plain, kernel=run.attention)
        return Prediction(step.step_s, step.peak_bytes, profile.allocator_slack_bytes)
    if run.order == "layer":
        offsets = [sum(run.partition[:i]) for i in range(len(run.partition))]
        setup = LayerOrderSetup(run.recompute, run.offload, run.kv_device_tokens, run.kv_chunk_tokens, run.batch_size)
        step = layer_order_step(costs, list(zip(offsets, run.partition, strict=True)), setup)
        return Prediction(step.step_s, step.memory.allocated_bytes, profile.allocator_slack_bytes)
    evaluation = evaluate(
        costs, layout, placement(layout, run.gpus_per_node), stage_specs(run.config, layout.pp), run.partition,
        Limits(_NO_LIMIT, _NO_LIMIT), batch=run.batch_size, sync=run.fsdp_sync, offloads=(run.offload,),
        schedule=run.schedule, kv_device_tokens=run.kv_device_tokens, kv_chunk_tokens=run.kv_chunk_tokens,
    )  # fmt: skip
    peak = evaluation.peak_stage.memory
    return Prediction(simulate_step_time(evaluation).step_s, peak.allocated_bytes, profile.allocator_slack_bytes)


def check_suite(suite: Suite, profile: HardwareProfile) -> tuple[RunFit, ...]:
    """Every run of ``suite`` predicted on ``profile`` as it is (no fit)."""
    device = None if suite.hbm_bytes is None else suite.hbm_bytes - (suite.context_bytes or 0)
    return tuple(RunFit(run, predict(run, profile), device) for run in suite.runs)


# -- the terms as fit variables --------------------------------------------------------------------------

# Each fitted term as a variable the step time is (nearly) linear in, and back.
_TO_VARIABLE: dict[str, Callable[[float], float]] = {
    "host_op_s": lambda v: v,
    "elementwise_gbps": lambda v: 1.0 / v,
    "copy_gbps": lambda v: 1.0 / v,
}
_FROM_VARIABLE = _TO_VARIABLE  # each map is its own inverse
_LOWER = {"host_op_s": 0.0, "elementwise_gbps": 1e-9, "copy_gbps": 1e-9}


def _base_values(profile: HardwareProfile) -> dict[str, float]:
    return {
        "host_op_s": profile.host_op_s,
        "elementwise_gbps": profile.elementwise_gbps,
        "copy_gbps": math.sqrt(profile.d2h_gbps * profile.h2d_gbps),
    }


def _with_values(profile: HardwareProfile, values: dict[str, float | None]) -> HardwareProfile:
    """``profile`` with the terms' ``values``; None keeps the copy rates as they are (a held ``copy_gbps``)."""
    copy = values["copy_gbps"]
    return replace(
        profile, host_op_s=max(0.0, values["host_op_s"]), elementwise_gbps=values["elementwise_gbps"],
        d2h_gbps=profile.d2h_gbps if copy is None else copy, h2d_gbps=profile.h2d_gbps if copy is None else copy,
    )  # fmt: skip


def _measured(profile: HardwareProfile, name: str) -> bool:
    keys = ("d2h_gbps", "h2d_gbps") if name == "copy_gbps" else (name,)
    return all(profile.sources.get(key, "").startswith("measured") for key in keys)


@dataclass
class _Problem:
    """Relative step-time residuals of the suite as a function of the free variables (the rest held)."""

    runs: Sequence[SuiteRun]
    base: HardwareProfile
    held: dict[str, float | None]
    free: list[str]
    scale: np.ndarray

    def values(self, z: np.ndarray) -> dict[str, float | None]:
        out = dict(self.held)
        for name, zi, s in zip(self.free, z, self.scale, strict=True):
            out[name] = _FROM_VARIABLE[name](max(zi * s, _LOWER[name]))
        return out

    def residuals(self, z: np.ndarray) -> np.ndarray:
        profile = _with_values(self.base, self.values(z))
        return np.array([predict(run, profile).step_s / run.step_s - 1.0 for run in self.runs])

    def project(self, z: np.ndarray) -> np.ndarray:
        lower = np.array([_LOWER[name] for name in self.free]) / self.scale
        return np.maximum(z, lower)

    def jacobian(self, z: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Forward differences, in the scaled variables."""
        columns = []
        for j in range(len(z)):
            step = 1e-4 * max(abs(z[j]), 1.0)
            shifted = z.copy()
            shifted[j] += step
            columns.append((self.residuals(shifted) - r) / step)
        return np.stack(columns, axis=1) if columns else np.zeros((len(r), 0))


def _least_squares(problem: _Problem, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Levenberg-Marquardt from ``z``, kept within the bounds; returns (z, residuals, Jacobian at z)."""
    r = problem.residuals(z)
    if not len(z):
        return z, r, np.zeros((len(r), 0))
    cost, damping = float(r @ r), 1e-3
    jac = problem.jacobian(z, r)
    for _ in range(_MAX_ITERATIONS):
        normal = jac.T @ jac
        gradient = jac.T @ r
        improved = False
        while damping < 1e12:
            scaled = normal + damping * np.diag(np.diag(normal) + 1e-12 * (np.trace(normal) + 1e-300))
            try:
                z_new = problem.project(z - np.linalg.solve(scaled, gradient))
            except np.linalg.LinAlgError:  # no run depends on some variable: judged after the fit
                break
            r_new = problem.residuals(z_new)
            cost_new = float(r_new @ r_new)
            if cost_new < cost:
                improved = True
                break
            damping *= 4.0
        if not improved:
            break
        moved = np.max(np.abs(z_new - z) / np.maximum(np.abs(z), 1e-12))
        drop = (cost - cost_new) / max(cost, 1e-300)
        z, r, cost, damping = z_new, r_new, cost_new, max(damping / 3.0, 1e-9)
        jac = problem.jacobian(z, r)
        if moved < 1e-9 or drop < 1e-12:
            break
    return z, r, jac


def _relative_errors(z: np.ndarray, jac: np.ndarray, spread: float) -> np.ndarray:
    """Standard error of each free term over its value, for residuals of relative spread ``spread`` (a direction the
    runs do not see has a tiny eigenvalue, so its terms get a huge error)."""
    elasticity = jac * np.where(np.abs(z) > 0, z, 1.0)
    normal = elasticity.T @ elasticity
    eigenvalues, vectors = np.linalg.eigh(normal)
    floor = 1e-30 + 1e-14 * max(float(eigenvalues.max(initial=0.0)), 0.0)
    inverse = (vectors / np.maximum(eigenvalues, floor)) @ vectors.T
    return spread * np.sqrt(np.maximum(np.diag(inverse), 0.0))


def _why_held(problem: _Problem, name: str, jac: np.ndarray, z: np.ndarray, error: float, spread: float) -> str:
    """Why ``name`` is not determined: no run depends on it, or it moves the predictions as another term does."""
    elasticity = jac * np.where(np.abs(z) > 0, z, 1.0)
    j = problem.free.index(name)
    column = elasticity[:, j]
    if float(np.max(np.abs(column), initial=0.0)) < 1e-6:
        what = {
            "copy_gbps": "no run's predicted time has a copy the compute does not hide (add offload=full or K/V on"
            " host at short subsequences)",
            "host_op_s": "no run's predicted time is bound by the host (add runs at many short subsequences)",
        }.get(name, "no run's predicted time depends on it")
        return f"{what}; held at the base profile's value"
    partners = []
    for k, other in enumerate(problem.free):
        if k != j:
            norm = float(np.linalg.norm(column) * np.linalg.norm(elasticity[:, k]))
            if norm > 0 and abs(float(column @ elasticity[:, k])) / norm > 0.99:
                partners.append(other)
    alike = f": the runs cannot tell it from {' and '.join(partners)}" if partners else ""
    shown = f"{error:.0%}" if error < 10 else "over 1000%"
    return (
        f"the suite's runs do not determine it (relative error {shown} > {MAX_RELATIVE_ERROR:.0%} at a step-time"
        f" spread of {spread:.1%}{alike}); held at the base profile's value"
    )


def fit_suite(suite: Suite, base: HardwareProfile) -> FitResult:
    """Check ``base`` against every run of ``suite`` (``FitResult.checked``), then fit the terms it does not say were
    measured (``FITTED``, and the allocator's slack) to the runs that completed; terms the runs do not determine are
    held and say why (``Constant.why``)."""
    checked = check_suite(suite, base)
    timed = [run for run in suite.runs if run.timed]
    base_values = _base_values(base)
    reasons = {name: "measured by --calibrate (the profile's source says so); held" for name in FITTED if
               _measured(base, name)}  # fmt: skip
    unusable = {name: "the base profile does not charge it (0); held" for name in ("elementwise_gbps",)
                if not base.elementwise_gbps and name not in reasons}  # fmt: skip
    reasons |= unusable
    held: dict[str, float | None] = {name: base_values[name] for name in reasons}
    free = [name for name in FITTED if name not in held]
    start = dict(base_values)
    while True:
        scale = np.array([abs(_TO_VARIABLE[n](start[n])) or 1e-6 for n in free])
        problem = _Problem(timed, base, held, free, scale)
        z, r, jac = _least_squares(problem, np.array([_TO_VARIABLE[n](start[n]) for n in free]) / scale)
        spread = max(float(np.sqrt(np.mean(r**2))) if len(r) else 0.0, NOISE_FLOOR)
        errors = _relative_errors(z, jac, spread) if free else np.zeros(0)
        if not free or float(errors.max()) <= MAX_RELATIVE_ERROR:
            break
        name = free[int(np.argmax(errors))]
        reasons[name] = _why_held(problem, name, jac, z, float(errors[free.index(name)]), spread)
        held[name] = base_values[name]
        start = {n: v for n, v in problem.values(z).items() if n in free and n != name}
        free.remove(name)
    values = problem.values(z)
    profile = _with_values(base, values)
    actual = float(np.sqrt(np.mean(r**2))) if len(r) else 0.0
    reported = _relative_errors(z, jac, actual) if free else np.zeros(0)
    constants = [
        Constant(name, _base_values(profile)[name], base_values[name], name in free,
                 float(reported[free.index(name)]) if name in free else None, reasons.get(name, ""))
        for name in FITTED
    ]  # fmt: skip
    slack, runs = _fit_slack(suite, profile, base)
    profile = replace(
        profile, name=f"fitted: {suite.device}", allocator_slack_bytes=int(round(slack.value)),
        hbm_bytes=suite.hbm_bytes or base.hbm_bytes,
    )  # fmt: skip
    return FitResult(profile, (*constants, slack), runs, checked, suite.skipped)


def _fit_slack(suite: Suite, profile: HardwareProfile, base: HardwareProfile) -> tuple[Constant, tuple[RunFit, ...]]:
    """``allocator_slack_bytes``: the mean of (measured reserved - predicted allocated) over the runs with both, and
    every run's figures under it."""
    runs = check_suite(suite, replace(profile, allocator_slack_bytes=0))
    gaps = [fit.run.peak_bytes - fit.predicted.allocated_bytes for fit in runs if fit.run.peak_bytes]
    if gaps:
        value = max(0.0, float(np.mean(gaps)))
        spread = float(np.std(gaps) / math.sqrt(len(gaps))) / value if value and len(gaps) > 1 else None
        slack = Constant("allocator_slack_bytes", value, float(base.allocator_slack_bytes), True, spread)
    else:
        value = float(base.allocator_slack_bytes)
        slack = Constant(
            "allocator_slack_bytes", value, value, False, None,
            "no run has a measured peak (peak_reserved_bytes; a CPU suite has none); held at the base profile's value",
        )  # fmt: skip
    fitted = [RunFit(fit.run, replace(fit.predicted, slack_bytes=int(round(value))), fit.device_bytes) for fit in runs]
    return slack, tuple(fitted)


# -- the report -----------------------------------------------------------------------------------------


def _format_value(name: str, value: float) -> str:
    if name.endswith("_bytes"):
        return format_bytes(int(round(value)))
    if name == "host_op_s":
        return f"{value * 1e6:.2f} us"
    if name.endswith("_gbps"):
        return f"{value:.4g} GB/s"
    return f"{value:.4g}"


def format_runs(runs: Sequence[RunFit]) -> list[str]:
    """Predicted against measured, one line per run, then the mean and worst errors."""
    width = max([len(f.run.label) for f in runs] + [3])
    lines = [
        f"  {'run':<{width}} {'kernel':>7} {'step s':>8} {'pred s':>8} {'err':>7} {'alloc':>10} {'pred':>10}"
        f" {'err':>7} {'reserved':>10} {'pred':>10} {'err':>7}"
    ]
    for fit in runs:
        run, pred = fit.run, fit.predicted
        if not run.timed:
            agrees = {True: "predicted the same", False: "predicted the opposite", None: "device size unknown"}
            lines.append(
                f"  {run.label:<{width}} {run.attention:>7} {run.status:>8} {pred.step_s:>8.4g} {'':>7} {'':>10}"
                f" {format_bytes(pred.allocated_bytes):>10} {'':>7} {'':>10} {format_bytes(pred.reserved_bytes):>10}"
                f"  {agrees[fit.fit_agrees]}"
            )
            continue
        lines.append(
            f"  {run.label:<{width}} {run.attention:>7} {run.step_s:>8.4g} {pred.step_s:>8.4g} {fit.time_error:>+7.1%}"
            f" {_bytes(run.allocated_bytes):>10} {format_bytes(pred.allocated_bytes):>10} {_error(fit.allocated_error):>7}"
            f" {_bytes(run.peak_bytes):>10} {format_bytes(pred.reserved_bytes):>10} {_error(fit.memory_error):>7}"
        )
    lines.append("")
    lines += summary_lines(runs)
    return lines


def summary_lines(runs: Sequence[RunFit]) -> list[str]:
    """Mean and worst |error| of step time, peak allocated and peak reserved bytes."""
    out = []
    for what, errors in (
        ("step time", [f.time_error for f in runs]),
        ("peak allocated", [f.allocated_error for f in runs]),
        ("peak reserved", [f.memory_error for f in runs]),
    ):
        values = [abs(e) for e in errors if e is not None]
        if values:
            out.append(f"  {what}: mean |error| {np.mean(values):.1%}, worst {max(values):.1%} over {len(values)} runs")
    verdicts = [f.fit_agrees for f in runs if f.fit_agrees is not None]
    if verdicts:
        out.append(
            f"  fits or not: {sum(verdicts)} of {len(verdicts)} untimed runs (OOM, or a probe that fit) predicted alike"
        )
    return out


def _bytes(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def format_fit(result: FitResult) -> str:
    """The check (every run on the profile as given), the fitted terms (with their standard errors, or why they were
    held), and every run again under the fitted profile."""
    lines = ["check: every run predicted with the profile as given (no fit)", ""]
    lines += format_runs(result.checked)
    lines += ["", f"fitted profile: {result.profile.name} (peak {result.profile.peak_bf16_tflops:g} TFLOP/s bf16)", ""]
    for c in result.constants:
        if c.fitted:
            error = "" if c.relative_error is None else f" +- {c.relative_error:.1%}"
            lines.append(
                f"  {c.name:<21} {_format_value(c.name, c.value):>12}{error}  (base {_format_value(c.name, c.base)})"
            )
        else:
            lines.append(f"  {c.name:<21} {_format_value(c.name, c.value):>12}  held: {c.why}")
    lines += ["", "every run under the fitted profile", ""]
    lines += format_runs(result.runs)
    for label, why in result.skipped:
        lines.append(f"  skipped {label}: {why}")
    return "\n".join(lines)
