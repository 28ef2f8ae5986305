"""How errors end a run (one process; the multi-process behaviour is in test_cli.py), and where outputs go."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_sppo import SPPOConfig
from lightning_sppo.errors import NonFiniteError, SPPOConfigError, config_errors
from lightning_sppo.training import failures
from lightning_sppo.training.cli import WANDB_RUN_ID_FILE, pin_wandb_runs, place_outputs
from tests.subprocesses import one_thread_env


def _exit_status(error: Exception) -> int:
    with pytest.raises(SystemExit) as exit_, failures.exit_on_failure():
        raise error
    return exit_.value.code


def test_a_settings_error_is_one_line_and_status_2(capsys, monkeypatch):
    monkeypatch.delenv("SPPO_TRACEBACK", raising=False)
    assert _exit_status(SPPOConfigError("data.seq_len=9 must be <= 8; e.g. 8")) == 2
    assert capsys.readouterr().err == "sppo: error: data.seq_len=9 must be <= 8; e.g. 8\n"
    wrapped = ValueError("jsonargparse could not build it")
    wrapped.__cause__ = SPPOConfigError("keep=0 must be >= 1")  # what a parser re-raising ours looks like
    assert _exit_status(wrapped) == 2
    assert capsys.readouterr().err == "sppo: error: keep=0 must be >= 1\n"
    assert _exit_status(NonFiniteError("Training diverged at step 3")) == 1  # one line, but not a settings error
    assert capsys.readouterr().err == "sppo: error: Training diverged at step 3\n"


def test_before_the_processes_meet_only_the_launching_rank_zero_reports_a_settings_error(capsys, monkeypatch):
    """Every rank read the same settings and fails alike; one report, without a rank, and every rank exits 2.
    SLURM sets no WORLD_SIZE: a rank that is not 0 is quiet whether or not the world size is known."""
    monkeypatch.delenv("SPPO_TRACEBACK", raising=False)
    for name in ("WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    error = SPPOConfigError("pipeline_parallel=3 must divide 2")
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # SLURM_PROCID=1 (or RANK=1)
    assert _exit_status(error) == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun
    assert _exit_status(error) == 2 and capsys.readouterr().err == ""
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    assert _exit_status(error) == 2
    assert capsys.readouterr().err == "sppo: error: pipeline_parallel=3 must divide 2\n"  # no "rank 0: "
    monkeypatch.setenv("NODE_RANK", "1")  # Lightning's launcher on a second node: local rank 0, not global
    assert _exit_status(error) == 2 and capsys.readouterr().err == ""
    assert _exit_status(KeyError("bug")) == 1  # a bug may be this rank's own: every rank shows its traceback
    assert "rank 0: failed with the KeyError above" in capsys.readouterr().err


def test_the_package_s_own_value_error_types_pass_through_and_print_as_one_line(capsys, monkeypatch):
    """E.g. a checkpoint of another model: a typed user error of its own module, caught by its type."""
    monkeypatch.delenv("SPPO_TRACEBACK", raising=False)
    mismatch = type("CheckpointMismatchError", (ValueError,), {"__module__": "lightning_sppo.strategy.checks"})
    with pytest.raises(mismatch), config_errors():
        raise mismatch("'wte.weight' has shape [64, 48] there but [64, 32] in this model")
    assert _exit_status(mismatch("'wte.weight' has shape [64, 48] there but [64, 32] in this model")) == 2
    assert capsys.readouterr().err == "sppo: error: 'wte.weight' has shape [64, 48] there but [64, 32] in this model\n"


def test_a_bug_keeps_its_traceback(capsys, monkeypatch):
    monkeypatch.delenv("SPPO_TRACEBACK", raising=False)

    def buggy() -> None:
        {}["missing"]

    with pytest.raises(SystemExit) as exit_, failures.exit_on_failure():
        buggy()
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in buggy" in err and "KeyError: 'missing'" in err
    assert err.rstrip().endswith("sppo: failed with the KeyError above")


def test_only_our_own_value_errors_become_settings_errors():
    with pytest.raises(SPPOConfigError, match="Unknown partition='lenght'"), config_errors():
        SPPOConfig(partition="lenght")  # raised by lightning_sppo's check
    with pytest.raises(ValueError) as error, config_errors():
        int("not a number")  # raised outside the package: stays what it is
    assert type(error.value) is ValueError
    with pytest.raises(TypeError), config_errors():
        torch.zeros(2) + "x"


def test_a_rank_that_passes_on_another_s_failure_is_recognised_through_the_frameworks_wrapping():
    """Lightning and jsonargparse re-raise our errors inside their own: the chain is walked, and a cycle ends it."""
    from lightning_sppo.errors import PeerFailedError, error_chain

    try:
        try:
            raise PeerFailedError("rank 0 failed")
        except PeerFailedError as inner:
            raise RuntimeError("wrapped by a framework") from inner
    except RuntimeError as outer:
        wrapped = outer
    assert [type(link) for link in error_chain(wrapped)] == [RuntimeError, PeerFailedError]
    assert failures._follows_a_peer(wrapped) and not failures._follows_a_peer(RuntimeError("a bug"))
    looped = ValueError("a")
    looped.__context__ = ValueError("b")
    looped.__context__.__context__ = looped
    assert len(list(error_chain(looped))) == 2


def test_outputs_follow_the_root_unless_named(tmp_path):
    logger = Namespace(class_path="lightning.pytorch.loggers.CSVLogger", init_args=Namespace(save_dir="", name="csv"))
    wandb = Namespace(class_path="lightning.pytorch.loggers.WandbLogger", init_args=Namespace(save_dir=".", id=None))
    named = Namespace(class_path="lightning.pytorch.loggers.CSVLogger", init_args=Namespace(save_dir="elsewhere"))
    checkpoint = Namespace(class_path="lightning_sppo.callbacks.SPPOCheckpoint", init_args=Namespace(dirpath=None))
    other = Namespace(class_path="lightning_sppo.callbacks.SPPOMetrics", init_args=Namespace(log_every_n_steps=1))
    trainer = Namespace(logger=[logger, wandb, named], callbacks=[checkpoint, other])
    place_outputs(trainer, str(tmp_path))
    assert [entry.init_args.save_dir for entry in trainer.logger] == [str(tmp_path), str(tmp_path), "elsewhere"]
    assert checkpoint.init_args.dirpath == str(tmp_path / "checkpoints") and "dirpath" not in other.init_args

    pin_wandb_runs(trainer, resuming=False)
    first = wandb.init_args.id
    assert len(first) == 8 and (tmp_path / WANDB_RUN_ID_FILE).read_text().strip() == first
    wandb.init_args.id = None
    pin_wandb_runs(trainer, resuming=True)  # --ckpt_path: the same W&B run
    assert wandb.init_args.id == first
    wandb.init_args.id = None
    pin_wandb_runs(trainer, resuming=False)  # a new run: a new id
    assert wandb.init_args.id != first


class _Store:
    """A dict with the three calls of a c10d store that ``_fail_before_start`` makes."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.waited: list[str] = []

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        if self.values.get(key, "") == expected:
            self.values[key] = desired
        return self.values[key]

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def wait(self, keys, timeout) -> None:
        self.waited += [k for k in keys if k in self.values]


