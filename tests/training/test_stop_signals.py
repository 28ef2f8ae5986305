"""Stop signals in process: what a handler does before and during training, the ranks' agreement, the end of the
command, SLURM's requeue, and the shutdown's waiting for the ranks a launcher started. The real multi-process runs
(signals to `sppo fit` and to the Fabric recipe, resumed bit for bit) are in test_stop.py."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, Trainer

from lightning_sppo import SPPOTrainerStrategy
from lightning_sppo.callbacks import SPPOCheckpoint
from lightning_sppo.data import TokenDataModule, write_tokens
from lightning_sppo.training import GPTPretraining, shutdown, stop
from lightning_sppo.training.stop import StopOnSignal, StopSignals, end_of_run, requeue_signal, signals_stop_the_run
from tests.distributed.harness import run_distributed
from tests.training.faults import SignalAt


class _EndedNow(Exception):
    """What ``failures.end_now`` (``os._exit``) becomes in these tests."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@pytest.fixture
def ended_now(monkeypatch):
    def end_now(code: int) -> None:
        raise _EndedNow(code)

    monkeypatch.setattr(stop, "end_now", end_now)


@pytest.fixture
def signals():
    """A ``StopSignals`` handling SIGINT and SIGTERM in this process, and pytest's handlers back afterwards."""
    signals = StopSignals()
    handlers = signals.install("sppo", "--ckpt_path last")
    try:
        yield signals
    finally:
        signals.restore(handlers)


def test_while_training_a_signal_only_asks_to_stop_and_a_repeated_sigterm_changes_nothing(signals, capfd):
    signals.arm()
    os.kill(os.getpid(), signal.SIGTERM)  # handled before os.kill returns to the next line
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.received == signal.SIGTERM and not signals.agreed
    assert capfd.readouterr().err == "sppo: SIGTERM: stopping after the step in flight, with a checkpoint\n"
    assert signals.agree() and signals.agreed == signal.SIGTERM  # one process: no collective
    signals.stopped(12, "runs/x/checkpoints/epoch=0-step=12.ckpt")
    assert signals.exit_status() == 143
    assert signals.final_line() == (
        "sppo: stopped at step 12; continue with `--ckpt_path last` (SIGTERM; runs/x/checkpoints/epoch=0-step=12.ckpt)"
    )
    signals.checkpoint = None  # no SPPOCheckpoint in the callbacks: the line says so
    assert "stopped at step 12 (SIGTERM) without a checkpoint of it (checkpointing off" in signals.final_line()


def test_a_second_ctrl_c_ends_at_once_saying_whether_the_checkpoint_was_written(signals, ended_now, capfd):
    signals.arm()
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(_EndedNow) as ended:
        os.kill(os.getpid(), signal.SIGINT)
    assert ended.value.code == 130
    assert capfd.readouterr().err.splitlines() == [
        "sppo: SIGINT (Ctrl-C): stopping after the step in flight, with a checkpoint (Ctrl-C again stops at once,"
        " without it)",
        "sppo: second Ctrl-C: stopped at once; the checkpoint of this step was not written; the newest complete one"
        " stays: continue with `--ckpt_path last`",
    ]
    signals.stopped(7, "ckpt/epoch=0-step=7.ckpt")  # Ctrl-C again once the stop's checkpoint is written
    with pytest.raises(_EndedNow):
        os.kill(os.getpid(), signal.SIGINT)
    assert "the checkpoint of step 7 was written (ckpt/epoch=0-step=7.ckpt)" in capfd.readouterr().err


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_before_training_a_signal_interrupts_the_command_with_one_line_and_its_status(ended_now, capfd, signum, status):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(_EndedNow) as ended, signals_stop_the_run("sppo", "--ckpt_path last"):
        os.kill(os.getpid(), signum)
        pytest.fail("the signal did not interrupt")
    assert ended.value.code == status
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else "SIGTERM"
    assert capfd.readouterr().err == f"sppo: stopped by {name} before a training step; nothing to save\n"
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handlers are gone with it


def test_lightning_s_exit_after_its_ctrl_c_handling_becomes_the_signal_s_status(ended_now, capfd):
    """Lightning catches the KeyboardInterrupt inside ``fit``, stops its ranks, and calls ``sys.exit(1)``."""
    with pytest.raises(_EndedNow) as ended, signals_stop_the_run("sppo", "--ckpt_path last"):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            sys.exit(1)
    assert ended.value.code == 130
    with pytest.raises(SystemExit) as exit_, signals_stop_the_run("sppo", "--ckpt_path last"):
        sys.exit(2)  # no signal: a settings error's status stays
    assert exit_.value.code == 2


def test_end_of_run_exits_with_the_stop_s_status_or_a_started_rank_s_failure(capfd):
    stopped = StopSignals("pretrain_fabric", "--resume true")
    stopped.received = stopped.agreed = signal.SIGINT
    stopped.stopped(3, "runs/f/checkpoints/step-000003")
    with pytest.raises(SystemExit) as exit_:
        end_of_run(0, stopped)
    assert exit_.value.code == 130
    assert capfd.readouterr().err == (
        "pretrain_fabric: stopped at step 3; continue with `--resume true` (SIGINT (Ctrl-C);"
        " runs/f/checkpoints/step-000003)\n"
    )
    end_of_run(0, StopSignals())  # finished: returns
    with pytest.raises(SystemExit) as exit_:
        end_of_run(137, StopSignals())  # a rank this process started was killed
    assert exit_.value.code == 137


