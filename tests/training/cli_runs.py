"""What the tests that run the ``sppo`` command share: the demo token file copied in, a run that must succeed, and
what it logged."""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

from lightning_sppo.data.token_file import token_file_paths
from tests import preloaded
from tests.subprocesses import one_thread_env

ROOT = Path(__file__).resolve().parents[2]
DEMO_TOKENS = ROOT / "data" / "demo"


def copy_token_file(source: Path, target: Path) -> None:
    """The three parts of the token file ``source`` (``.bin``, ``.idx``, ``.json``) as ``target``."""
    for part, copy in zip(token_file_paths(source), token_file_paths(target), strict=True):
        shutil.copy(part, copy)


def fit(work: Path, config: Path, *args: str) -> None:
    """``sppo fit --config CONFIG ARGS`` in ``work``, which must succeed."""
    command = [sys.executable, "-m", "lightning_sppo.training.cli", "fit", "--config", str(config), *args]
    run = preloaded.run(command, cwd=work, env=one_thread_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def logged(work: Path, name: str, *keys: str) -> dict[int, tuple[float, ...]]:
    """Per step, the values of ``keys`` in the CSV logs of every run into runs/NAME (rows that log the first)."""
    values = {}
    for path in (work / "runs" / name).glob("csv/version_*/metrics.csv"):
        with path.open() as f:
            values |= {int(row["step"]): tuple(float(row[key]) for key in keys) for row in csv.DictReader(f)
                       if row.get(keys[0])}  # fmt: skip
    return values


def train_losses(work: Path, name: str) -> dict[int, float]:
    """Per step, the training loss the runs into runs/NAME logged."""
    return {step: loss for step, (loss,) in logged(work, name, "train/loss").items()}
