"""When a run saves, what it keeps, and where ``--ckpt_path last`` resumes from.

``SPPOCheckpoint`` is Lightning's ``ModelCheckpoint`` with the policy long runs need:

* every ``every_n_train_steps`` steps, and once more when fit ends, whatever the step (a run that stops at
  ``max_steps`` keeps its final state, and continuing it with a larger ``max_steps`` resumes mid-epoch exactly);
* the newest ``keep`` complete checkpoints of the folder (by the time each became complete), counted after every
  save from what is on disk, so the count holds after a resume and after a kill between two steps of a save;
  the oldest are deleted only after the new one is complete, and so are checkpoints cut short (a full disk, a
  partial copy), with a warning naming them;
* ``last.ckpt`` a link to the newest complete checkpoint, checked before it is linked and replaced atomically
  (a kill leaves the old link or the new), and relinked at the start of training if it names a checkpoint
  that is not complete;
* never a step whose loss is not finite (a diverged run keeps its last good state);
* ``ckpt_path="last"`` resumes from the newest *complete* checkpoint in the folder, even when ``last.ckpt`` is
  missing or names a damaged file (newer damaged files are named in a warning);
* a fresh run (no ``ckpt_path``) refuses a folder that holds checkpoints of an earlier run: resume it, or
  start in another folder (mixing two runs would leave ``keep`` and ``last.ckpt`` to pick between them);
* the folder is ``default_root_dir/checkpoints`` unless ``dirpath`` says otherwise.

Saves are collective (every rank writes its shards), so every decision here depends only on values that are
the same on every rank (the step and the global loss); what depends on the folder's contents is decided on
global rank 0 and broadcast.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.strategy.checkpoint_files import (
    checkpoints_in,
    is_complete,
    link_last,
    newest_complete_checkpoint,
    recover_folder,
    remove_path,
)

__all__ = ["SPPOCheckpoint", "earlier_run_error", "newer_incomplete"]


class SPPOCheckpoint(ModelCheckpoint):
    """Checkpoints every ``every_n_train_steps`` steps and at the end of fit; keeps the newest ``keep``.

    Args:
        dirpath: the checkpoint folder; default ``default_root_dir/checkpoints``.
        every_n_train_steps: steps between checkpoints; None saves only at the end of fit (and of every
            ``every_n_epochs`` epochs, if set).
        keep: checkpoints kept, the newest complete ones in the folder (``last.ckpt`` links to the newest and does
            not count).
        every_n_epochs: also save at the end of every n-th epoch; None: not at epoch ends.
        filename: Lightning's checkpoint name pattern; default ``"{epoch}-{step}"``. A checkpoint whose name is
            already taken (the same step after a resume from an earlier one) replaces the old one.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        every_n_train_steps: int | None = None,
        keep: int = 2,
        every_n_epochs: int | None = None,
        filename: str | None = None,
    ) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise SPPOConfigError(
                f"SPPOCheckpoint keeps the newest keep >= 1 checkpoints, got keep={keep}; e.g. keep=2."
            )
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor="step",  # the newest by step, for Lightning's bookkeeping (best_model_path)
            mode="max",
            save_top_k=keep,
            save_last="link",
            every_n_train_steps=every_n_train_steps or 0,
            every_n_epochs=every_n_epochs or 0,
        )
        self.keep = keep
        self._finite = True  # whether the newest step's loss was finite

    def _folder(self, trainer: L.Trainer) -> str:
        return str(self.dirpath) if self.dirpath is not None else os.path.join(trainer.default_root_dir, "checkpoints")

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """The folder, the same on every rank (before Lightning would derive it from the first logger's folder).
        Lightning's "exists and is not empty" warning is not needed: ``on_train_start`` decides about a used
        folder."""
        self.dirpath = trainer.strategy.broadcast(self._folder(trainer))
        self._fs = get_filesystem(self.dirpath)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After any restore: a fresh run stops if the folder holds an earlier run's checkpoints; a resumed one
        relinks ``last.ckpt`` when it names a checkpoint that is not complete."""
        super().on_train_start(trainer, pl_module)
        problem = None
        if trainer.is_global_zero:
            if trainer.ckpt_path is None:
                problem = earlier_run_error(self.dirpath, "ckpt_path")
            else:
                self._relink(Path(self.dirpath))
        problem = trainer.strategy.broadcast(problem)
        if problem is not None:
            raise SPPOConfigError(problem)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._finite = _finite_loss(outputs)
        interval = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        if interval or (self._epoch_due(trainer) and _last_batch_of_epoch(trainer)) or _last_batch_of_fit(trainer):
            self._save(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Only if the epoch's last batch was not recognised as such (then skipped: that step is saved already).

        The epoch's checkpoint is written after its last batch, as the final one (``_last_batch_of_fit``): written
        here, after the loops closed the epoch, it resumed with one batch too many and the next epoch's order shifted.
        """
        if self._epoch_due(trainer):
            self._save(trainer)

    def _epoch_due(self, trainer: L.Trainer) -> bool:
        return self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: saves follow steps, not validation metrics."""

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The final state of a fit stopped after its last batch's hooks (e.g. ``EarlyStopping`` on a validation);
        skipped when that step is saved. By now the loops have closed the epoch; the checkpoint records the state
        after the last batch instead (``_as_after_the_last_batch``), so that its resume continues this epoch."""
        self._closing = _closed_epoch(trainer)
        try:
            self._save(trainer)
        finally:
            self._closing = False

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if getattr(self, "_closing", False):
            _as_after_the_last_batch(checkpoint)

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
        if getattr(self, "_closing", False):  # the epoch of the last batch, not the one the loops moved on to
            candidates["epoch"] = candidates["epoch"] - 1
        filepath = self.format_checkpoint_name(candidates)  # a name already taken is replaced, atomically
        self._save_checkpoint(trainer, filepath)  # every rank; returns once the checkpoint is in place
        if trainer.is_global_zero:
            self._relink(Path(self.dirpath))
            self._prune(Path(self.dirpath), keep_also=Path(filepath))
        trainer.strategy.barrier("SPPOCheckpoint")
        # Lightning's bookkeeping (``ckpt_path="best"``, its state in checkpoints): the newest is the best by step.
        self.best_model_path, self.best_model_score = filepath, candidates["step"]
        self.best_k_models = {filepath: candidates["step"]}
        self.last_model_path = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)

    def _relink(self, folder: Path) -> None:
        """``last.ckpt`` -> the newest complete checkpoint (checked: ``is_complete``), if it does not already."""
        link = folder / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        complete, _ = checkpoints_in(folder, self.FILE_EXTENSION)
        if not complete:
            return
        newest = complete[-1]
        if not (link.is_symlink() and os.path.realpath(link) == os.path.realpath(newest) and is_complete(link)):
            self._link_last(newest, link)

    def _link_last(self, target: Path, link: Path) -> None:
        link_last(target, link)

    def _prune(self, folder: Path, keep_also: Path) -> None:
        """Delete all but the newest ``keep`` complete checkpoints, and those cut short (named in a warning; a file of
        another kind is left alone). Swaps that a kill interrupted are finished first, so what they hold counts."""
        recover_folder(folder)
        complete, incomplete = checkpoints_in(folder, self.FILE_EXTENSION)
        for path in complete[: -self.keep]:
            if path != keep_also:
                remove_path(path)
        for path in filter(_cut_short, incomplete):
            rank_zero_warn(
                f"SPPOCheckpoint: removed {path}, a checkpoint that is not complete (cut short by a full disk, a kill"
                " outside a save, or a partial copy); the newest complete ones are kept."
            )
            remove_path(path)

    @override
    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        """What ``ckpt_path="last"`` resumes: the newest complete checkpoint in the folder, not only ``last.ckpt``;
        newer checkpoints that are not complete are named in a warning."""
        folder = self._folder(trainer)
        newest = newest_complete_checkpoint(folder)
        if newest is None:
            return set()
        for damaged in newer_incomplete(folder, newest, self.FILE_EXTENSION):
            rank_zero_warn(
                f"SPPOCheckpoint: {damaged} is newer but not a complete checkpoint (cut short: a full disk or a partial"
                f" copy?); resuming from {newest.name}, the newest complete one. {damaged.name} is removed at the"
                " next save: copy it elsewhere first to keep it."
            )
        return {os.path.normpath(newest)}


