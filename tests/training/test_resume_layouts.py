"""`sppo fit` resumes its `last.ckpt` in another layout: saved at pp=2, continued at dp=2 (FSDP over 2 processes,
pipeline_parallel=1), the next losses equal those of continuing at pp=2.

Same data order is needed: the checkpoint holds the loader's position as samples of the whole data-parallel
group, and at dp=2 each rank takes half of the pp=2 batch (the sampler deals the same shuffled indices to the
two ranks in turn), so both resumes train the same rows. The loss at the first
resumed step depends on the restored weights only; the next one also on the AdamW state and LR schedule.
Only the order of float sums differs between the layouts, hence rel=1e-5.

Every command is forked from the preloaded server (``tests/preloaded.py``), its second rank too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from tests import preloaded
from tests.subprocesses import one_thread_env
from tests.training.cli_runs import fit, logged, train_losses

pytestmark = pytest.mark.slow  # every test runs the sppo command (2 processes)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo-cpu.yaml"
SAVED_AT = 5  # steps: mid-epoch (the loader position travels in the checkpoint)


def _config(tmp: Path, name: str, max_steps: int, pipeline_parallel: int, batch_size: int) -> Path:
    config = yaml.safe_load(DEMO.read_text())
    trainer = config["trainer"]
    trainer |= {"max_steps": max_steps, "log_every_n_steps": 1}
    trainer |= {"default_root_dir": f"runs/{name}", "devices": 2}
    trainer["strategy"]["init_args"]["pipeline_parallel"] = pipeline_parallel  # the rest (2 processes) is dp
    trainer["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                          "init_args": {"save_dir": f"runs/{name}", "name": "csv"}}]  # fmt: skip
    trainer["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                             "init_args": {"dirpath": f"runs/{name}/checkpoints", "every_n_train_steps": SAVED_AT,
                                           "save_last": True}}]  # fmt: skip
    config["data"]["batch_size"] = batch_size  # per data-parallel rank
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_last_ckpt_saved_at_pp2_resumes_at_dp2_with_the_same_next_losses(tmp_path):
    prepare = [sys.executable, "-m", "lightning_sppo.data.prepare", str(ROOT / "data/corpus"), "--output", "data/demo"]
    prepared = preloaded.run(prepare, cwd=tmp_path, env=one_thread_env(), timeout=600)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    fit(tmp_path, _config(tmp_path, "saved", SAVED_AT, pipeline_parallel=2, batch_size=4))
    last = tmp_path / "runs/saved/checkpoints/last.ckpt"
    assert (last / "meta.pt").is_file(), "last.ckpt is not a complete distributed checkpoint"
    steps = [SAVED_AT, SAVED_AT + 1]
    for name, pp, batch_size in (("continued", 2, 4), ("relaid", 1, 2)):  # the original layout, then dp=2
        fit(tmp_path, _config(tmp_path, name, SAVED_AT + 2, pp, batch_size), "--ckpt_path", str(last))
    continued, relaid = train_losses(tmp_path, "continued"), train_losses(tmp_path, "relaid")
    assert sorted(continued) == sorted(relaid) == steps, (continued, relaid)
    for step in steps:
        assert relaid[step] == pytest.approx(continued[step], rel=1e-5), (step, continued, relaid)
    # The weights really were restored: the loss goes on falling from the saved run's last one (the initial
    # weights, which the same seed would give back, are at the first one).
    saved = train_losses(tmp_path, "saved")
    assert continued[SAVED_AT] < saved[SAVED_AT - 1] < saved[0] - 0.2, (saved, continued)


def _small_config(
    tmp: Path, name: str, max_steps: int, devices: int, pipeline_parallel: int, distributed: bool
) -> Path:
    """The tiny model at seq_len 64 on ``data/demo``, saving every 2 steps (keep 3), logging every step."""
    strategy = {"num_subsequences": 2, "pipeline_parallel": pipeline_parallel,
                "save_distributed_checkpoint": distributed}  # fmt: skip
    config = {
        "seed_everything": 1337,
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "max_steps": max_steps,
            "max_epochs": -1,
            "log_every_n_steps": 1,
            "enable_model_summary": False,
            "enable_progress_bar": False,
            "default_root_dir": f"runs/{name}",
            "strategy": {"class_path": "lightning_sppo.SPPOTrainerStrategy", "init_args": strategy},
            "logger": [
                {
                    "class_path": "lightning.pytorch.loggers.CSVLogger",
                    "init_args": {"save_dir": f"runs/{name}", "name": "csv"},
                }
            ],
            "callbacks": [
                {
                    "class_path": "lightning_sppo.callbacks.SPPOCheckpoint",
                    "init_args": {"every_n_train_steps": 2, "keep": 3},
                }
            ],
        },  # fmt: skip
        "model": {"model": "tiny", "learning_rate": 3e-3, "min_learning_rate": 3e-4, "warmup_steps": 2},
        "data": {"path": str(ROOT / "data/demo"), "seq_len": 64, "batch_size": 4, "seed": 1337},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("distributed", [True, False], ids=["folder", "single-file"])
def test_one_device_checkpoints_resume_on_two_and_back(tmp_path, distributed):
    """A run saved on one device (Lightning's own file: optimizer states by index) resumes as a pp=2 pipeline, and
    that run's checkpoint (a folder, or the single file of several devices) resumes on one device again; every
    resumed step has the loss and learning rate of the uninterrupted one-device run. Each load used to fail: "holds
    no 'model' entry" on two processes, IsADirectoryError (or an optimizer state keyed by name) on one."""
    fit(tmp_path, _small_config(tmp_path, "once", 6, 1, 1, distributed))
    saved = tmp_path / "runs/once/checkpoints/epoch=0-step=2.ckpt"
    fit(tmp_path, _small_config(tmp_path, "two", 6, 2, 2, distributed), "--ckpt_path", str(saved))
    folder = tmp_path / "runs/two/checkpoints/epoch=0-step=4.ckpt"
    assert folder.is_dir() == distributed, sorted(p.name for p in folder.parent.iterdir())
    fit(tmp_path, _small_config(tmp_path, "back", 6, 1, 1, distributed), "--ckpt_path", str(folder))
    once, two, back = (logged(tmp_path, name, "train/loss", "train/lr") for name in ("once", "two", "back"))
    assert sorted(two) == [2, 3, 4, 5] and sorted(back) == [4, 5], (two, back)
    for step, (loss, lr) in (two | back).items():
        assert loss == pytest.approx(once[step][0], rel=1e-5) and lr == pytest.approx(once[step][1]), (step, once)


def test_a_one_device_checkpoint_without_parameter_names_is_one_clear_error(tmp_path):
    """Older one-device checkpoints record no names for their index-keyed optimizer states: splitting them into
    stages would guess, so the load on several devices stops with one line; one saved with them converts."""
    from lightning_sppo.strategy.checkpoint import PARAMETER_NAMES, CheckpointMismatchError, _from_one_device

    state = {"state": {0: {"step": 1}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    old = {"state_dict": {"model.wte.weight": 0}, "optimizer_states": [state], "epoch": 0}
    with pytest.raises(CheckpointMismatchError, match="without the names of its optimizer's parameters"):
        _from_one_device(tmp_path, old, "model", ["optimizer_0"])
    converted = _from_one_device(tmp_path, old | {PARAMETER_NAMES: [["wte.weight"]]}, "model", ["optimizer_0"])
    assert converted == {"epoch": 0, "model": {"wte.weight": 0},
                         "optimizer_0": {"state": {"wte.weight": {"step": 1}},
                                         "param_groups": [{"lr": 0.1, "params": ["wte.weight"]}]}}  # fmt: skip
