"""The offload callback: owns the offload policy, hands the strategy its hooks, and reports each step.

Trainer: pass the same object to the strategy and to the Trainer; it logs on the Trainer's logging steps, reduced
over the ranks (``offload/offloaded_bytes_sum``, ``..._max``)::

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

from lightning_sppo.callbacks.reduction import reduce_over_ranks
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
        """On the steps the Trainer logs: every rank's stats reduced over the ranks (``<name>_max``, ``<name>_sum``:
        pipeline stages offload different amounts). Other steps read nothing: reading the stats waits for the
        step's copies, a host sync (review finding P6)."""
        if self.offloader is None or trainer.global_step % max(1, trainer.log_every_n_steps):
            return
        stats = self.offloader.last_stats
        if stats is not None:
            self.latest = stats
        # Every rank joins the reduction with the same names, even one whose offloader has no step yet.
        names = OffloadStats.metric_names(self.prefix, self.offloader.device.type == "cuda")
        mine = stats.as_metrics(self.prefix) if stats is not None else {}
        values = {name: mine.get(name, 0.0) for name in names}
        pl_module.log_dict(reduce_over_ranks(values, self.offloader.device), on_step=True, on_epoch=False)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.offloader is not None:
            self.offloader.release()
