"""The planner inside a run: ``num_subsequences="auto"`` and unset ``pipeline_parallel`` / ``sequence_parallel``.

The strategies ask the solver (``lightning_sppo.planner``) about the run they are about to train:

* the layout, once, when the model is set up and ``pipeline_parallel`` or ``sequence_parallel`` is None: for
  the model's ``block_size`` tokens (the batch is not known yet), the world size and the node size (the
  local process count), in the run's ``order`` (under order="layer" pipeline_parallel is 1: the planner's sp, and
  so dp, for the layer order), with whatever the settings fix (the other size, ``schedule``, ``offload``,
  ``fsdp_sync``, ``partition``, ``kv_grad_dtype``, and the run's own ``recompute``, ``kv_device_tokens``,
  ``kv_chunk_tokens`` and ``model_state``: the planner plans what the run will hold, it does not choose them);
* N and the partition, for each new sequence length and batch size, with the layout fixed.

Both answers depend on the device this rank sees, so on several processes only rank 0's answer is used: the
layout is broadcast (``broadcast_object``) and N comes with the lengths that ``step_plan/agree.py`` shares;
other ranks never ask for N.

The hardware profile is ``planner_profile`` if set (a built-in name or a JSON file), else on CUDA the built-in
profile matching the device name (H200, H100, otherwise A100-80GB) with the device's own memory size, else
(CPU) ``a100-80gb``. The planner plans the run's own ``schedule``: "seq1f1b", or "sppo" with what its shared units
hold and move (``planner.multiplexed``). Runs the planner cannot model (a precision other than 32-true and
bf16-mixed, several micro-batches, the "gpipe" schedule, explicit ``layers_per_stage``) fall back: N from
~4K-token subsequences, sizes 1. Every choice and fallback is logged once, with its reason.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.parallel.dims import ParallelDims
from lightning_sppo.partition import auto_num_subsequences
from lightning_sppo.planner import BUILTIN_PROFILES, HardwareProfile, NoFeasiblePlan, Plan, PlanRequest, solve
from lightning_sppo.planner.evaluate import SCHEDULE_ORDER
from lightning_sppo.planner.profile import resolve_profile, with_host_memory
from lightning_sppo.planner.units import format_bytes, format_tokens
from lightning_sppo.strategy.config import SPPOConfig

__all__ = ["DEFAULT_PROFILE", "AutoPlanner", "PlannerUnavailable", "device_profile", "plan_settings"]

DEFAULT_PROFILE = "a100-80gb"
"""The profile planned with when no CUDA device is visible and ``planner_profile`` is not set."""

_PLANNED_PRECISIONS = {"bf16-mixed": "bf16-mixed", "32-true": "fp32", "32": "fp32"}
_SETTING_OF_FLAG = {
    "--sp": "sequence_parallel",
    "--pp": "pipeline_parallel",
    "--offload": "offload",
    "--fsdp-sync": "fsdp_sync",
    "--schedule": "schedule",
    "--kv-grad-dtype": "kv_grad_dtype",
    "--seq-len": "seq_len",
    "--nodes": "num_nodes",
    "--gpu": "planner_profile",
    "--recompute": "recompute",
    "--kv-device-tokens": "kv_device_tokens",
    "--kv-chunk-tokens": "kv_chunk_tokens",
    "--model-state": "model_state",
    "--host-memory": "planner_profile (host_bytes_per_node)",
}


class PlannerUnavailable(Exception):
    """The planner cannot model this run; the message says why (the caller falls back)."""


class AutoPlanner:
    """What a strategy asks the planner about its run; every choice and fallback is logged once."""

    def __init__(self, settings: SPPOConfig) -> None:
        self.settings = settings
        self.precision: str | None = None
        """The strategy's precision setting ("32-true", "bf16-mixed", ...), once the strategy knows it."""
        self.gpus_per_node = 1
        """Processes per node: the planner's node size."""
        self._subsequences: dict[tuple, tuple[int, str, int]] = {}
        self.decisions: list[dict[str, Any]] = []
        """Every choice and fallback so far, with its predictions (loggers record them as hyperparameters)."""
        self.last_plan: Plan | None = None
        """The newest plan the solver made for this run (its predictions sit beside the measured metrics)."""

    def layout(self, model: nn.Module, device: torch.device, world_size: int) -> tuple[int, int]:
        """(pipeline_parallel, sequence_parallel) for the unset sizes: the planner's, or 1 when it cannot plan."""
        settings = self.settings
        try:
            precision = self._check(model)
            profile, source = device_profile(device, settings.planner_profile, self.gpus_per_node)
        except PlannerUnavailable as why:
            pp, sp = settings.pipeline_parallel or 1, settings.sequence_parallel or 1
            rank_zero_info(f"SPPO planner: {why}; unset sizes are 1: pipeline_parallel={pp}, sequence_parallel={sp}.")
            self.decisions.append(
                {"for": "layout", "pipeline_parallel": pp, "sequence_parallel": sp, "fallback": str(why)}
            )
            return pp, sp
        config: GPTConfig = model.config
        request = _request(settings, config, config.block_size, world_size, self.gpus_per_node, precision, profile)
        plan = _solve(request, "pipeline_parallel / sequence_parallel unset")
        if plan.order != settings.order or (settings.order == "layer" and plan.pp != 1):
            raise RuntimeError(  # the request names the run's order and, for the layer order, pp=1
                f"The planner answered order={plan.order!r} with pipeline_parallel={plan.pp} for a run of"
                f" order={settings.order!r}; it plans the order it is asked for (a bug: please report it)."
            )
        rank_zero_info(
            f"SPPO planner: pipeline_parallel={plan.pp}, sequence_parallel={plan.sp} (data parallel {plan.dp}) for"
            f" order={plan.order!r}, {_what(request)}, the model's block_size (profile: {source}): predicted"
            f" {format_bytes(plan.peak_gpu_bytes)} per GPU, {plan.tokens_per_gpu_per_s:.0f} tokens/GPU/s."
        )
        self.last_plan = plan
        self.decisions.append(
            {"for": "layout", "pipeline_parallel": plan.pp, "sequence_parallel": plan.sp} | _predictions(plan, source)
        )
        return plan.pp, plan.sp

    def subsequences(
        self, model: nn.Module, seq_len: int, batch: int, dims: ParallelDims, device: torch.device, granularity: int
    ) -> tuple[int, str, int]:
        """(N, partition policy, boundary granularity) for ``num_subsequences="auto"``, once per batch shape.

        ``granularity`` is what the fallback (~4K-token subsequences) cuts on when the planner cannot plan.
        """
        key = (seq_len, batch, dims)
        if key not in self._subsequences:
            self._subsequences[key] = self._plan_subsequences(model, seq_len, batch, dims, device, granularity)
        return self._subsequences[key]

    def _plan_subsequences(
        self, model: nn.Module, seq_len: int, batch: int, dims: ParallelDims, device: torch.device, granularity: int
    ) -> tuple[int, str, int]:
        settings = self.settings
        try:
            precision = self._check(model)
            profile, source = device_profile(device, settings.planner_profile, self.gpus_per_node)
        except PlannerUnavailable as why:
            n = auto_num_subsequences(seq_len, granularity)
            rank_zero_info(f"SPPO planner: {why}; num_subsequences='auto' cuts {n} subsequences of ~4K tokens.")
            self.decisions.append(
                {"for": f"seq_len={seq_len} batch={batch}", "num_subsequences": n, "fallback": str(why)}
            )
            return n, settings.partition or "length", granularity
        fixed = replace(settings, pipeline_parallel=dims.pp, sequence_parallel=dims.sp)
        request = _request(fixed, model.config, seq_len, dims.world_size, self.gpus_per_node, precision, profile, batch)
        plan = _solve(request, "num_subsequences='auto'")
        # "adaptive" lengths come from the offload policy's measured costs: the planner gives N.
        policy = "adaptive" if settings.partition == "adaptive" else plan.partition_policy
        rank_zero_info(
            f"SPPO planner: num_subsequences={plan.num_subsequences} ({policy} partition on multiples of"
            f" {plan.granularity} tokens) for {_what(request)} with pipeline_parallel={dims.pp},"
            f" sequence_parallel={dims.sp}, offload={plan.offload}, fsdp_sync={plan.fsdp_sync} (profile: {source}):"
            f" predicted {format_bytes(plan.peak_gpu_bytes)} of {format_bytes(profile.hbm_bytes)} per GPU, step"
            f" {plan.step_time_s:.3g} s."
        )
        self.last_plan = plan
        self.decisions.append(
            {"for": f"seq_len={seq_len} batch={batch}", "num_subsequences": plan.num_subsequences, "partition": policy}
            | {"offload": plan.offload, "fsdp_sync": plan.fsdp_sync}
            | _predictions(plan, source)
        )
        return plan.num_subsequences, policy, plan.granularity

    def _check(self, model: nn.Module) -> str:
        """The planner's precision for this run, or ``PlannerUnavailable`` saying why it cannot model it."""
        settings = self.settings
        if not isinstance(getattr(model, "config", None), GPTConfig):
            raise PlannerUnavailable(f"the planner models lightning_sppo.GPT, not {type(model).__name__}")
        if self.precision not in _PLANNED_PRECISIONS:
            raise PlannerUnavailable(f"the planner models precision 32-true and bf16-mixed, not {self.precision!r}")
        if settings.num_microbatches > 1:
            raise PlannerUnavailable(
                f"the planner models one micro-batch, not num_microbatches={settings.num_microbatches}"
            )
        if settings.schedule not in SCHEDULE_ORDER:
            raise PlannerUnavailable(
                f"the planner models schedule in {list(SCHEDULE_ORDER)}, not schedule={settings.schedule!r}"
            )
        if settings.layers_per_stage is not None:
            raise PlannerUnavailable("the planner balances the stages itself, and layers_per_stage is set")
        return _PLANNED_PRECISIONS[self.precision]


