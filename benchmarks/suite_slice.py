"""Part f of the decisive preset: the longest sequence of the layer order and of plain + AC, measured on slices of the
model (its full width, one and two layers) and extrapolated to all its layers.

Why slices: a search on the whole model probes one step per length, and near the answer a step is long (plain + AC at
512K: about 3 minutes on an H100); on a slice of one or two layers the same lengths cost an eighth or less. What
grows with the length is per token (K/V, kept checkpoints, activations: no S x S term with fused attention), so
bytes are linear in S for a given number of layers, and linear in the layers for a given S.

Method (printed with the figures):

1. one training step of each slice (``slice_layers``, e.g. 1 and 2 layers) at two lengths (``slice_lens``): peak
   bytes allocated on the device (``torch.cuda.max_memory_allocated``) and, for the layer order, bytes kept on host;
2. the fit ``bytes(S, l) = A + B S + l (C + D S)`` through those four points, exactly (A: embedding, head and the
   step's fixed bytes; B: their bytes per token; C: one layer's weights and gradients; D: one layer's bytes per
   token);
3. its check: one step of the larger slice at ``slice_check_len``, measured against the fit's prediction;
4. the extrapolation to the model's L layers: the longest S with ``A + B S + L (C + D S)`` within the device's
   memory (its total, less the CUDA context and the allocator's largest measured slack) and, for what goes to host,
   within the host memory available when the part starts; rounded down to a multiple of 1K.

Beside it, the planner's own longest for the same run (its memory model on the suite's profile, device memory only).
On CPU no device memory is measured: the fit runs on the planner's predicted bytes instead, to exercise the method,
and says so.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
from cuda_timing import measure
from gpu_checks import batch, release_memory
from suite_alloc import does_not_fit
from suite_predict import AC, LAYER, run_prediction
from suite_runs import LAYER_SETTINGS, close_run, make_run, suite_config
from suite_state import Context, context_bytes, first_line

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT
from lightning_sppo.offload.pool import available_host_bytes
from lightning_sppo.parallel.parallelize import materialize

__all__ = ["METHOD", "SLICE_RUNS", "extrapolate", "fit_bytes", "planner_longest", "predict_slices", "run_slice_longest"]

SLICE_RUNS = (LAYER, AC)
GRANULE = 1024
METHOD = (
    "one step per probe on slices of the model (full width, {layers} layers) at {lens}; bytes(S, l) = A + B S +"
    " l (C + D S) fitted exactly through those four points; checked by one step of the {top}-layer slice at {check};"
    " extrapolated to the model's {L} layers: the longest S (multiple of 1K) whose bytes fit the device (total less"
    " the CUDA context and the largest allocator slack measured) and, for bytes kept on host, the host memory"
    " available when the part started"
)


def probes(sizes: Any) -> list[tuple[int, int]]:
    """(layers, S) of every probe of one run: the fit's four, then the check."""
    fit = [(layers, seq_len) for layers in sizes.slice_layers for seq_len in sizes.slice_lens]
    return fit + [(max(sizes.slice_layers), sizes.slice_check_len)]


def _slice(config: GPTConfig, layers: int) -> GPTConfig:
    return replace(config, n_layer=layers)


def _settings(run: str, sizes: Any) -> dict[str, Any] | None:
    if run == AC:
        return None
    chunks = {} if sizes.layer_chunk_count is None else {"num_subsequences": sizes.layer_chunk_count}
    return LAYER_SETTINGS | chunks


def predict_slices(sizes: Any, config: GPTConfig, profile: Any) -> float:
    """Seconds of part f: every probe's predicted step plus its fixed cost (``Overheads.probe_s``)."""
    total = 0.0
    for _run in SLICE_RUNS:
        for layers, seq_len in probes(sizes):
            step = run_prediction(
                _slice(config, layers), _run, seq_len, profile, layer_chunk_count=sizes.layer_chunk_count
            )
            total += step.step_s + sizes.overheads.probe_s
    return total


# -- the fit and the extrapolation ------------------------------------------------------------------------


