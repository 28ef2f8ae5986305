"""``SPPOMetrics``: what a run's throughput, efficiency and memory are, logged every ``log_every_n_steps`` steps.

=====================================  ============================================================================
name                                   meaning
=====================================  ============================================================================
``perf/tokens_per_s``                  tokens trained per second (all data-parallel replicas), over the last
                                       ``window`` steps; progress bar
``perf/tokens_per_gpu_per_s``          ``perf/tokens_per_s`` / world size
``perf/step_s``                        seconds per step over the same window
``perf/mfu``                           model FLOPs utilisation, causal attention counted as the half of the square
                                       it computes (the planner's convention); progress bar; needs a known peak
``perf/mfu_full_attention``            the same with attention counted as the full square (torchtitan's
                                       convention; 1.95x ``perf/mfu`` for GPT-7B at 1M tokens), ``callbacks.mfu``
``memory/peak_allocated_gib_max``      CUDA: peak allocated memory since the previous log, highest rank; progress
                                       bar. The peaks are reset after each log
``memory/peak_reserved_gib_max``       CUDA: the same for memory reserved by the caching allocator
``offload/host_gib_sum``, ``_max``     host memory (pinned on CUDA) held by the offloaders: all ranks, highest rank
``offload/offloaded_gib_sum``          bytes the last step sent to host memory, all ranks
``pipeline/bubble_ratio``              the schedule's idle share (simulated with backward = 2 forward)
``pipeline/num_subsequences``          N of the last step
``planner/predicted_*``                when the strategy planned: the plan's peak GPU and host memory (GiB, per
                                       GPU, highest stage), step time, tokens/GPU/s and MFU (causal), beside the
                                       measured ones
=====================================  ============================================================================

With packed documents (the batch's ``document_ids``) both MFU figures count attention inside each document only
(``callbacks.mfu.batch_training_flops``), from this replica's batch.

``_max`` / ``_sum`` say how a per-rank value is reduced over the ranks (``callbacks.reduction``): every rank
takes part in that collective, on its own device. Timing costs one host sync per logged step and none on the
others: the steps between two logs are timed together (from the end of one logged step to the end of the next),
and the window is made of those intervals. Validation time is left out.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_sppo.callbacks.mfu import batch_training_flops, peak_flops_per_second, training_flops_per_token
from lightning_sppo.callbacks.reduction import reduce_over_ranks
from lightning_sppo.model import GPTConfig
from lightning_sppo.planner import Plan
from lightning_sppo.schedule import build_schedule, simulate

__all__ = ["PROGRESS_BAR_METRICS", "SPPOMetrics", "ThroughputWindow"]

_GIB = 2**30
_REDUCED = {
    "memory/peak_allocated_gib": ("max",),
    "memory/peak_reserved_gib": ("max",),
    "offload/host_gib": ("sum", "max"),
    "offload/offloaded_gib": ("sum",),
}
"""Per-rank values and the reductions of each that are logged (``<name>_<reduction>``)."""
PROGRESS_BAR_METRICS = ("perf/tokens_per_s", "perf/mfu", "memory/peak_allocated_gib_max")
"""Shown on the progress bar (with the module's ``train/loss``)."""


class ThroughputWindow:
    """Rates over the last ``window`` steps, from intervals of whole steps.

    An interval is what lies between two timed points (several steps when only logged steps are timed), so the
    window holds the newest intervals that cover at least ``window`` steps (all of them until then), and a rate
    is what they did over the time they took: a step time spike moves it by its share of the window only.
    """

    def __init__(self, window: int) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"SPPOMetrics.window must be a positive number of steps, got window={window!r}.")
        self.window = window
        self._intervals: deque[tuple[int, float, dict[str, float]]] = deque()

    def add(self, steps: int, seconds: float, **amounts: float) -> None:
        """One interval: ``steps`` steps in ``seconds``, doing ``amounts`` (e.g. ``tokens=...``)."""
        if steps < 1 or not seconds > 0:
            raise ValueError(f"An interval needs steps >= 1 and seconds > 0, got steps={steps}, seconds={seconds}.")
        self._intervals.append((steps, seconds, amounts))
        while len(self._intervals) > 1 and self.steps - self._intervals[0][0] >= self.window:
            self._intervals.popleft()

    @property
    def steps(self) -> int:
        return sum(steps for steps, _, _ in self._intervals)

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds, _ in self._intervals)

    def rate(self, amount: str) -> float:
        """``amount`` per second over the window (0 before the first interval)."""
        seconds = self.seconds
        return sum(amounts.get(amount, 0.0) for _, _, amounts in self._intervals) / seconds if seconds else 0.0

    @property
    def step_s(self) -> float:
        """Mean seconds per step over the window (0 before the first interval)."""
        steps = self.steps
        return self.seconds / steps if steps else 0.0