def _cut_short(path: Path) -> bool:
    """Whether ``path`` is what a checkpoint of ours becomes when cut short (a zip file without its directory, a
    folder of shards without ``meta.pt``), rather than a file of another kind that happens to share the folder."""
    if path.is_dir():
        return any(path.glob("*.distcp"))
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def newer_incomplete(folder: str | os.PathLike, newest: Path, suffix: str = ".ckpt") -> list[Path]:
    """The checkpoints of ``folder`` that are cut short and were written after ``newest`` (a complete one): files of
    another kind that share the folder are not named (the next save leaves them alone)."""
    _, incomplete = checkpoints_in(folder, suffix)
    since = os.stat(newest / "meta.pt" if newest.is_dir() else newest).st_mtime_ns
    return [p for p in incomplete if p.stat().st_mtime_ns >= since and _cut_short(p)]


def earlier_run_error(folder: str | os.PathLike | None, resume: str) -> str | None:
    """Why a fresh run must not write into ``folder``: it holds complete checkpoints of an earlier run (the
    message names ``resume``, the caller's way to continue it: ``--ckpt_path`` or ``ckpt_path``); else None."""
    if folder is None:
        return None
    complete, _ = checkpoints_in(folder)
    if not complete:
        return None
    resume_last = "--ckpt_path last" if resume.startswith("--") else 'ckpt_path="last"'
    return (
        f"The checkpoint folder {folder} holds checkpoints of an earlier run (the newest: {complete[-1].name});"
        f" continue that run with {resume_last}, or start afresh in another folder (trainer.default_root_dir, or"
        " the checkpoint callback's dirpath) or after deleting this one."
    )


