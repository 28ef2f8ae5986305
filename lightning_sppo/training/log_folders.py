"""A run that stops on a settings error before its first step leaves no logger folder behind.

Lightning creates each logger's ``version_N`` folder when the run sets up, before the data module, the model and
the strategy check their settings, and LightningCLI writes ``config.yaml`` into it; a run refused there left one
more ``lightning_logs/version_N`` (or ``csv/version_N``) per attempt, holding nothing that was trained. Here such a
folder is removed once the logger has finished with it (``finalize``, which Lightning calls after the callbacks'
``on_exception``), if all it holds is what a start writes: ``config.yaml``, ``hparams.yaml`` and TensorBoard's
header-only event file. Any other file, a folder of a run that trained a step, or another error (a bug keeps
everything for its report) is left alone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_sppo.errors import error_chain, is_settings_error

__all__ = ["DropUnusedLogFolders", "unused_log_folder"]

_START_FILES = ("config.yaml", "hparams.yaml")
_EVENTS = "events.out.tfevents."
_HEADER_BYTES = 1024  # an event file holding only TensorBoard's header (88 bytes); anything logged is more


class DropUnusedLogFolders(L.Callback):
    """Removes the folders of the run's loggers after a settings error before the first step (see the module)."""

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.global_step > 0 or not trainer.is_global_zero or not _settings_error(exception):
            return
        for logger in trainer.loggers:
            folder = getattr(logger, "log_dir", None)  # CSV and TensorBoard loggers; W&B keeps its own run
            if isinstance(folder, str) and os.path.isdir(folder):
                logger.finalize = _then_drop(logger.finalize, Path(folder), getattr(logger, "root_dir", None))


def _then_drop(finalize: Callable[[str], None], folder: Path, root: str | None) -> Callable[[str], None]:
    def finalize_then_drop(status: str) -> None:
        finalize(status)
        if unused_log_folder(folder):
            shutil.rmtree(folder, ignore_errors=True)
            if root is not None and os.path.isdir(root) and not os.listdir(root):
                os.rmdir(root)  # "lightning_logs" itself, if this run made it and left nothing else there

    return finalize_then_drop


def unused_log_folder(folder: Path) -> bool:
    """Whether ``folder`` holds nothing but what a run's start writes into it."""
    for path in folder.rglob("*"):
        if path.is_dir():
            continue
        if path.name in _START_FILES:
            continue
        if path.name.startswith(_EVENTS) and path.stat().st_size < _HEADER_BYTES:
            continue
        return False
    return True


def _settings_error(error: BaseException) -> bool:
    """A mistake in the settings (what the command reports as one line, exit status 2), or one it caused."""
    return any(is_settings_error(link) or isinstance(link, MisconfigurationException) for link in error_chain(error))