def _agreement(rank: int, world_size: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    alone, first, both = StopSignals(), StopSignals(), StopSignals()
    assert not alone.agree() and not alone.agree()  # nobody signalled: every rank trains on
    if rank == 1:
        first.received = signal.SIGINT  # reached rank 1 only (or rank 1 first)
    assert first.agree() and first.agreed == signal.SIGINT, (rank, first.agreed)
    both.received = signal.SIGINT if rank == 0 else signal.SIGTERM
    assert both.agree() and both.agreed == signal.SIGTERM  # the scheduler's signal over Ctrl-C: exit status 143


def test_every_rank_agrees_to_stop_when_any_one_was_signalled():
    run_distributed(_agreement, 2)


class _Recorder(Callback):
    def __init__(self) -> None:
        self.sigterm_handlers, self.validations = [], 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sigterm_handlers.append(signal.getsignal(signal.SIGTERM))

    def on_validation_start(self, trainer, pl_module) -> None:
        self.validations += 1


def test_on_one_device_sigterm_stops_after_the_step_in_flight_saves_it_and_skips_the_validation(tmp_path, signals):
    """The Trainer's path: SIGTERM while step 3 runs; the run stops after it (step 4) with SPPOCheckpoint's
    checkpoint of step 4, without the validation due at step 4 (Lightning validates before an early stop) and with
    Lightning's own SIGTERM handler never installed (it calls a collective inside the handler)."""
    text = b"the quick brown fox jumps over the lazy dog. "
    write_tokens(tmp_path / "toy", [list(text * 20 + bytes([i])) for i in range(4)], vocab_size=256, tokenizer="bytes")
    recorder = _Recorder()
    checkpoint = SPPOCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=100)
    trainer = Trainer(
        strategy=SPPOTrainerStrategy(num_subsequences=2), accelerator="cpu", devices=1, max_steps=20, logger=False,
        callbacks=[StopOnSignal(signals), checkpoint, SignalAt(step=3), recorder], val_check_interval=4,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TokenDataModule(tmp_path / "toy", seq_len=64, batch_size=2, val_fraction=0.25)
    trainer.fit(GPTPretraining(model="tiny", warmup_steps=2, max_steps=20), data)
    assert trainer.global_step == 4 and signals.agreed == signal.SIGTERM and signals.step == 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert signals.checkpoint == str(tmp_path / "checkpoints" / "epoch=0-step=4.ckpt")
    assert recorder.validations == 0
    assert recorder.sigterm_handlers == [signals._handle] * 4


def test_requeue_under_slurm_only_with_lightning_s_auto_requeue(monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert requeue_signal(SLURMEnvironment()) == signal.SIGUSR1
    assert requeue_signal(SLURMEnvironment(requeue_signal=signal.SIGHUP)) == signal.SIGHUP
    assert requeue_signal(SLURMEnvironment(auto_requeue=False)) is None
    assert requeue_signal(None) is None


def _fake_scontrol(folder, exit_status: int = 0) -> dict[str, str]:
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{folder}/calls"\necho "no such job" >&2\nexit {exit_status}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def test_the_slurm_job_is_requeued_with_scontrol(tmp_path, capfd):
    environ = _fake_scontrol(tmp_path)
    assert stop.requeue_slurm_job(environ | {"SLURM_JOB_ID": "42"})
    assert stop.requeue_slurm_job(environ | {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"})
    assert (tmp_path / "calls").read_text().splitlines() == ["requeue 42", "requeue 7_3"]
    assert not stop.requeue_slurm_job(environ)  # not a SLURM job
    failing = tmp_path / "failing"
    failing.mkdir()
    assert not stop.requeue_slurm_job(_fake_scontrol(failing, 1) | {"SLURM_JOB_ID": "42"})
    assert "could not requeue SLURM job 42: no such job; submit it again to continue" in capfd.readouterr().err


class _Rank:
    def __init__(self, status: int | None) -> None:
        self.status, self.killed = status, False

    def wait(self, timeout: float | None = None) -> int:
        if self.status is None and not self.killed:
            raise subprocess.TimeoutExpired("rank", timeout)
        return -9 if self.killed else self.status

    def kill(self) -> None:
        self.killed = True


def test_a_launcher_s_rank_zero_takes_its_ranks_from_the_observer_and_waits_for_them(monkeypatch):
    """Lightning's observer thread watches the launcher's own list: emptied, it cannot SIGKILL rank 0 when a rank
    exits 143 first. The ranks are waited for (a hung one killed after the wait) and the first failure returned."""
    launcher = type("Launcher", (), {})()
    ranks = [_Rank(0), _Rank(143)]
    launcher.procs = watched = list(ranks)
    assert shutdown._take_ranks(launcher) == ranks and launcher.procs is watched and watched == []
    assert shutdown._wait_for(ranks) == 143
    monkeypatch.setattr(shutdown, "_RANKS_WAIT_S", 0.0)
    hung = _Rank(None)
    assert shutdown._wait_for([_Rank(0), hung]) == 137 and hung.killed
    assert shutdown._take_ranks(None) == [] and shutdown._wait_for([]) == 0