def _last_batch_of_fit(trainer: L.Trainer) -> bool:
    """Whether fit ends after this batch (``max_steps``, or the last batch of the last epoch).

    The final checkpoint is written here rather than in ``on_train_end``: saved after the loops have closed the
    epoch, it would resume into the next epoch (another shuffle) instead of continuing this one.
    """
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    if trainer.should_stop:  # asked during this batch (max_time, a callback or the module): fit ends after it
        return True
    last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
    return last_epoch and _last_batch_of_epoch(trainer)


def _closed_epoch(trainer: L.Trainer) -> bool:
    """Whether the fit loop has closed the epoch of the last batch (counted it processed and completed, and moved
    ``current_epoch`` on): what a stop after the last batch's hooks leaves at ``on_train_end``."""
    epochs = trainer.fit_loop.epoch_progress.current
    batches = trainer.fit_loop.epoch_loop.batch_progress.current
    closed = epochs.ready == epochs.processed == epochs.completed == trainer.current_epoch
    return closed and epochs.completed >= 1 and batches.completed >= 1


def _as_after_the_last_batch(checkpoint: dict[str, Any]) -> None:
    """A checkpoint written at ``on_train_end`` (``_closed_epoch``) rewritten to the state a save after the last
    batch records (``on_train_batch_end``): the epoch not yet processed nor completed, the last batch not yet
    counted completed. Lightning resumes the epoch from that state (the loader's position in it is saved alike);
    from the closed one it started the next epoch with the old batch counts, so the data order and epoch were off."""
    checkpoint["epoch"] = checkpoint.get("epoch", 1) - 1
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    for scope in ("total", "current"):
        epochs = fit.get("epoch_progress", {}).get(scope, {})
        for field in ("processed", "completed"):
            if field in epochs:
                epochs[field] -= 1
        batches = fit.get("epoch_loop.batch_progress", {}).get(scope, {})
        if "completed" in batches:
            batches["completed"] -= 1
    state = fit.get("epoch_loop.state_dict", {})
    if "_batches_that_stepped" in state:
        state["_batches_that_stepped"] -= 1


def _last_batch_of_epoch(trainer: L.Trainer) -> bool:
    """Whether the epoch ends after this batch (the loader is exhausted, or ``limit_train_batches`` is reached)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.is_last_batch) or progress.current.ready == trainer.num_training_batches


def _finite_loss(outputs: Any) -> bool:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, Tensor):
        return bool(loss.isfinite().all())
    return loss is None or math.isfinite(float(loss))
