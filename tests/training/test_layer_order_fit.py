"""`sppo fit` in the layer order on 2 processes (Ulysses sp=2, FSDP2 over both): it trains, checkpoints, and its
checkpoint resumes in the subsequence order (pp=2) with the losses the layer-order run went on to have.

Both orders compute the plain model's loss and gradients (to float rounding), and both runs see the same batches
(data parallel 1 in both: the two sp ranks, and the two pipeline stages, share each batch), so the resumed run's
losses equal the uninterrupted one's to rel=1e-5: weights, AdamW state and LR schedule came back. Every command is
forked from the preloaded server (``tests/preloaded.py``), its second rank too.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import yaml

from tests import preloaded
from tests.subprocesses import one_thread_env

pytestmark = pytest.mark.slow  # every test runs the sppo command (2 processes)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo-cpu.yaml"
SAVED_AT, STEPS = 2, 4
LAYER_ORDER = {"order": "layer", "pipeline_parallel": 1, "sequence_parallel": 2, "recompute": "selective",
               "num_microbatches": 1, "offload": "full", "kv_device_tokens": 64, "kv_chunk_tokens": 32}  # fmt: skip


def _config(tmp: Path, name: str, strategy: dict) -> Path:
    config = yaml.safe_load(DEMO.read_text())
    trainer = config["trainer"]
    trainer |= {"max_steps": STEPS, "log_every_n_steps": 1, "default_root_dir": f"runs/{name}"}
    trainer["strategy"]["init_args"] |= strategy
    trainer["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                          "init_args": {"save_dir": f"runs/{name}", "name": "csv"}}]  # fmt: skip
    trainer["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                             "init_args": {"dirpath": f"runs/{name}/checkpoints", "every_n_train_steps": SAVED_AT,
                                           "save_top_k": -1}}]  # fmt: skip
    config["data"] |= {"path": str(ROOT / "data" / "demo"), "seq_len": 128}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _fit(tmp: Path, config: Path, *args: str) -> None:
    env = {k: v for k, v in one_thread_env().items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    command = [sys.executable, "-m", "lightning_sppo.training.cli", "fit", "--config", str(config), *args]
    run = preloaded.run(command, cwd=tmp, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def _losses(tmp: Path, name: str) -> dict[int, float]:
    losses = {}
    for path in (tmp / "runs" / name).glob("csv/version_*/metrics.csv"):
        with path.open() as f:
            losses |= {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")}
    return losses


def test_layer_order_fits_on_two_processes_and_resumes_in_the_subsequence_order(tmp_path):
    _fit(tmp_path, _config(tmp_path, "layer", LAYER_ORDER))
    layer = _losses(tmp_path, "layer")
    assert sorted(layer) == list(range(STEPS)) and layer[STEPS - 1] < layer[0], layer
    saved = next((tmp_path / "runs/layer/checkpoints").glob(f"*step={SAVED_AT}.ckpt"))
    assert (saved / "meta.pt").is_file(), "the layer order's checkpoint is not a complete distributed checkpoint"
    _fit(tmp_path, _config(tmp_path, "resumed", {}), "--ckpt_path", str(saved))  # the demo's pp=2 pipeline
    resumed = _losses(tmp_path, "resumed")
    assert sorted(resumed) == list(range(SAVED_AT, STEPS)), resumed
    for step in resumed:
        assert resumed[step] == pytest.approx(layer[step], rel=1e-5), (step, layer, resumed)
