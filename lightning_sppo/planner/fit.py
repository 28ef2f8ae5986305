"""``sppo-plan --fit-suite``: a profile's constants fitted to whole measured steps, not to kernels alone.

``--calibrate`` times one matmul and one copy; a training step is more than that (attention at its own rate, small
kernels between the big ones, copies that the compute only partly hides, an allocator that holds more than it
hands out). This fits the planner's per-GPU constants to the step times and peak memory that
``benchmarks/gpu_suite.py`` measured, by predicting every run of the suite with the planner itself
(``planner.evaluate`` and ``planner.step_time``, the very functions ``sppo-plan`` ranks plans with):

    mfu               matmul FLOP/s over the profile's peak         (``HardwareProfile.mfu``)
    attention_mfu     attention FLOP/s over the peak                (``HardwareProfile.attention_mfu``)
    layer_overhead_s  fixed seconds per layer and subsequence pass  (``HardwareProfile.layer_overhead_s``)
    copy_gbps         host <-> device copy GB/s, both directions    (``d2h_gbps`` and ``h2d_gbps``: the suite copies
                      both ways in one step and cannot tell them apart)
    reserved_bytes    device bytes a run needs beyond what the planner counts: the CUDA context (the suite records
                      it) plus the allocator's cache and fragmentation over the planner's peak (mean over the runs)

The four time constants are fitted together by least squares on relative errors, (predicted - measured) /
measured per run (Levenberg-Marquardt on 1 / mfu, 1 / attention_mfu, overhead, 1 / copy rate: the prediction is
linear in these except where a copy is partly hidden). A constant the runs cannot pin down (no run's time depends on
it, or two constants move the predictions alike: one S and one N cannot tell matmuls from attention) would come back
as noise, so each fit is checked: relative standard errors from the Jacobian at the optimum, with the residual
spread but never less than ``NOISE_FLOOR`` (a timed step varies by that much), and a constant beyond
``MAX_RELATIVE_ERROR`` is held at the base profile's value, said so, and the rest refitted.

The suite's rows carry what a prediction needs in a ``"planner"`` entry (layout, partition, offload policy,
recompute, K/V on host, precision) beside their measured ``seconds`` and ``peak_reserved_bytes``; rows without it
(the plain model, which the planner does not model) are listed as skipped.
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
from lightning_sppo.planner.costs import CostModel
from lightning_sppo.planner.evaluate import OFFLOAD_ORDER, SCHEDULE_ORDER, Limits, evaluate
from lightning_sppo.planner.layout import Layout, placement, stage_specs
from lightning_sppo.planner.options import DEFAULT_KV_CHUNK_TOKENS, RECOMPUTE_ORDER
from lightning_sppo.planner.precision import KV_GRAD_DTYPES, PRECISIONS, precision_bytes
from lightning_sppo.planner.profile import BUILTIN_PROFILES, HardwareProfile
from lightning_sppo.planner.step_time import simulate_step_time
from lightning_sppo.planner.units import format_bytes

__all__ = [
    "FITTED",
    "MAX_RELATIVE_ERROR",
    "NOISE_FLOOR",
    "Constant",
    "FitResult",
    "RunFit",
    "Suite",
    "SuiteError",
    "SuiteRun",
    "base_profile",
    "fit_suite",
    "format_fit",
    "load_suite",
    "predict",
]

FITTED = ("mfu", "attention_mfu", "layer_overhead_s", "copy_gbps")
"""The time constants fitted, in this order; ``reserved_bytes`` is fitted after them from the peaks."""
NOISE_FLOOR = 0.005
"""Relative spread assumed of a measured step time at least (0.5%), when judging what the runs determine."""
MAX_RELATIVE_ERROR = 0.10
"""A constant whose relative standard error exceeds this is not determined by the suite and is held."""
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
    """Subsequence lengths the engine ran (their sum is the sequence length)."""
    offload: str
    recompute: str
    kv_device_tokens: int | None
    """Tokens of each layer's K/V kept on the device (None: all)."""
    kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS
    precision: str = "bf16-mixed"
    kv_grad_dtype: str = "fp32"
    batch_size: int = 1
    layout: Layout = Layout(1, 1, 1)
    gpus_per_node: int = 1
    schedule: str = "seq1f1b"
    fsdp_sync: str = "step"
    step_s: float
    """Measured seconds of one step (median)."""
    peak_bytes: int | None
    """Measured peak bytes the caching allocator held (``torch.cuda.max_memory_reserved``); None off CUDA."""

    @property
    def seq_len(self) -> int:
        return sum(self.partition)

    @property
    def label(self) -> str:
        return f"{self.name} S={self.seq_len}"