def test_before_the_processes_meet_the_first_rank_to_fail_reports_and_the_others_wait_for_it(capsys, monkeypatch):
    """torchrun's agent store picks one reporter; the other ranks return only once its line is out, so torchrun
    (which stops every worker when one exits) cannot cut the report off."""
    monkeypatch.delenv("SPPO_TRACEBACK", raising=False)
    store, error = _Store(), SPPOConfigError("data.seq_len=0 must be positive")
    monkeypatch.setenv("RANK", "1")  # rank 1 fails first
    assert failures._fail_before_start(store, error, "sppo", 2) == 2
    assert capsys.readouterr().err == "sppo: error: data.seq_len=0 must be positive\n"
    monkeypatch.setenv("RANK", "0")
    assert failures._fail_before_start(store, error, "sppo", 2) == 2
    assert capsys.readouterr().err == "" and store.waited == [failures._REPORTED]  # waited for rank 1's line


@pytest.mark.slow
def test_under_torchrun_a_settings_error_is_printed_once_though_another_rank_exits_first(tmp_path):
    """A real 2-process torchrun whose rank 0 finds the error 10 s after rank 1. Before this was handled, rank 1
    exited at once (silent: not rank 0) and torchrun stopped rank 0 before it printed: no message at all."""
    data = Path(__file__).resolve().parents[2] / "data" / "demo"
    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "max_steps": 1, "logger": False,
                    "callbacks": [{"class_path": "tests.training.faults.SettingsErrorWhenBuilt",
                                   "init_args": {"rank_zero_delay_s": 10}}]},
        "data": {"path": str(data), "seq_len": 32, "batch_size": 2},
    }  # fmt: skip
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    root = str(Path(__file__).resolve().parents[2])
    env = one_thread_env(PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m",
               "lightning_sppo.training.cli", "fit", "--config", "bad.yaml"]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("sppo: error:")]
    assert errors == ["sppo: error: test.setting=bad must not be set (raised by rank 1)"], run.stderr[-3000:]
    assert run.returncode != 0 and re.search(r"rank\s+: 1 .*\n\s+exitcode\s+: 2", run.stderr), run.stderr[-3000:]
