"""What a run prints first and what a refused run leaves behind (issue 39 item 6): the ``Model:`` line is the first
line of a run, as the README says (Lightning's "Seed set to 1337" and "GPU available" came first), and a run
refused for its settings leaves no logger folder (each attempt left an empty ``lightning_logs/version_N``, or one
holding only ``config.yaml``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from lightning_sppo.training.log_folders import unused_log_folder
from tests import preloaded
from tests.subprocesses import one_thread_env
from tests.training.cli_runs import DEMO_TOKENS, copy_token_file

CONFIG = {
    "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "enable_progress_bar": False,
                "enable_model_summary": False},
    "model": {"model": "tiny"},
    "data": {"path": "data/demo", "seq_len": 32, "batch_size": 2},
}  # fmt: skip


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    copy_token_file(DEMO_TOKENS, tmp_path / "data" / "demo")
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(CONFIG))
    return tmp_path


def _sppo(work: Path, *args: str):
    command = [sys.executable, "-m", "lightning_sppo.training.cli", "fit", "--config", "my.yaml", *args]
    return preloaded.run(command, env=one_thread_env(), cwd=work, timeout=600)


@pytest.mark.slow  # three short runs of the command
def test_the_model_line_is_the_first_line_and_a_refused_run_leaves_no_log_folder(work: Path):
    run = _sppo(work, "--trainer.default_root_dir", "runs/a")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert lines[0].startswith("Model: 'tiny' (0.2M parameters") and "seed_everything=1337" in lines[0], lines[:3]
    assert not any(line.startswith("Seed set to") for line in lines), lines[:5]
    assert [p.name for p in (work / "runs/a/lightning_logs").iterdir()] == ["version_0"]  # a run keeps its own

    (work / "notes.txt").write_text("some text\n")
    for args in (("--data.path", "notes.txt"), ("--trainer.strategy.init_args.num_microbatches", "2")):
        refused = _sppo(work, "--trainer.default_root_dir", "runs/b", *args)
        assert refused.returncode == 2, refused.stderr[-3000:]  # the data module's check, then the strategy's
    assert not (work / "runs/b/lightning_logs").exists(), sorted(map(str, (work / "runs/b").rglob("*")))


def test_what_counts_as_an_unused_log_folder(tmp_path: Path):
    folder = tmp_path / "version_0"
    folder.mkdir()
    assert unused_log_folder(folder)
    (folder / "config.yaml").write_text("trainer: {}\n")
    (folder / "hparams.yaml").write_text("{}\n")
    (folder / "events.out.tfevents.1.host").write_bytes(b"\0" * 88)  # TensorBoard's header alone
    assert unused_log_folder(folder)
    (folder / "metrics.csv").write_text("step,train/loss\n0,5.5\n")  # something was logged: kept
    assert not unused_log_folder(folder)
    (folder / "metrics.csv").unlink()
    (folder / "events.out.tfevents.1.host").write_bytes(b"\0" * 5000)
    assert not unused_log_folder(folder)