@dataclass(frozen=True)
class Suite:
    """The runs of one ``gpu_suite.json`` the planner can predict, and what it cannot (with why)."""

    runs: tuple[SuiteRun, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    """(run, why) for every row left out of the fit."""
    device: str = "unknown device"
    hbm_bytes: int | None = None
    """The device's memory (``torch.cuda.get_device_properties().total_memory``)."""
    context_bytes: int | None = None
    """Device bytes in use outside PyTorch's allocator (CUDA context, libraries' kernels), measured once."""


@dataclass(frozen=True)
class Constant:
    """One fitted (or held) constant of the profile."""

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
    """Predicted against measured, for one run, under the fitted profile."""

    run: SuiteRun
    predicted_s: float
    predicted_bytes: int
    """The planner's device peak including the fitted ``reserved_bytes``."""
    measured_bytes: int | None
    """Measured peak reserved plus the suite's context bytes: what the run needed of the device."""

    @property
    def time_error(self) -> float:
        return self.predicted_s / self.run.step_s - 1

    @property
    def memory_error(self) -> float | None:
        return None if self.measured_bytes is None else self.predicted_bytes / self.measured_bytes - 1


@dataclass(frozen=True)
class FitResult:
    profile: HardwareProfile
    constants: tuple[Constant, ...]
    runs: tuple[RunFit, ...]
    skipped: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def constant(self, name: str) -> Constant:
        return next(c for c in self.constants if c.name == name)


# -- reading a suite ------------------------------------------------------------------------------------


def load_suite(source: str | Path | dict[str, Any]) -> Suite:
    """The predictable runs of a ``gpu_suite.json`` (a path, or the parsed object); ``SuiteError`` names the field
    to fix when the file is not a suite, a row lacks what the fit needs, or no row is usable."""
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
    runs, skipped = [], []
    for index, row in enumerate(data["table"]):
        if not isinstance(row, dict):
            raise SuiteError(f"{where}: table[{index}] is {type(row).__name__}, not an object.")
        label = f"{row.get('run', '?')} S={row.get('seq_len', '?')}"
        if row.get("status") != "ok":
            skipped.append((label, f"status {row.get('status')!r}"))
        elif "planner" not in row:
            skipped.append((label, "no 'planner' entry: the plain model is not what sppo-plan plans"))
        else:
            runs.append(_run(row, config, f"{where}: table[{index}] ({label})"))
    if not runs:
        raise SuiteError(
            f"{where}: no run to fit: every row is skipped ({len(skipped)} rows; a row needs status 'ok', 'seconds'"
            f" and a 'planner' entry); {_SUITE_HINT}."
        )
    return Suite(
        tuple(runs), tuple(skipped), str(env.get("device", "unknown device")),
        _optional_int(env, "total_memory_bytes", where), _optional_int(env, "context_bytes", where),
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


def _run(row: dict, config: GPTConfig, where: str) -> SuiteRun:
    spec = row["planner"]
    if not isinstance(spec, dict):
        raise SuiteError(f"{where}: 'planner' must be an object, got {type(spec).__name__}.")
    missing = [k for k in ("partition", "offload", "recompute") if k not in spec]
    missing += [k for k in ("seconds",) if k not in row]
    if missing:
        raise SuiteError(f"{where}: missing {missing}; {_SUITE_HINT}.")
    partition = spec["partition"]
    if not isinstance(partition, list) or not partition or not all(_positive_int(n) for n in partition):
        raise SuiteError(f"{where}: planner.partition must be a non-empty list of token counts, got {partition!r}.")
    if row.get("seq_len") is not None and sum(partition) != row["seq_len"]:
        raise SuiteError(f"{where}: planner.partition sums to {sum(partition)}, not seq_len={row['seq_len']}.")
    seconds = row["seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise SuiteError(f"{where}: seconds must be a measured step time > 0, got seconds={seconds!r}.")
    for key, choices in (("offload", OFFLOAD_ORDER), ("recompute", RECOMPUTE_ORDER),
                         ("precision", PRECISIONS), ("kv_grad_dtype", KV_GRAD_DTYPES), ("schedule", SCHEDULE_ORDER)):  # fmt: skip
        if key in spec and spec[key] not in choices:
            raise SuiteError(f"{where}: planner.{key}={spec[key]!r} is not one of {list(choices)}.")
    kv = spec.get("kv_device_tokens")
    if kv is not None and not (_positive_int(kv) or kv == 0):
        raise SuiteError(f"{where}: planner.kv_device_tokens must be null or a token count >= 0, got {kv!r}.")
    sizes = {k: spec.get(k, 1) for k in ("sp", "pp", "dp", "batch_size", "gpus_per_node")}
    bad = {k: v for k, v in sizes.items() if not _positive_int(v)}
    if bad:
        raise SuiteError(f"{where}: planner {bad} must be positive integers.")
    peak = row.get("peak_reserved_bytes")
    if peak is not None and not _positive_int(peak):
        raise SuiteError(f"{where}: peak_reserved_bytes must be null or a byte count > 0, got {peak!r}.")
    return SuiteRun(
        name=str(row.get("run", "?")), config=config, partition=tuple(partition), offload=spec["offload"],
        recompute=spec["recompute"], kv_device_tokens=kv,
        kv_chunk_tokens=spec.get("kv_chunk_tokens", DEFAULT_KV_CHUNK_TOKENS),
        precision=spec.get("precision", "bf16-mixed"), kv_grad_dtype=spec.get("kv_grad_dtype", "fp32"),
        batch_size=sizes["batch_size"], layout=Layout(sizes["sp"], sizes["pp"], sizes["dp"]),
        gpus_per_node=sizes["gpus_per_node"], schedule=spec.get("schedule", "seq1f1b"),
        fsdp_sync=spec.get("fsdp_sync", "step"), step_s=float(seconds), peak_bytes=peak,
    )  # fmt: skip


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def base_profile(suite: Suite) -> HardwareProfile:
    """The built-in profile of the suite's GPU (its datasheet peak is what ``mfu`` divides), or ``SuiteError`` asking
    for ``--gpu`` when the device is none of those."""
    upper = suite.device.upper()
    for tag, key in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb")):
        if tag in upper:
            return BUILTIN_PROFILES[key]
    raise SuiteError(
        f"the suite's device {suite.device!r} is none of A100, H100, H200: give --gpu a built-in profile"
        f" {sorted(BUILTIN_PROFILES)} or a profile JSON to start from (its peak_bf16_tflops is what mfu divides)."
    )


# -- predicting a run -----------------------------------------------------------------------------------


def predict(run: SuiteRun, profile: HardwareProfile) -> tuple[float, int]:
    """(step seconds, device peak bytes without ``reserved_bytes``) the planner predicts for ``run`` on ``profile``:
    the run's own layout, partition, offload policy, recompute and K/V spill, evaluated and simulated as
    ``sppo-plan`` does for the candidates it reports."""
    profile = replace(profile, gpus_per_node=run.gpus_per_node)
    layout = run.layout
    sharded = layout.dp * layout.sp > 1
    costs = CostModel(
        run.config, precision_bytes(run.precision, sharded, run.kv_grad_dtype), profile, None, run.recompute, "device"
    )
    evaluation = evaluate(
        costs, layout, placement(layout, run.gpus_per_node), stage_specs(run.config, layout.pp), run.partition,
        Limits(_NO_LIMIT, _NO_LIMIT), batch=run.batch_size, sync=run.fsdp_sync, offloads=(run.offload,),
        schedule=run.schedule, kv_device_tokens=run.kv_device_tokens, kv_chunk_tokens=run.kv_chunk_tokens,
    )  # fmt: skip
    return simulate_step_time(evaluation).step_s, evaluation.peak_gpu_bytes


# -- the constants as fit variables ----------------------------------------------------------------------

# Each fitted constant as a variable the step time is (nearly) linear in, and back.
_TO_VARIABLE: dict[str, Callable[[float], float]] = {
    "mfu": lambda v: 1.0 / v,
    "attention_mfu": lambda v: 1.0 / v,
    "layer_overhead_s": lambda v: v,
    "copy_gbps": lambda v: 1.0 / v,
}
_FROM_VARIABLE = _TO_VARIABLE  # each map is its own inverse
_LOWER = {"mfu": 1.0, "attention_mfu": 1.0, "layer_overhead_s": 0.0, "copy_gbps": 1e-9}
"""Bounds of the variables: an mfu of at most 1, an overhead of at least 0, a finite copy rate."""


def _base_values(profile: HardwareProfile) -> dict[str, float]:
    return {
        "mfu": profile.mfu,
        "attention_mfu": profile.mfu if profile.attention_mfu is None else profile.attention_mfu,
        "layer_overhead_s": profile.layer_overhead_s,
        "copy_gbps": math.sqrt(profile.d2h_gbps * profile.h2d_gbps),
    }


def _with_values(profile: HardwareProfile, values: dict[str, float | None]) -> HardwareProfile:
    """``profile`` with the constants' ``values``; None keeps attention at ``mfu``'s rate and the copy rates as they
    are (what a held ``attention_mfu`` or ``copy_gbps`` means)."""
    attention, copy = values["attention_mfu"], values["copy_gbps"]
    return replace(
        profile, mfu=min(1.0, values["mfu"]), attention_mfu=None if attention is None else min(1.0, attention),
        layer_overhead_s=max(0.0, values["layer_overhead_s"]),
        d2h_gbps=profile.d2h_gbps if copy is None else copy, h2d_gbps=profile.h2d_gbps if copy is None else copy,
    )  # fmt: skip


@dataclass
class _Problem:
    """Relative step-time residuals of the suite as a function of the free variables (the rest held)."""

    runs: Sequence[SuiteRun]
    base: HardwareProfile
    held: dict[str, float | None]
    """Constants not fitted: the base value, or None (``_with_values``)."""
    free: list[str]
    scale: np.ndarray

    def values(self, z: np.ndarray) -> dict[str, float | None]:
        out = dict(self.held)
        for name, zi, s in zip(self.free, z, self.scale, strict=True):
            out[name] = _FROM_VARIABLE[name](max(zi * s, _LOWER[name]))
        return out

    def residuals(self, z: np.ndarray) -> np.ndarray:
        profile = _with_values(self.base, self.values(z))
        return np.array([predict(run, profile)[0] / run.step_s - 1.0 for run in self.runs])

    def project(self, z: np.ndarray) -> np.ndarray:
        lower = np.array([_LOWER[name] for name in self.free]) / self.scale
        return np.maximum(z, lower)

    def jacobian(self, z: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Forward differences (one-sided away from a bound), in the scaled variables."""
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
    """Standard error of each free constant over its value, for residuals of relative spread ``spread``.

    In the variables x = z * scale, a constant c = x or 1 / x has the same relative error as x; the Jacobian in
    relative terms (d residual / d log x) is jac * z. A direction the runs do not see has a tiny eigenvalue, so its
    constants get a huge error (never zero, as a pseudo-inverse would give)."""
    elasticity = jac * np.where(np.abs(z) > 0, z, 1.0)
    normal = elasticity.T @ elasticity
    eigenvalues, vectors = np.linalg.eigh(normal)
    floor = 1e-30 + 1e-14 * max(float(eigenvalues.max(initial=0.0)), 0.0)
    inverse = (vectors / np.maximum(eigenvalues, floor)) @ vectors.T
    return spread * np.sqrt(np.maximum(np.diag(inverse), 0.0))


def _why_held(problem: _Problem, name: str, jac: np.ndarray, z: np.ndarray, error: float, spread: float) -> str:
    """Why ``name`` is not determined: no run depends on it, or it moves the predictions as another constant does."""
    elasticity = jac * np.where(np.abs(z) > 0, z, 1.0)
    j = problem.free.index(name)
    column = elasticity[:, j]
    if float(np.max(np.abs(column), initial=0.0)) < 1e-6:
        what = {
            "copy_gbps": "no run's predicted time has a copy the compute does not hide (add offload=full or K/V on"
            " host at short subsequences)",
            "layer_overhead_s": "no run's predicted time depends on it",
        }.get(name, "no run's predicted time depends on it")
        return f"{what}; held ({_HELD[name]})"
    partners = []
    for k, other in enumerate(problem.free):
        if k == j:
            continue
        other_column = elasticity[:, k]
        norm = float(np.linalg.norm(column) * np.linalg.norm(other_column))
        if norm > 0 and abs(float(column @ other_column)) / norm > 0.99:
            partners.append(other)
    alike = f": the runs cannot tell it from {' and '.join(partners)}" if partners else ""
    shown = f"{error:.0%}" if error < 10 else "over 1000%"
    return (
        f"the suite's runs do not determine it (relative error {shown} > {MAX_RELATIVE_ERROR:.0%} at a step-time"
        f" spread of {spread:.1%}{alike}; more S and N, timed steadily, would); held ({_HELD[name]})"
    )


_HELD = {
    "mfu": "the base profile's value",
    "attention_mfu": "attention runs at mfu's rate",
    "layer_overhead_s": "the base profile's value",
    "copy_gbps": "the base profile's d2h_gbps and h2d_gbps",
}


def fit_suite(suite: Suite, base: HardwareProfile) -> FitResult:
    """The profile ``base`` with every constant the suite determines fitted to its runs (module docstring); constants
    it does not determine are held and say why (``Constant.why``): ``attention_mfu`` then runs at ``mfu``'s rate
    (one rate for all FLOPs), ``copy_gbps`` keeps ``base``'s two copy rates, the others keep ``base``'s values."""
    base_values = _base_values(base)
    held: dict[str, float | None] = {}
    reasons: dict[str, str] = {}
    free = list(FITTED)
    start = dict(base_values)
    while True:
        scale = np.array([abs(_TO_VARIABLE[n](start[n])) or 1e-4 for n in free])
        problem = _Problem(suite.runs, base, held, free, scale)
        z, r, jac = _least_squares(problem, np.array([_TO_VARIABLE[n](start[n]) for n in free]) / scale)
        values = problem.values(z)
        bounded = [n for n in free if n in ("mfu", "attention_mfu") and values[n] >= 1.0]
        if bounded:  # the steps ran faster than the base's peak allows: no error estimate means anything there
            for name in bounded:
                reasons[name] = (
                    f"at its bound, 1: the steps ran at least at peak_bf16_tflops={base.peak_bf16_tflops:g}; give"
                    " --gpu a profile with the device's own peak"
                )
                held[name] = 1.0
                free.remove(name)
            start = {n: v for n, v in values.items() if n in free}
            continue
        spread = max(float(np.sqrt(np.mean(r**2))), NOISE_FLOOR)
        errors = _relative_errors(z, jac, spread) if free else np.zeros(0)
        if not free or float(errors.max()) <= MAX_RELATIVE_ERROR:
            break
        name = free[int(np.argmax(errors))]
        if name == "mfu" and "attention_mfu" in free:  # one rate for all FLOPs before none at all
            name = "attention_mfu"
        reasons[name] = _why_held(problem, name, jac, z, float(errors[free.index(name)]), spread)
        held[name] = None if name in ("attention_mfu", "copy_gbps") else base_values[name]
        start = {n: v for n, v in problem.values(z).items() if n in free and n != name}
        free.remove(name)
    values = problem.values(z)
    timed = _with_values(base, values)
    actual = float(np.sqrt(np.mean(r**2)))
    reported = _relative_errors(z, jac, actual) if free else np.zeros(0)
    shown = _base_values(timed)  # what the written profile holds (a held attention_mfu shows mfu's rate)
    constants = [
        Constant(name, shown[name], base_values[name], name in free,
                 float(reported[free.index(name)]) if name in free else None, reasons.get(name, ""))
        for name in FITTED
    ]  # fmt: skip
    reserve, runs = _fit_reserve(suite, timed, base)
    profile = replace(
        timed, name=f"fitted: {suite.device}", reserved_bytes=int(round(reserve.value)),
        hbm_bytes=suite.hbm_bytes or base.hbm_bytes,
    )  # fmt: skip
    return FitResult(profile, (*constants, reserve), runs, suite.skipped)


def _fit_reserve(suite: Suite, profile: HardwareProfile, base: HardwareProfile) -> tuple[Constant, tuple[RunFit, ...]]:
    """``reserved_bytes``: the context bytes plus the mean of (measured peak - predicted peak) over the runs with a
    peak (least squares for one additive constant), and every run's predicted-vs-measured figures under it."""
    predicted = [predict(run, profile) for run in suite.runs]
    context = suite.context_bytes or 0
    gaps = [
        run.peak_bytes + context - peak for run, (_, peak) in zip(suite.runs, predicted, strict=True) if run.peak_bytes
    ]
    if gaps:
        value = max(0.0, float(np.mean(gaps)))
        spread = float(np.std(gaps) / math.sqrt(len(gaps))) / value if value and len(gaps) > 1 else None
        why = "" if suite.context_bytes is not None else "(the suite did not record context_bytes: allocator only)"
        reserve = Constant("reserved_bytes", value, float(base.reserved_bytes), True, spread, why)
    else:
        value = float(base.reserved_bytes)
        reserve = Constant(
            "reserved_bytes", value, value, False, None,
            "no run has a measured peak (peak_reserved_bytes; a CPU suite has none); held at the base profile's value",
        )  # fmt: skip
    runs = tuple(
        RunFit(run, seconds, peak + int(round(value)), run.peak_bytes + context if run.peak_bytes else None)
        for run, (seconds, peak) in zip(suite.runs, predicted, strict=True)
    )
    return reserve, runs


# -- the report -----------------------------------------------------------------------------------------


def _format_value(name: str, value: float) -> str:
    if name == "reserved_bytes":
        return format_bytes(int(round(value)))
    if name == "layer_overhead_s":
        return f"{value * 1e6:.1f} us"
    if name == "copy_gbps":
        return f"{value:.3g} GB/s"
    return f"{value:.4g}"


def format_fit(result: FitResult) -> str:
    """The fitted constants (with their standard errors, or why they were held) and, for every run of the suite,
    predicted against measured step time and peak memory under the fitted profile."""
    lines = [f"fitted profile: {result.profile.name} (peak {result.profile.peak_bf16_tflops:g} TFLOP/s bf16)", ""]
    for c in result.constants:
        if c.fitted:
            error = "" if c.relative_error is None else f" +- {c.relative_error:.1%}"
            lines.append(
                f"  {c.name:<17} {_format_value(c.name, c.value):>12}{error}  (base {_format_value(c.name, c.base)}) {c.why}"
            )
        else:
            lines.append(f"  {c.name:<17} {_format_value(c.name, c.value):>12}  held: {c.why}")
    width = max([len(f.run.label) for f in result.runs] + [3])
    lines += ["", f"  {'run':<{width}} {'step s':>9} {'pred s':>9} {'err':>7} {'peak':>10} {'pred':>10} {'err':>7}"]
    for fit in result.runs:
        measured = "-" if fit.measured_bytes is None else format_bytes(fit.measured_bytes)
        memory = "-" if fit.memory_error is None else f"{fit.memory_error:+.1%}"
        lines.append(
            f"  {fit.run.label:<{width}} {fit.run.step_s:>9.4g} {fit.predicted_s:>9.4g} {fit.time_error:>+7.1%}"
            f" {measured:>10} {format_bytes(fit.predicted_bytes):>10} {memory:>7}"
        )
    time_errors = [abs(f.time_error) for f in result.runs]
    memory_errors = [abs(f.memory_error) for f in result.runs if f.memory_error is not None]
    lines.append("")
    lines.append(
        f"  step time: mean |error| {np.mean(time_errors):.1%}, worst {max(time_errors):.1%} over {len(time_errors)} runs"
    )
    if memory_errors:
        lines.append(f"  peak memory: mean |error| {np.mean(memory_errors):.1%}, worst {max(memory_errors):.1%}")
    for label, why in result.skipped:
        lines.append(f"  skipped {label}: {why}")
    return "\n".join(lines)
