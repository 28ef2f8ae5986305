"""`sppo fit` in the layer order on 2 processes (Ulysses sp=2, FSDP2 over both): it trains, checkpoints, and its
checkpoint resumes in the subsequence order (pp=2) with the losses the layer-order run went on to have.

Both orders compute the plain model's loss and gradients (to float rounding), and both runs see the same batches
(data parallel 1 in both: the two sp ranks, and the two pipeline stages, share each batch), so the resumed run's
losses equal the uninterrupted one's to rel=1e-5: weights, AdamW state and LR schedule came back. Every command is
forked from the preloaded server (``tests/preloaded.py``), its second rank too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.training.cli_runs import fit, train_losses

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


def test_layer_order_fits_on_two_processes_and_resumes_in_the_subsequence_order(tmp_path):
    fit(tmp_path, _config(tmp_path, "layer", LAYER_ORDER))
    layer = train_losses(tmp_path, "layer")
    assert sorted(layer) == list(range(STEPS)) and layer[STEPS - 1] < layer[0], layer
    saved = next((tmp_path / "runs/layer/checkpoints").glob(f"*step={SAVED_AT}.ckpt"))
    assert (saved / "meta.pt").is_file(), "the layer order's checkpoint is not a complete distributed checkpoint"
    fit(tmp_path, _config(tmp_path, "resumed", {}), "--ckpt_path", str(saved))  # the demo's pp=2 pipeline
    resumed = train_losses(tmp_path, "resumed")
    assert sorted(resumed) == list(range(SAVED_AT, STEPS)), resumed
    for step in resumed:
        assert resumed[step] == pytest.approx(layer[step], rel=1e-5), (step, layer, resumed)