def device_profile(device: torch.device, override: str | None, gpus_per_node: int) -> tuple[HardwareProfile, str]:
    """The profile to plan with, and where it came from (for the log line)."""
    if override is not None:
        return resolve_profile(override, gpus_per_node, setting="planner_profile"), f"planner_profile={override!r}"
    if device.type != "cuda":
        profile = _on_node(BUILTIN_PROFILES[DEFAULT_PROFILE], gpus_per_node)
        # Said plainly: the prediction is for a GPU this CPU run is not (issue 39: "the a100-80gb default").
        return profile, f"{DEFAULT_PROFILE}, as if this CPU run were on that GPU; planner_profile picks another"
    name = torch.cuda.get_device_name(device)
    key = next((k for tag, k in (("H200", "h200"), ("H100", "h100")) if tag in name.upper()), DEFAULT_PROFILE)
    memory = torch.cuda.get_device_properties(device).total_memory
    profile = _on_node(replace(BUILTIN_PROFILES[key], hbm_bytes=memory), gpus_per_node)
    return profile, f"built-in {key} for {name!r} with its {format_bytes(memory)}"


def plan_settings(plan: Plan) -> dict[str, Any]:
    """The ``SPPOConfig`` keyword arguments that run ``plan`` as planned (the precision, ``plan.precision``, is the
    strategy's own setting). The one place a plan becomes run settings: a plan field the strategy learns to run is
    added here, and whatever builds a run from a plan (``benchmarks/gpu_suite.py``) runs it unchanged."""
    settings: dict[str, Any] = {
        "pipeline_parallel": plan.pp, "sequence_parallel": plan.sp, "num_subsequences": plan.num_subsequences,
        "num_microbatches": plan.num_microbatches, "schedule": plan.schedule, "partition": plan.partition_policy,
        "granularity": plan.granularity, "offload": plan.offload, "fsdp_sync": plan.fsdp_sync,
        "recompute": plan.recompute, "kv_device_tokens": plan.kv_device_tokens,
        "kv_chunk_tokens": plan.kv_chunk_tokens, "model_state": plan.model_state, "kv_grad_dtype": plan.kv_grad_dtype,
        "order": plan.order,
    }  # fmt: skip
    if plan.pp > 1:  # the planner's own balance of the stages (the strategy's default balances compute too)
        settings["layers_per_stage"] = list(plan.layers_per_stage)
    return settings


