"""End to end: `sppo fit` on 2 CPU processes (pp=2), resume, and one-line errors for bad input."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.subprocesses import ONE_THREAD, one_thread_env

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo-cpu.yaml"


def _prepare(tmp: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "lightning_sppo.data.prepare", str(ROOT / "data" / "corpus"), "--output", "data/demo"],
        cwd=tmp,
        env=one_thread_env(),
        check=True,
        capture_output=True,
    )


def _config(tmp: Path, name: str, max_steps: int, wandb: bool = False, **changes) -> Path:
    config = yaml.safe_load(DEMO.read_text())
    trainer = config["trainer"]
    trainer |= {"max_steps": max_steps, "limit_train_batches": 5, "log_every_n_steps": 1, "default_root_dir": "runs"}
    trainer["logger"] = [
        logger for logger in trainer["logger"] if wandb or not logger["class_path"].endswith("WandbLogger")
    ]
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = f"runs/{name}"
    checkpoint = next(c for c in trainer["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))
    checkpoint["init_args"] |= {"every_n_train_steps": 5, "dirpath": f"runs/{name}/checkpoints"}
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _sppo(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", "lightning_sppo.training.cli", *args],
        cwd=tmp,
        env=env | ONE_THREAD | {"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _losses(tmp: Path, name: str) -> dict[int, float]:
    losses = {}
    for path in (tmp / "runs" / name).glob("csv/version_*/metrics.csv"):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("train/loss"):
                    losses[int(row["step"])] = float(row["train/loss"])
    return losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """`sppo fit` of the demo config for 10 steps (5 per epoch), with W&B (offline) and CSV loggers."""
    tmp = tmp_path_factory.mktemp("cli")
    _prepare(tmp)
    run = _sppo(tmp, "fit", "--config", str(_config(tmp, "full", 10, wandb=True)))
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp, _losses(tmp, "full")


def test_fit_learns_and_writes_wandb_csv_and_checkpoints(uninterrupted):
    tmp, losses = uninterrupted
    assert sorted(losses) == list(range(10)), losses
    assert losses[9] < losses[0] - 0.5, losses
    assert list((tmp / "runs/full/wandb").glob("offline-run-*")), "no W&B offline run was written"
    kept = sorted(p.name for p in (tmp / "runs/full/checkpoints").iterdir())
    assert kept == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt", "last.ckpt"], kept


def test_resume_gives_the_uninterrupted_losses(uninterrupted):
    tmp, expected = uninterrupted
    first = _sppo(tmp, "fit", "--config", str(_config(tmp, "resumed", 5)))
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp / "runs/resumed/checkpoints/last.ckpt").exists()
    second = _sppo(tmp, "fit", "--config", str(_config(tmp, "resumed", 10)), "--ckpt_path", "last")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = _losses(tmp, "resumed")
    assert sorted(resumed) == list(range(10)), resumed
    for step in range(10):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6), (step, expected, resumed)


def test_fabric_recipe_trains_to_the_cli_loss_curve(uninterrupted):
    tmp, expected = uninterrupted
    overrides = ["--train.max_steps", "10", "--train.batches_per_epoch", "5", "--train.save_interval", "5",
                 "--log.wandb_project", "null", "--out_dir", "runs/fabric"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(ROOT / "recipes/pretrain_fabric.py"), "--config", str(ROOT / "configs/fabric-demo-cpu.yaml"),
         *overrides],
        cwd=tmp, env=one_thread_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    with (tmp / "runs/fabric/metrics.csv").open() as f:
        losses = {int(row["step"]): float(row["loss"]) for row in csv.DictReader(f)}
    assert sorted(losses) == list(range(10)), losses
    for step in range(10):
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), (step, expected, losses)
    assert sorted(p.name for p in (tmp / "runs/fabric/checkpoints").iterdir()) == ["step-000005", "step-000010"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"data.path": "data/missing"}, "data/missing"),
        ({"data.seq_len": 8192}, "data.seq_len=8192 is above the model's block_size=4096"),
        ({"trainer.strategy.init_args.pipeline_parallel": 3}, "pipeline_parallel * sequence_parallel = 3 * 1"),
        ({"model.model_overrides": {"vocab_size": 128}}, "vocab_size=256, above the model's vocab_size=128"),
        ({"trainer.strategy.init_args.pipline_parallel": 2}, "Option 'pipline_parallel' is not accepted"),
        ({"trainer.strategy.init_args.partition": "lenght"}, "Unknown partition='lenght'"),
    ],
    ids=["missing-data", "too-long", "layout", "vocabulary", "unknown-option", "bad-choice"],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, changes, message):
    _prepare(tmp_path)
    result = _sppo(tmp_path, "fit", "--config", str(_config(tmp_path, "bad", 2, **changes)))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("sppo: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
