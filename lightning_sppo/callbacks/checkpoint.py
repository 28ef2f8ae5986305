"""When a run saves, what it keeps, and where ``--ckpt_path last`` resumes from.

``SPPOCheckpoint`` is Lightning's ``ModelCheckpoint`` with the policy long runs need:

* every ``every_n_train_steps`` steps, and once more when fit ends, whatever the step (a run that stops at
  ``max_steps`` keeps its final state, and continuing it with a larger ``max_steps`` resumes mid-epoch exactly);
* the newest ``keep`` checkpoints (by step), the oldest deleted only after the new one is complete, and
  ``last.ckpt`` a link to the newest;
* never a step whose loss is not finite (a diverged run keeps its last good state);
* ``ckpt_path="last"`` resumes from the newest *complete* checkpoint in the folder, even when ``last.ckpt`` is
  missing (a crash between the two renames of a swap);
* the folder is ``default_root_dir/checkpoints`` unless ``dirpath`` says otherwise.

Saves are collective (every rank writes its shards), so every decision here depends only on values that are
the same on every rank: the step and the global loss.
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.strategy.checkpoint import newest_complete_checkpoint

__all__ = ["SPPOCheckpoint"]


class SPPOCheckpoint(ModelCheckpoint):
    """Checkpoints every ``every_n_train_steps`` steps and at the end of fit; keeps the newest ``keep``.

    Args:
        dirpath: the checkpoint folder; default ``default_root_dir/checkpoints``.
        every_n_train_steps: steps between checkpoints; None saves only at the end of fit (and of every
            ``every_n_epochs`` epochs, if set).
        keep: checkpoints kept, the newest by step (``last.ckpt`` links to the newest and does not count).
        every_n_epochs: also save at the end of every n-th epoch; None: not at epoch ends.
        filename: Lightning's checkpoint name pattern; default ``"{epoch}-{step}"``.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        every_n_train_steps: int | None = None,
        keep: int = 2,
        every_n_epochs: int | None = None,
        filename: str | None = None,
    ) -> None:
        if keep < 1:
            raise SPPOConfigError(
                f"SPPOCheckpoint keeps the newest keep >= 1 checkpoints, got keep={keep}; e.g. keep=2."
            )
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor="step",  # the newest `keep` by step
            mode="max",
            save_top_k=keep,
            save_last="link",  # last.ckpt is a link to the newest: no second write of the same state
            every_n_train_steps=every_n_train_steps or 0,
            every_n_epochs=every_n_epochs or 0,
        )
        self._finite = True  # whether the newest step's loss was finite

    def _folder(self, trainer: L.Trainer) -> str:
        return str(self.dirpath) if self.dirpath is not None else os.path.join(trainer.default_root_dir, "checkpoints")

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.dirpath = self._folder(trainer)  # before Lightning would derive it from the first logger's folder
        super().setup(trainer, pl_module, stage)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._finite = _finite_loss(outputs)
        interval = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        if interval or _last_batch_of_fit(trainer):
            self._save(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0:
            self._save(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: saves follow steps, not validation metrics."""

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The final state of a fit stopped otherwise (``should_stop``); skipped when that step is saved."""
        self._save(trainer)

    def _save(self, trainer: L.Trainer) -> None:
        if self._should_skip_saving_checkpoint(trainer):
            return
        if not self._finite:
            rank_zero_warn(
                f"SPPOCheckpoint: step {trainer.global_step} has a non-finite loss; not saved, so the newest"
                f" checkpoint in {self.dirpath} stays the last good state."
            )
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)  # the new one first, then the oldest goes
        self._save_last_checkpoint(trainer, candidates)

    @override
    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        """What ``ckpt_path="last"`` resumes: the newest complete checkpoint in the folder, not only ``last.ckpt``."""
        newest = newest_complete_checkpoint(self._folder(trainer))
        return {os.path.normpath(newest)} if newest is not None else set()


def _last_batch_of_fit(trainer: L.Trainer) -> bool:
    """Whether fit ends after this batch (``max_steps``, or the last batch of the last epoch).

    The final checkpoint is written here rather than in ``on_train_end``: saved after the loops have closed the
    epoch, it would resume into the next epoch (another shuffle) instead of continuing this one.
    """
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
    return last_epoch and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def _finite_loss(outputs: Any) -> bool:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, Tensor):
        return bool(loss.isfinite().all())
    return loss is None or math.isfinite(float(loss))
