"""Checkpoints written before checkpoints were read as data only (issue 36) still resume and export.

The fixtures (``tests/training/fixtures``) were written by lightning-sppo at commit cc41023 with
``tests/training/fixtures/make_fixtures.py``: every writer of the project, on one process and on two, each the
checkpoint of step 2 of a 4-step run of ``tiny`` shrunk to 37K parameters, whose losses that run logged are in
``losses.json``:

* ``fit-1dev.ckpt``: ``sppo fit`` on one process (Lightning's file, optimizer states by index);
* ``fit-pp2-folder.ckpt``: ``sppo fit`` at pp=2 on two processes, a torch.distributed.checkpoint folder;
* ``fit-pp2-file.ckpt``: the same run with ``save_distributed_checkpoint=False`` (one file, states by name);
* ``fabric-1dev.ckpt``: ``recipes/pretrain_fabric.py`` on one process (Fabric's ``save``: a file);
* ``fabric-pp2-folder.ckpt``: the recipe at pp=2 on two processes (a folder, with the data loader's position);
* ``export-fit-pp2-folder``: ``sppo-export`` of ``fit-pp2-folder.ckpt`` at cc41023.

A resume in the layout it was saved in takes steps 2 and 3 with the losses the uninterrupted run logged (rel=1e-5:
the same code on another CPU may sum in another order; on the machine that wrote them they are equal), so the
weights, optimizer states, schedule and data position all came back; the export of the folder today is the export
made then, tensor for tensor.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file as load_safetensors

from tests import preloaded
from tests.subprocesses import one_thread_env
from tests.training.fixtures import make_fixtures

pytestmark = pytest.mark.slow  # each test runs sppo fit, the recipe or sppo-export (some on 2 processes)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(make_fixtures.__file__).parent
LOSSES = json.loads((FIXTURES / "losses.json").read_text())
RESUMED = [make_fixtures.SAVED_AT, make_fixtures.SAVED_AT + 1]


def _work(tmp: Path) -> Path:
    (tmp / "data").mkdir()
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(ROOT / "data" / f"demo{suffix}", tmp / "data" / f"demo{suffix}")
    return tmp


def _run(tmp: Path, *command: str) -> None:
    env = one_thread_env(WANDB_MODE="disabled")  # without the launch variables an in-process test left behind
    run = preloaded.run([sys.executable, *command], cwd=tmp, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def _assert_resumed_losses(losses: dict[int, float], name: str) -> None:
    assert sorted(losses) == RESUMED, losses
    for step in RESUMED:
        assert losses[step] == pytest.approx(LOSSES[name][str(step)], rel=1e-5), (step, losses, LOSSES[name])


@pytest.mark.parametrize(
    "name, devices, pipeline_parallel, distributed",
    [("fit-1dev", 1, 1, True), ("fit-pp2-folder", 2, 2, True), ("fit-pp2-file", 2, 2, False)],
)
def test_an_sppo_fit_checkpoint_resumes_with_the_losses_of_its_run(
    tmp_path, name, devices, pipeline_parallel, distributed
):
    work = _work(tmp_path)
    config = make_fixtures._fit_config(work, name, devices, pipeline_parallel, distributed)
    _run(
        work,
        "-m",
        "lightning_sppo.training.cli",
        "fit",
        "--config",
        str(config),
        "--ckpt_path",
        str(FIXTURES / f"{name}.ckpt"),
    )
    _assert_resumed_losses(make_fixtures._fit_losses(work, name), name)


@pytest.mark.parametrize("name, devices, strategy", [("fabric-1dev", 1, {"num_subsequences": 2}),
                                                     ("fabric-pp2", 2, {"num_subsequences": 2, "pipeline_parallel": 2})])  # fmt: skip
def test_a_fabric_recipe_checkpoint_resumes_with_the_losses_of_its_run(tmp_path, name, devices, strategy):
    work = _work(tmp_path)
    fixture = FIXTURES / (f"{name}.ckpt" if devices == 1 else f"{name}-folder.ckpt")
    (work / "runs" / name / "checkpoints").mkdir(parents=True)
    copy = shutil.copytree if fixture.is_dir() else shutil.copy
    copy(fixture, work / "runs" / name / "checkpoints" / "step-000002")
    recipe = [str(ROOT / "recipes/pretrain_fabric.py"), "--model_name", "tiny", "--model_overrides",
              json.dumps(make_fixtures.OVERRIDES), "--accelerator", "cpu", "--data.seq_len", "32", "--data.batch_size",
              "2", "--train.max_steps", str(make_fixtures.STEPS), "--train.save_interval", str(make_fixtures.SAVED_AT),
              "--train.keep", "3", "--train.warmup_steps", "2"]  # fmt: skip
    _run(work, *recipe, "--devices", str(devices), "--out_dir", f"runs/{name}", "--strategy", json.dumps(strategy),
         "--resume", "true")  # fmt: skip
    with (work / "runs" / name / "metrics.csv").open() as f:
        _assert_resumed_losses({int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}, name)


def test_the_export_of_an_old_folder_is_the_export_made_then(tmp_path):
    """And the single file of the same run (the two runs logged the same losses) exports to the same tensors."""
    made_then = FIXTURES / "export-fit-pp2-folder"
    expected = load_safetensors(made_then / "model.safetensors")
    for name in ("fit-pp2-folder", "fit-pp2-file"):
        _run(tmp_path, "-m", "lightning_sppo.model.export", str(FIXTURES / f"{name}.ckpt"), str(tmp_path / name))
        assert json.loads((tmp_path / name / "config.json").read_text()) == json.loads(
            (made_then / "config.json").read_text()
        )
        exported = load_safetensors(tmp_path / name / "model.safetensors")
        assert exported.keys() == expected.keys()
        assert all(exported[k].equal(expected[k]) for k in expected), name


@pytest.mark.parametrize("name", ["fit-1dev", "fabric-1dev", "fabric-pp2-folder"])
def test_every_other_old_checkpoint_exports(tmp_path, name):
    _run(tmp_path, "-m", "lightning_sppo.model.export", str(FIXTURES / f"{name}.ckpt"), str(tmp_path / "hf"))
    made_then = FIXTURES / "export-fit-pp2-folder"
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (made_then / "config.json").read_text()
    )
    shapes = {k: v.shape for k, v in load_safetensors(made_then / "model.safetensors").items()}
    assert {k: v.shape for k, v in load_safetensors(tmp_path / "hf" / "model.safetensors").items()} == shapes
