"""Faults injected into real runs by the CLI tests (named in their YAML as callbacks, or wrapping the recipe)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import lightning as L

from lightning_sppo.errors import SPPOConfigError


class KillAt(L.Callback):
    """SIGKILLs every rank when step ``step`` starts: a crash with no chance to clean up."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAt(L.Callback):
    """Sends ``signal`` when step ``step`` starts, from the listed ``ranks`` (default: every rank) to themselves, or
    with ``group`` to the whole process group, as a terminal's Ctrl-C does (every rank, wherever it is in its step);
    ``repeat`` times in a row (a second Ctrl-C)."""

    def __init__(
        self, step: int, signal: str = "SIGTERM", ranks: list[int] | None = None, group: bool = False, repeat: int = 1
    ) -> None:
        self.step, self.signal, self.ranks, self.group, self.repeat = step, signal, ranks, group, repeat

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step != self.step or (self.ranks is not None and trainer.global_rank not in self.ranks):
            return
        for _ in range(self.repeat):
            if self.group:
                os.killpg(os.getpgid(0), getattr(signal, self.signal))
            else:
                os.kill(os.getpid(), getattr(signal, self.signal))


class RaiseOnRank(L.Callback):
    """Raises a configuration error on rank ``rank`` only, when step ``step`` starts."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise SPPOConfigError(f"test.fault=rank{self.rank} must not be set (raised on rank {self.rank} only)")


def run_recipe_killed_at(step: int) -> None:
    """``SPPO_TEST_KILL_AT=STEP python faults.py recipe-args...``: recipes/pretrain_fabric.py, SIGKILLing every
    rank once ``step`` steps are done. Fabric's launcher starts the other ranks with this same command and
    environment, so they are killed at the same step."""
    pretrain_fabric = _recipe()
    log_step = pretrain_fabric._Logger.step

    def step_then_kill(self, index: int, *args) -> None:
        log_step(self, index, *args)
        if index + 1 == step:
            os.kill(os.getpid(), signal.SIGKILL)

    pretrain_fabric._Logger.step = step_then_kill
    pretrain_fabric.CLI(pretrain_fabric.setup, as_positional=False)


def run_recipe_signalled_at(step: int, signame: str, rank: int) -> None:
    """``SPPO_TEST_SIGNAL_AT=STEP:SIGNAL:RANK python faults.py recipe-args...``: the recipe as its command runs it,
    sending SIGNAL to rank RANK only once ``step`` steps are done (after that step's agreement to stop or not)."""
    pretrain_fabric = _recipe()
    log_step = pretrain_fabric._Logger.step

    def step_then_signal(self, index: int, *args) -> None:
        log_step(self, index, *args)
        if index + 1 == step and self.fabric.global_rank == rank:
            os.kill(os.getpid(), getattr(signal, signame))

    pretrain_fabric._Logger.step = step_then_signal
    pretrain_fabric.run()


def _recipe():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    import pretrain_fabric

    return pretrain_fabric


if __name__ == "__main__":
    if "SPPO_TEST_SIGNAL_AT" in os.environ:
        at, signame, rank = os.environ["SPPO_TEST_SIGNAL_AT"].split(":")
        run_recipe_signalled_at(int(at), signame, int(rank))
    else:
        run_recipe_killed_at(int(os.environ["SPPO_TEST_KILL_AT"]))


class SettingsErrorWhenBuilt(L.Callback):
    """A settings error raised when the command builds its classes, before any process group exists; rank 0 (by
    ``RANK``) raises it ``rank_zero_delay_s`` later than the others, so another rank exits first (as when one
    node reads the config faster), the case where torchrun stopped rank 0 before it printed."""

    def __init__(self, rank_zero_delay_s: float = 0.0) -> None:
        if os.environ.get("RANK", "0") == "0":
            time.sleep(rank_zero_delay_s)
        raise SPPOConfigError(f"test.setting=bad must not be set (raised by rank {os.environ.get('RANK', '0')})")