class SPPOMetrics(L.Callback):
    """Throughput, MFU, memory, offload and layout metrics for the Trainer (the table in this module's docstring).

    Args:
        log_every_n_steps: steps between logs; ``None`` takes the Trainer's ``log_every_n_steps``.
        window: steps the rates average over (whole logging intervals; see ``ThroughputWindow``).
        peak_flops: dense peak FLOP/s of one device for MFU; ``None`` looks the CUDA device up
            (``callbacks.mfu.peak_flops_per_second``), and on other devices MFU is not logged.
        clock: seconds, monotonic (``time.perf_counter``); tests pass a fake one.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        window: int = 20,
        peak_flops: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 0):
            raise ValueError(
                f"SPPOMetrics.log_every_n_steps must be None (the Trainer's) or an integer >= 0, got"
                f" log_every_n_steps={log_every_n_steps!r}."
            )
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"SPPOMetrics.peak_flops must be positive FLOP/s or None, got peak_flops={peak_flops!r}.")
        self.log_every_n_steps = log_every_n_steps
        self.peak_flops = peak_flops
        self.clock = clock
        self.throughput = ThroughputWindow(window)
        self._bubble: dict[tuple[str, int, int, int], float] = {}
        self._flops_per_token: dict[tuple[int, str], float] = {}
        self._logged_step = -1
        self._reset_interval(None)

    def _reset_interval(self, start: float | None) -> None:
        self._start, self._paused = start, 0.0
        self._steps, self._tokens, self._flops, self._flops_full = 0, 0, 0.0, 0.0
        self._pause_start: float | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        core = getattr(trainer.strategy, "core", None)
        if core is not None and trainer.logger is not None:
            dims = core.dims
            layout = {"pp": dims.pp, "dp": dims.dp, "sp": dims.sp} if dims else {"pp": 1, "dp": 1, "sp": 1}
            trainer.logger.log_hyperparams({"sppo": vars(core.config) | layout, "world_size": trainer.world_size})
        self._reset_interval(None)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self._start is None:  # the first batch of this fit: wait once for what setup queued on the device
            self._reset_interval(self._now(trainer.strategy.root_device))

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self._count(trainer, pl_module, batch)
        every = trainer.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        step = trainer.global_step  # the same on every rank: all of them reach the collective below, or none
        if not every or step % every or step == self._logged_step:  # (accumulating batches repeat a step)
            return
        self._logged_step = step
        device = trainer.strategy.root_device
        reduced = reduce_over_ranks(self._rank_values(trainer), device)  # every rank, same names: a collective
        end = self._now(device, synchronized=bool(reduced))  # reading ``reduced`` already waited for the device
        self.throughput.add(
            self._steps, end - self._start - self._paused, tokens=self._tokens, flops=self._flops,
            flops_full_attention=self._flops_full,
        )  # fmt: skip
        self._reset_interval(end)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the next log reports the next interval's peak
        metrics = self._perf_metrics(trainer) | self._reduced_metrics(reduced) | self._layout_metrics(trainer)
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, prog_bar=key in PROGRESS_BAR_METRICS, rank_zero_only=True)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is not None:  # validation inside fit: its time is not training time
            self._pause_start = self._now(trainer.strategy.root_device)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pause_start is not None:
            self._paused += self._now(trainer.strategy.root_device) - self._pause_start
            self._pause_start = None

    # -- per step: host-side counts only, no device sync ------------------------------------------

    def _count(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any) -> None:
        batch_size, seq_len = batch["input_ids"].shape
        tokens = batch_size * seq_len * _data_parallel(trainer)
        self._steps += 1
        self._tokens += tokens
        config = getattr(pl_module, "config", None)
        documents = batch.get("document_ids") if isinstance(batch, dict) else None
        if isinstance(config, GPTConfig) and documents is not None:
            # Packed documents: attention inside each one only. This replica's batch stands for every replica's
            # (an estimate for dp > 1, without a collective per step).
            dp = _data_parallel(trainer)
            self._flops += dp * batch_training_flops(config, batch["input_ids"], documents, "causal")
            self._flops_full += dp * batch_training_flops(config, batch["input_ids"], documents, "full")
        elif isinstance(config, GPTConfig):
            self._flops += tokens * self._per_token(config, seq_len, "causal")
            self._flops_full += tokens * self._per_token(config, seq_len, "full")

    def _per_token(self, config: GPTConfig, seq_len: int, attention: str) -> float:
        key = (seq_len, attention)
        if key not in self._flops_per_token:
            self._flops_per_token[key] = training_flops_per_token(config, seq_len, attention)
        return self._flops_per_token[key]

    def _now(self, device: torch.device, synchronized: bool = False) -> float:
        """The clock once the device has done what is queued (one host sync on CUDA, unless already done)."""
        if device.type == "cuda" and not synchronized:
            torch.cuda.synchronize(device)
        return self.clock()

    # -- on logged steps --------------------------------------------------------------------------

    def _rank_values(self, trainer: L.Trainer) -> dict[str, float]:
        """This rank's values to reduce; the names depend only on the run's settings, so they agree on all ranks."""
        values: dict[str, float] = {}
        device = trainer.strategy.root_device
        if device.type == "cuda":
            values["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
            values["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / _GIB
        offloader = getattr(getattr(trainer.strategy, "core", None), "hooks", None)
        pool = getattr(offloader, "pool", None)
        if pool is not None:  # an Offloader (offload != "none")
            values["offload/host_gib"] = pool.capacity_bytes / _GIB
            values["offload/offloaded_gib"] = offloader.last_offloaded_bytes / _GIB
        return values

    def _perf_metrics(self, trainer: L.Trainer) -> dict[str, float]:
        window, world = self.throughput, trainer.world_size
        tokens_per_s = window.rate("tokens")
        metrics = {
            "perf/tokens_per_s": tokens_per_s,
            "perf/tokens_per_gpu_per_s": tokens_per_s / world,
            "perf/step_s": window.step_s,
        }
        peak = self.peak_flops or peak_flops_per_second(trainer.strategy.root_device)
        if peak is not None and window.rate("flops") > 0:
            metrics["perf/mfu"] = window.rate("flops") / (peak * world)
            metrics["perf/mfu_full_attention"] = window.rate("flops_full_attention") / (peak * world)
        return metrics

    @staticmethod
    def _reduced_metrics(reduced: dict[str, float]) -> dict[str, float]:
        return {
            f"{name}_{reduction}": reduced[f"{name}_{reduction}"]
            for name, reductions in _REDUCED.items()
            for reduction in reductions
            if f"{name}_{reduction}" in reduced
        }

    def _layout_metrics(self, trainer: L.Trainer) -> dict[str, float]:
        core = getattr(trainer.strategy, "core", None)
        if core is None:
            return {}
        metrics: dict[str, float] = {}
        lengths = core.last_plan.lengths if core.last_plan is not None else ()
        if lengths:
            config = core.config
            key = (config.schedule, core.dims.pp if core.dims else 1, len(lengths), config.num_microbatches)
            if key not in self._bubble:
                self._bubble[key] = simulate(build_schedule(*key), {"F": 1.0, "B": 2.0}).bubble_ratio
            metrics["pipeline/bubble_ratio"] = self._bubble[key]
            metrics["pipeline/num_subsequences"] = float(len(lengths))
        plan = getattr(core.planner, "last_plan", None)
        if isinstance(plan, Plan):
            metrics |= {
                "planner/predicted_peak_gpu_gib": plan.peak_gpu_bytes / _GIB,
                "planner/predicted_peak_host_gib": plan.peak_host_bytes / _GIB,
                "planner/predicted_step_s": plan.step_time_s,
                "planner/predicted_tokens_per_gpu_per_s": plan.tokens_per_gpu_per_s,
                "planner/predicted_mfu": plan.mfu,
            }
        return metrics


def _data_parallel(trainer: L.Trainer) -> int:
    """Replicas that each train their own batch: the strategy's dp, or every process for other strategies."""
    dims = getattr(getattr(trainer.strategy, "core", None), "dims", None)
    return dims.dp if dims is not None else trainer.world_size
