"""Honest advice: the plain model with full activation checkpointing ("AC") scored beside every plan.

AC is what a user would do without this project: every block checkpointed, the whole sequence on each GPU (data
parallel, model state sharded over the GPUs). ``planner.plain`` scores it under the same cost model as the plans;
when it fits and trains more tokens per GPU per second than the plan, the plan says so in one line with both
figures, so nobody picks the engine where it loses.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_sppo.planner.costs import CostModel
from lightning_sppo.planner.plain import plain_step
from lightning_sppo.planner.plan import PlanRequest
from lightning_sppo.planner.precision import precision_bytes
from lightning_sppo.planner.units import format_bytes

__all__ = ["ac_advice", "score_ac"]


def score_ac(request: PlanRequest) -> dict:
    """The plain model with full activation checkpointing for ``request``: its step time, tokens per GPU per second,
    device peak (with the allocator's slack and the profile's reserve), whether that fits, and its attention kernel."""
    profile = request.profile
    world = request.world_size
    costs = CostModel(request.config, precision_bytes(request.precision, world > 1, request.kv_grad_dtype), profile,
                      request.document_length)  # fmt: skip
    step = plain_step(costs, request.seq_len, True, world=world)
    peak = step.peak_bytes + profile.allocator_slack_bytes + profile.reserved_bytes
    return {
        "step_time_s": step.step_s, "tokens_per_gpu_per_s": request.batch_size * step.tokens_per_s,
        "peak_gpu_bytes": peak, "fits": peak <= profile.hbm_bytes, "kernel": step.kernel,
    }  # fmt: skip


def ac_advice(ac: dict, tokens_per_gpu_per_s: float) -> str:
    """The one line saying AC is faster than the plan (with both figures), or "" when it is not (or does not fit)."""
    if not ac["fits"] or ac["tokens_per_gpu_per_s"] <= tokens_per_gpu_per_s:
        return ""
    return (
        f"the plain model with full activation checkpointing is faster here: {ac['tokens_per_gpu_per_s']:.0f}"
        f" tokens/GPU/s ({ac['step_time_s']:.2f} s per sequence, {format_bytes(ac['peak_gpu_bytes'])} per GPU)"
        f" against this plan's {tokens_per_gpu_per_s:.0f}: train without sppo"
    )


def without_ac(request: PlanRequest) -> PlanRequest:
    """``request`` without the AC comparison (the searches inside ``--max-seq-len`` do not need it)."""
    return replace(request, compare_ac=False)