def fit_bytes(points: dict[tuple[int, int], float]) -> dict[str, float]:
    """A, B, C, D of ``bytes(S, l) = A + B S + l (C + D S)`` through four points {(l, S): bytes} at two layer counts
    and two lengths."""
    (l1, l2), (s1, s2) = sorted({n for n, _ in points}), sorted({s for _, s in points})
    slope = {layers: (points[(layers, s2)] - points[(layers, s1)]) / (s2 - s1) for layers in (l1, l2)}
    intercept = {layers: points[(layers, s1)] - slope[layers] * s1 for layers in (l1, l2)}
    d = (slope[l2] - slope[l1]) / (l2 - l1)
    c = (intercept[l2] - intercept[l1]) / (l2 - l1)
    return {"A": intercept[l1] - l1 * c, "B": slope[l1] - l1 * d, "C": c, "D": d}


def bytes_at(fit: dict[str, float], layers: int, seq_len: float) -> float:
    return fit["A"] + fit["B"] * seq_len + layers * (fit["C"] + fit["D"] * seq_len)


def longest_within(fit: dict[str, float], layers: int, capacity: float) -> int | None:
    """The longest multiple of 1K whose fitted bytes at ``layers`` layers fit ``capacity``; None when nothing
    grows with S (no bound) or not even 1K fits (0)."""
    per_token = fit["B"] + layers * fit["D"]
    if per_token <= 0:
        return None
    seq_len = (capacity - fit["A"] - layers * fit["C"]) / per_token
    return max(0, int(seq_len) // GRANULE * GRANULE)


def extrapolate(entry: dict[str, Any], layers: int, device_capacity: float, host_capacity: float | None) -> dict:
    """The fit of ``entry``'s probes, its check, and the longest S at ``layers`` layers (module docstring)."""
    fit_probes = entry["probes"][:-1]
    check = entry["probes"][-1]
    if any(p.get("bytes") is None for p in entry["probes"]):
        return {"extrapolated_longest": None, "why": "a probe has no bytes (it failed, or was skipped)"}
    device = fit_bytes({(p["layers"], p["seq_len"]): p["bytes"] for p in fit_probes})
    out: dict[str, Any] = {"fit": device, "device_capacity_bytes": device_capacity}
    out["check"] = {"layers": check["layers"], "seq_len": check["seq_len"], "measured_bytes": check["bytes"],
                    "fit_bytes": bytes_at(device, check["layers"], check["seq_len"])}  # fmt: skip
    out["check"]["error"] = out["check"]["fit_bytes"] / check["bytes"] - 1
    bounds = {"device": longest_within(device, layers, device_capacity)}
    host_points = {(p["layers"], p["seq_len"]): float(p.get("host_bytes") or 0) for p in fit_probes}
    if host_capacity is not None and any(host_points.values()):
        host = fit_bytes(host_points)
        out |= {"host_fit": host, "host_capacity_bytes": host_capacity}
        bounds["host"] = longest_within(host, layers, host_capacity)
    limited = {k: v for k, v in bounds.items() if v is not None}
    out["bounds"] = bounds
    out["extrapolated_longest"] = min(limited.values()) if limited else None
    out["bound_by"] = min(limited, key=lambda k: limited[k]) if limited else None
    return out


def planner_longest(config: GPTConfig, run: str, profile: Any, chunks: int | None, cap: int = 4 * 2**20) -> int | None:
    """The longest multiple of 1K up to ``cap`` whose predicted device peak (with the allocator's slack and the
    profile's reserve) fits the profile's memory: the planner's own answer for ``run``, device memory only."""

    def fits(seq_len: int) -> bool:
        p = run_prediction(config, run, seq_len, profile, layer_chunk_count=chunks)
        return p.allocated_bytes + p.slack_bytes + profile.reserved_bytes <= profile.hbm_bytes

    lo, hi = 0, cap // GRANULE
    if not fits(GRANULE):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * GRANULE) else (lo, mid)
    return (hi if fits(hi * GRANULE) else lo) * GRANULE


# -- the part ------------------------------------------------------------------------------------------------


