"""What a run was, in every logger's hyperparameters: its resolved settings, its layout and the planner's choices.

Logged when training (or ``sppo validate``) starts, once the strategy has fixed the layout; the planner's
choice of subsequences is made at the first batch of a shape, so new choices are logged again after the first
training batch that made them. Each choice carries its predictions (peak GPU bytes, step time, tokens/GPU/s),
to read beside the measured ``perf/*`` and ``memory/*`` metrics.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

__all__ = ["LogRunSettings"]


class LogRunSettings(L.Callback):
    """Logs ``{"config": settings, "layout": {pp, dp, sp, world_size}, "planner": [choices]}`` to every logger.

    Args:
        settings: the run's resolved settings (the ``sppo`` command passes its whole parsed config).
    """

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        self.settings = settings or {}
        self._planner_logged = -1  # how many planner choices the loggers have seen

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log(trainer, with_settings=True)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":  # `sppo validate`: no training start
            self._log(trainer, with_settings=True)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if len(_decisions(trainer)) != self._planner_logged:  # a new batch shape was planned in this step
            self._log(trainer, with_settings=False)

    def _log(self, trainer: L.Trainer, with_settings: bool) -> None:
        decisions = _decisions(trainer)
        self._planner_logged = len(decisions)
        params: dict[str, Any] = {"planner": decisions} if decisions else {}
        if with_settings:
            params |= {"config": self.settings, "layout": _layout(trainer)}
        if params:
            for logger in trainer.loggers:
                logger.log_hyperparams(params)


def _layout(trainer: L.Trainer) -> dict[str, int]:
    dims = getattr(getattr(trainer.strategy, "core", None), "dims", None)
    sizes = {"pp": dims.pp, "dp": dims.dp, "sp": dims.sp} if dims is not None else {"pp": 1, "dp": 1, "sp": 1}
    return sizes | {"world_size": trainer.world_size}


def _decisions(trainer: L.Trainer) -> list[dict[str, Any]]:
    planner = getattr(getattr(trainer.strategy, "core", None), "planner", None)
    return list(getattr(planner, "decisions", []))
