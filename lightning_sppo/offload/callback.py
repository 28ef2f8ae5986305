"""The offload callback: owns the offload policy, hands the strategy its hooks, and reports each step.

Trainer: pass the same object to the strategy and to the Trainer; it logs after every training batch::

    offload = OffloadCallback("adaptive")
    trainer = Trainer(strategy=SPPOStrategy(offload=offload), callbacks=[offload])

Fabric: Fabric's callbacks are plain objects whose methods ``fabric.call`` invokes by name::

    fabric = Fabric(strategy=SPPOStrategy(offload=offload), callbacks=[offload])
    ...
    fabric.call("on_offload_step", fabric=fabric)   # logs offload/* through fabric.log_dict

The stats themselves live in the offloader (``Offloader.last_stats``); this class only passes them on.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_sppo.offload.offloader import Offloader, OffloadStats, build_offloader
from lightning_sppo.offload.policy import OFFLOAD_POLICIES

__all__ = ["OffloadCallback"]


class OffloadCallback(Callback):
    """Offload policy plus per-step reporting, for the Trainer and for Fabric.

    Args:
        offload: ``"none"``, ``"full"`` or ``"adaptive"``.
        prefix: prefix of the logged metric names.
        options: keyword arguments of ``Offloader`` (``min_bytes``, ``costs``, ``measure_steps``, ...).
    """

    def __init__(self, offload: str = "adaptive", *, prefix: str = "offload/", **options: Any) -> None:
        if offload not in OFFLOAD_POLICIES:
            raise ValueError(f"Unknown offload={offload!r}; choose one of {list(OFFLOAD_POLICIES)}.")
        self.offload = offload
        self.prefix = prefix
        self.options = options
        self.offloader: Offloader | None = None
        self.latest: OffloadStats | None = None

    def build(self, device: torch.device | str) -> Offloader | None:
        """The strategy calls this once it knows its device; pass the result to ``SubsequenceEngine(hooks=...)``."""
        if self.offloader is None or self.offloader.device.type != torch.device(device).type:
            if self.offloader is not None:
                self.offloader.release()
            self.offloader = build_offloader(self.offload, device, **self.options)
        return self.offloader

    def on_offload_step(self, stats: OffloadStats | None = None, fabric: Any = None) -> dict[str, float]:
        """Record the latest step's stats (default: the offloader's) and return them as metrics.

        With ``fabric``, also log them through ``fabric.log_dict``.
        """
        stats = stats or (self.offloader.last_stats if self.offloader is not None else None)
        if stats is None:
            return {}
        self.latest = stats
        metrics = stats.as_metrics(self.prefix)
        if fabric is not None:
            fabric.log_dict(metrics, step=stats.step)
        return metrics

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = self.on_offload_step()
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.offloader is not None:
            self.offloader.release()