def run_slice_longest(ctx: Context) -> None:
    """Part f: every probe of the layer order, then of plain + AC, one step each; then each run's fit, check and
    extrapolation, and the planner's longest beside."""
    sizes, planner = ctx.sizes, ctx.cache["planner"]
    config = suite_config(ctx, sizes.model)
    ctx.cache.pop("model", None)  # the full model's memory is not the slices'
    release_memory(ctx.device)
    cuda = ctx.device.type == "cuda"
    host = available_host_bytes()
    section = ctx.data["longest"] = {
        "method": METHOD.format(layers=" and ".join(map(str, sizes.slice_layers)),
                                lens=" and ".join(map(str, sizes.slice_lens)), top=max(sizes.slice_layers),
                                check=sizes.slice_check_len, L=config.n_layer),
        "bytes": "measured peak allocated" if cuda else "CPU: the planner's predicted peak (no device memory here)",
        "host_available_bytes": host, "runs": [],
    }  # fmt: skip
    models: dict[int, GPT] = {}
    for run in SLICE_RUNS:
        entry = {"run": run, "model": config.name, "layers": config.n_layer, "probes": []}
        section["runs"].append(entry)
        for layers, seq_len in probes(sizes):
            entry["probes"].append(_probe(ctx, config, run, layers, seq_len, models))
            ctx.save()
        capacity = _device_capacity(ctx, entry, planner.profile)
        entry |= extrapolate(entry, config.n_layer, capacity, host)
        entry["planner_longest"] = planner_longest(config, run, planner.profile, sizes.layer_chunk_count)
        ctx.save()
        print(f"longest {run}: extrapolated {entry.get('extrapolated_longest')} ({entry.get('bound_by')}),"
              f" planner {entry['planner_longest']}", flush=True)  # fmt: skip
    models.clear()
    release_memory(ctx.device)


def _device_capacity(ctx: Context, entry: dict[str, Any], profile: Any) -> float:
    """The device's memory less the CUDA context and the largest slack the allocator showed in the probes (CPU: the
    planner profile's memory less its reserve, matching the predicted bytes that stand in for measured ones)."""
    if ctx.device.type != "cuda":
        return float(profile.hbm_bytes - profile.reserved_bytes)
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    slack = max((p["peak_reserved_bytes"] - p["bytes"] for p in entry["probes"] if p.get("peak_reserved_bytes")),
                default=0)  # fmt: skip
    return float(total - (context_bytes(ctx.device) or 0) - slack)


def _probe(ctx: Context, config: GPTConfig, run: str, layers: int, seq_len: int, models: dict[int, GPT]) -> dict:
    sizes, profile = ctx.sizes, ctx.cache["planner"].profile
    piece = _slice(config, layers)
    predicted = run_prediction(piece, run, seq_len, profile, layer_chunk_count=sizes.layer_chunk_count)
    planned = {"step_s": predicted.step_s, "peak_allocated_bytes": predicted.allocated_bytes}
    probe: dict[str, Any] = {"layers": layers, "seq_len": seq_len, "prediction": planned}
    needed = predicted.step_s + sizes.overheads.probe_s
    if not ctx.budget.affords(needed):
        return probe | {"status": f"skipped (predicted {needed:.0f} s, {ctx.budget.left():.0f} s left in the part)"}
    if layers not in models:
        torch.manual_seed(0)
        with torch.device("meta"):
            meta = GPT(piece)
        models[layers] = materialize(meta, ctx.device)
    model = models[layers]
    ids, targets = batch(piece, seq_len, ctx.device)
    started, made = time.monotonic(), None
    try:
        made = make_run(ctx, run, model, ids, targets, _settings(run, sizes))
        probe |= measure(made.step, ctx.device, 0, 1)
        probe |= {"status": "ok", "host_bytes": made.host_bytes()}
        measured = probe.get("peak_allocated_bytes")
        probe["bytes"] = measured if measured is not None else predicted.allocated_bytes
    except Exception as error:  # a failed allocation is a result; so is a broken path
        probe |= does_not_fit(error) or {"status": f"error: {type(error).__name__}", "error": first_line(error)}
    finally:
        close_run(made, probe)
        del made, ids, targets
        model.zero_grad(set_to_none=True)
        release_memory(ctx.device)
    probe["wall_s"] = time.monotonic() - started
    return probe
