"""SPPOCheckpoint and the run's settings in the loggers, with Trainer(strategy="sppo") on one CPU device in process."""

from __future__ import annotations

import logging
import os
import re
from functools import partial

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.core.saving import load_hparams_from_yaml
from lightning.pytorch.loggers import CSVLogger

from lightning_sppo import SPPOTrainerStrategy
from lightning_sppo.callbacks import SPPOCheckpoint
from lightning_sppo.data import TokenDataModule
from lightning_sppo.errors import NonFiniteError
from lightning_sppo.training import GPTPretraining
from lightning_sppo.training.optim import warmup_cosine
from lightning_sppo.training.run_settings import LogRunSettings
from tests.training.conftest import Losses


def _fit(root, data, max_steps: int, ckpt_path=None, every: int = 10, callbacks=(), **module) -> Trainer:
    seed_everything(1337)  # the same initial weights in every run
    trainer = Trainer(
        strategy=SPPOTrainerStrategy(num_subsequences=2), accelerator="cpu", devices=1, max_steps=max_steps,
        default_root_dir=root, logger=False, callbacks=[SPPOCheckpoint(every_n_train_steps=every), *callbacks],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    settings = {"learning_rate": 3e-3, "warmup_steps": 2, "max_steps": 10, "weight_decay": 0.0} | module
    trainer.fit(GPTPretraining(model="tiny", **settings), TokenDataModule(data, 32, 2), ckpt_path=ckpt_path)
    return trainer


def _steps(folder) -> list[int]:
    return sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in folder.glob("epoch=*"))


def test_the_final_state_is_saved_and_a_longer_run_continues_it_exactly(tmp_path, data):
    """max_steps=5 with checkpoints every 10 steps still leaves step 5; continuing it to 10 steps with
    ckpt_path="last" gives the losses of a run that went to 10 at once (the same epoch, the same batches)."""
    reference = Losses()
    _fit(tmp_path / "once", data, 10, callbacks=[reference])
    _fit(tmp_path / "twice", data, 5)
    folder = tmp_path / "twice/checkpoints"
    assert _steps(folder) == [5] and os.readlink(folder / "last.ckpt") == "epoch=0-step=5.ckpt"
    continued = Losses()
    _fit(tmp_path / "twice", data, 10, ckpt_path="last", callbacks=[continued])
    assert sorted(continued.losses) == list(range(5, 10))
    assert all(continued.losses[s] == reference.losses[s] for s in continued.losses), (
        continued.losses,
        reference.losses,
    )


DIVERGE = {"learning_rate": 1e10, "warmup_steps": 100, "max_grad_norm": 0.0}  # NaN after a few finite steps


def test_nonfinite_steps_are_never_saved_so_the_last_good_ones_stay(tmp_path, data):
    losses = Losses()
    with pytest.warns(UserWarning, match="non-finite loss; not saved"):
        _fit(tmp_path, data, 10, every=1, callbacks=[losses], stop_on_nonfinite=False, **DIVERGE)
    finite = [s + 1 for s, loss in sorted(losses.losses.items()) if torch.isfinite(torch.tensor(loss))]
    assert 2 <= len(finite) < 10 and finite == list(range(1, len(finite) + 1)), losses.losses  # then NaN for good
    assert _steps(tmp_path / "checkpoints") == finite[-2:]  # the NaN steps rotated nothing out


