"""Per-step training metrics: tokens/s, tokens/GPU/s, MFU, peak memory, bubble ratio, offloaded bytes."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from lightning_sppo.model import GPTConfig
from lightning_sppo.schedule import build_schedule, simulate

__all__ = ["SPPOMetrics", "peak_flops_per_second", "training_flops_per_token"]

# Dense bf16 peaks. H200's datasheet "3958 TFLOPS" (and Lightning's Throughput table) is the sparse figure.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def training_flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 P (matmul weights, embedding lookup excluded) plus causal
    attention 6 L S d (QK^T and AV are 4 S d per token and layer without a mask; causal halves that;
    backward doubles forward). Causal attention is counted once, not as a full square."""
    matmul_params = config.num_matmul_parameters()
    attention = 6 * config.n_layer * seq_len * config.n_head * config.head_size
    return 6 * matmul_params + attention


def peak_flops_per_second(device: torch.device) -> float | None:
    """Dense bf16 peak of a CUDA device, or None where unknown (CPU): MFU is then not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_BF16.items() if key in name), None)


class SPPOMetrics(L.Callback):
    """Logs throughput, MFU, memory and layout numbers each step (and the layout once at the start)."""

    def __init__(self, log_every_n_steps: int = 1) -> None:
        self.log_every_n_steps = log_every_n_steps
        self._start = 0.0
        self._bubble: dict[tuple[int, int, int], float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        core = getattr(trainer.strategy, "core", None)
        if core is None or trainer.logger is None:
            return
        dims = core.dims
        layout = {"pp": dims.pp, "dp": dims.dp, "sp": dims.sp} if dims else {"pp": 1, "dp": 1, "sp": 1}
        trainer.logger.log_hyperparams({"sppo": vars(core.config) | layout, "world_size": trainer.world_size})

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # time whole steps: the queue must be empty at the start
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._start
        if trainer.global_step % self.log_every_n_steps:
            return
        batch_size, seq_len = batch["input_ids"].shape
        core = getattr(trainer.strategy, "core", None)
        dp = core.dims.dp if core is not None and core.dims is not None else trainer.world_size
        tokens_per_s = batch_size * seq_len * dp / elapsed
        metrics = {"perf/tokens_per_s": tokens_per_s, "perf/tokens_per_gpu_per_s": tokens_per_s / trainer.world_size}
        peak = peak_flops_per_second(device)
        config = getattr(pl_module, "config", None)
        if peak is not None and isinstance(config, GPTConfig):
            flops = training_flops_per_token(config, seq_len) * tokens_per_s
            metrics["perf/mfu"] = flops / (peak * trainer.world_size)
        if device.type == "cuda":
            metrics["memory/peak_gpu_bytes"] = float(torch.cuda.max_memory_allocated(device))
        if core is not None:
            metrics |= self._layout_metrics(core)
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, prog_bar=key == "perf/tokens_per_s", rank_zero_only=True)

    def _layout_metrics(self, core: Any) -> dict[str, float]:
        metrics: dict[str, float] = {}
        lengths = core.engine.last_lengths
        dims, config = core.dims, core.config
        pp = dims.pp if dims else 1
        key = (pp, len(lengths), config.num_microbatches)
        if lengths and key not in self._bubble:
            schedule = build_schedule(config.schedule, *key)
            self._bubble[key] = simulate(schedule, {"F": 1.0, "B": 2.0}).bubble_ratio
        if lengths:
            metrics["pipeline/bubble_ratio"] = self._bubble[key]
            metrics["pipeline/num_subsequences"] = float(len(lengths))
        stats = getattr(core.hooks, "last_stats", None)
        if stats is not None:
            metrics["offload/bytes_offloaded"] = float(stats.offloaded_bytes)
        return metrics