def _on_node(profile: HardwareProfile, gpus_per_node: int) -> HardwareProfile:
    """A built-in profile on nodes of ``gpus_per_node`` GPUs, each taking its share of the node's host memory."""
    return with_host_memory(replace(profile, gpus_per_node=gpus_per_node), profile.host_bytes_per_node)


def _request(
    settings: SPPOConfig, config: GPTConfig, seq_len: int, world_size: int, gpus_per_node: int, precision: str,
    profile: HardwareProfile, batch: int = 1,
) -> PlanRequest:  # fmt: skip
    if world_size % gpus_per_node:
        gpus_per_node = math.gcd(world_size, gpus_per_node)  # a partial node: plan as smaller nodes
    profile = replace(profile, gpus_per_node=gpus_per_node)
    partition = ("flops", "length") if settings.partition in (None, "adaptive") else (settings.partition,)
    return PlanRequest(
        config=config, seq_len=seq_len, nodes=world_size // gpus_per_node, profile=profile, precision=precision,
        batch_size=batch, sp=settings.sequence_parallel, pp=settings.pipeline_parallel, offload=(settings.offload,),
        fsdp_sync=(settings.fsdp_sync,), partition=partition, granularity=settings.granularity,
        schedule=(settings.schedule,), kv_grad_dtype=settings.kv_grad_dtype, recompute=(settings.recompute,),
        kv_device_tokens=settings.kv_device_tokens, kv_chunk_tokens=settings.kv_chunk_tokens,
        model_state=(settings.model_state,), order=(settings.order,),
    )  # fmt: skip


def _solve(request: PlanRequest, why: str) -> Plan:
    """``solve``, with errors that name the strategy's settings instead of ``sppo-plan``'s flags."""
    try:
        return solve(request)
    except (NoFeasiblePlan, ValueError) as error:
        message = str(error)
        for flag, setting in _SETTING_OF_FLAG.items():
            message = message.replace(flag, setting)
        raise ValueError(
            f"SPPO planner ({why}): {message} Set the sizes and num_subsequences explicitly to run without the"
            " planner, or change the setting named above."
        ) from error


def _predictions(plan: Plan, profile_source: str) -> dict[str, Any]:
    return {
        "predicted_peak_gpu_bytes": plan.peak_gpu_bytes,
        "predicted_step_time_s": plan.step_time_s,
        "predicted_tokens_per_gpu_per_s": plan.tokens_per_gpu_per_s,
        "profile": profile_source,
    }


def _what(request: PlanRequest) -> str:
    name = request.config.name or "the model"
    return (
        f"{name} at {format_tokens(request.seq_len)} tokens x {request.batch_size} on {request.world_size} device(s)"
        f" ({request.precision}, schedule={request.schedule[0]}, {request.kv_grad_dtype} dK/dV)"
    )