def test_stop_on_nonfinite_raises_before_the_step_is_applied(tmp_path, data):
    with pytest.raises(NonFiniteError, match=r"Training diverged at step (\d+): train/loss=nan") as error:
        _fit(tmp_path, data, 10, every=1, **DIVERGE)
    diverged = int(re.search(r"step (\d+)", str(error.value)).group(1))
    assert _steps(tmp_path / "checkpoints") == [diverged - 1, diverged]
    checkpoint = torch.load(tmp_path / f"checkpoints/epoch=0-step={diverged}.ckpt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in checkpoint["state_dict"].values())


def test_settings_layout_and_planner_choices_reach_the_loggers(tmp_path, data):
    """With num_subsequences="auto" the planner chooses N at the first batch; its prediction is logged."""
    trainer = Trainer(
        strategy=SPPOTrainerStrategy(), accelerator="cpu", devices=1, max_steps=2, logger=CSVLogger(tmp_path),
        callbacks=[LogRunSettings({"data": {"seq_len": 32}})], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(GPTPretraining(model="tiny", max_steps=2), TokenDataModule(data, 32, 2))
    hparams = load_hparams_from_yaml(next(tmp_path.glob("lightning_logs/version_*/hparams.yaml")))
    assert hparams["config"] == {"data": {"seq_len": 32}}
    assert hparams["layout"] == {"pp": 1, "dp": 1, "sp": 1, "world_size": 1}
    [choice] = hparams["planner"]
    assert choice["for"] == "seq_len=32 batch=2" and choice["num_subsequences"] >= 1
    assert choice["predicted_peak_gpu_bytes"] > 0 and choice["predicted_step_time_s"] > 0


class _Rates(Callback):
    """Each step's learning rate and weight decay as the optimizer applies them (before its step)."""

    def __init__(self) -> None:
        self.rates: dict[int, tuple[float, float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        group = trainer.optimizers[0].param_groups[0]
        self.rates[trainer.global_step] = (group["lr"], group["weight_decay"])


def test_a_resume_with_a_lower_learning_rate_trains_at_it(tmp_path, data, caplog):
    """What NonFiniteError advises (lower model.learning_rate, resume with ckpt_path="last") used to train on at the
    checkpoint's rate: Lightning restores the optimizer's and the schedule's values. Now the schedule of the new
    settings applies from the resumed step, and a line names what changed. Unchanged settings resume exactly (the
    test above, and here the negative control: the same rates as the uninterrupted run)."""
    same, lower = _Rates(), _Rates()
    _fit(tmp_path / "a", data, 4, weight_decay=0.1)
    _fit(tmp_path / "a", data, 8, ckpt_path="last", callbacks=[same], weight_decay=0.1)
    reference = _Rates()
    _fit(tmp_path / "b", data, 8, callbacks=[reference], weight_decay=0.1)
    assert same.rates == {s: reference.rates[s] for s in range(4, 8)}, (same.rates, reference.rates)
    _fit(tmp_path / "c", data, 4, weight_decay=0.1)
    with caplog.at_level(logging.INFO):
        _fit(tmp_path / "c", data, 8, ckpt_path="last", callbacks=[lower], learning_rate=1e-3, weight_decay=0.0)
    factor = partial(warmup_cosine, warmup_steps=2, max_steps=10, learning_rate=1e-3, min_learning_rate=3e-5)
    assert lower.rates == {s: (pytest.approx(1e-3 * factor(s)), 0.0) for s in range(4, 8)}, lower.rates
    assert "model.learning_rate=0.001 (was 0.003), model.weight_decay=0.0 (was 0.1)" in caplog.text


def _fit_epochs(root, data, ckpt_path=None, callbacks=(), saver=None, module=GPTPretraining) -> None:
    """3 batches per epoch, 7 steps; SPPOCheckpoint(every_n_epochs=1) unless ``saver`` says otherwise."""
    seed_everything(1337)
    saver = saver or SPPOCheckpoint(every_n_epochs=1, keep=3)
    trainer = Trainer(
        strategy=SPPOTrainerStrategy(num_subsequences=2), accelerator="cpu", devices=1, max_steps=7, max_epochs=-1,
        default_root_dir=root, logger=False, callbacks=[saver, *callbacks],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = module(model="tiny", learning_rate=3e-3, warmup_steps=2, max_steps=7, weight_decay=0.0)
    trainer.fit(module, TokenDataModule(data, 256, 8), ckpt_path=ckpt_path)


def test_an_epoch_end_checkpoint_resumes_into_the_next_epoch_exactly(tmp_path, data):
    """every_n_epochs saved after the loops had closed the epoch: its resume trained one batch too many in the old
    epoch (the next epoch's first) and the next epoch's order shifted by one. Now it is written after the epoch's last
    batch, and the resume from it gives the uninterrupted run's losses, the epoch's checkpoint names its epoch."""
    reference = Losses()
    _fit_epochs(tmp_path, data, callbacks=[reference])
    folder = tmp_path / "checkpoints"
    assert _steps(folder) == [3, 6, 7] and (folder / "epoch=0-step=3.ckpt").is_file(), sorted(folder.iterdir())
    resumed = Losses()
    _fit_epochs(tmp_path / "resumed", data, ckpt_path=folder / "epoch=0-step=3.ckpt", callbacks=[resumed])
    assert sorted(resumed.losses) == list(range(3, 7)), resumed.losses
    assert all(resumed.losses[s] == reference.losses[s] for s in resumed.losses), (resumed.losses, reference.losses)


class _StopsAt(GPTPretraining):
    """Asks the trainer to stop after the batch that reaches step ``STOP``, in its own hook: after every callback's
    (as EarlyStopping deciding on a validation run after the batch), so the end-of-fit save is the one that counts."""

    STOP = 4

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step == self.STOP:
            self.trainer.should_stop = True


class _Stop(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == _StopsAt.STOP:
            trainer.should_stop = True


@pytest.mark.parametrize(("who", "stop"), [("module", 4), ("module", 6), ("callback", 4)])
def test_a_fit_stopped_early_resumes_from_its_final_checkpoint_exactly(tmp_path, data, monkeypatch, who, stop):
    """A fit stopped by should_stop (max_time, EarlyStopping, a callback) mid-epoch (step 4) or at an epoch's end
    (step 6): its final checkpoint was written after the loops had closed the epoch, so the resume started the next
    epoch (the file named it: epoch=2-step=4) and the data order was lost. Now it resumes the uninterrupted run."""
    monkeypatch.setattr(_StopsAt, "STOP", stop)
    reference = Losses()
    _fit_epochs(tmp_path / "reference", data, callbacks=[reference], saver=SPPOCheckpoint())
    stopped = Losses()
    module, callbacks = (_StopsAt, [stopped]) if who == "module" else (GPTPretraining, [stopped, _Stop()])
    _fit_epochs(tmp_path, data, callbacks=callbacks, saver=SPPOCheckpoint(), module=module)
    assert sorted(stopped.losses) == list(range(stop)), stopped.losses
    assert _steps(tmp_path / "checkpoints") == [stop]
    epoch = (stop - 1) // 3  # 3 batches per epoch
    assert (tmp_path / f"checkpoints/epoch={epoch}-step={stop}.ckpt").is_file(), sorted(tmp_path.iterdir())
    resumed = Losses()
    _fit_epochs(tmp_path, data, ckpt_path="last", callbacks=[resumed], saver=SPPOCheckpoint())
    assert sorted(resumed.losses) == list(range(stop, 7)), resumed.losses
    assert all(resumed.losses[s] == reference.losses[s] for s in resumed.losses), (resumed.losses, reference.losses)


def test_a_path_given_as_a_hyper_parameter_is_saved_and_the_checkpoint_resumes(tmp_path, data):
    """``GPTPretraining(init_from=Path(...))`` puts a ``pathlib`` path into the checkpoint's hyper-parameters, which
    PyTorch's ``weights_only`` list does not allow: ``strategy/safe_load.py`` allows paths, so it still resumes."""
    from pathlib import Path

    init_from = Path(__file__).parent / "fixtures" / "fit-1dev.ckpt"
    _fit(tmp_path, data, 2, every=2, init_from=init_from)
    saved = tmp_path / "checkpoints" / "epoch=0-step=2.ckpt"
    assert "pathlib.PosixPath" in torch.serialization.get_unsafe_globals_in_checkpoint(saved)
    resumed = Losses()
    _fit(tmp_path, data, 3, ckpt_path=saved, callbacks=[resumed], init_from=init_from)
    assert sorted(resumed.losses) == [2], resumed.losses
