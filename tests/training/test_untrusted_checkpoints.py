"""A checkpoint is data, never code (issue 36): malicious checkpoints (``untrusted.py``: a real checkpoint plus one
pickled object that runs ``touch MARKER``) given to every entry point that reads a checkpoint a user names.

Each entry point refuses in one line naming the file and the global it asked for (exit status 2 for the commands,
``UnsafeCheckpointError`` for Fabric), and the marker never appears. The negative control: the same files read as the
project read them before (``torch.load(weights_only=False)``, DCP's plain ``pickle``) do run the command. The one-
process cases run in one process forked from the preloaded server (``untrusted_checkpoints.py``); ``sppo fit`` on two
processes and the Fabric recipe run on their own here; Fabric's load on two processes is in
``tests/distributed/test_untrusted_checkpoints.py``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests import preloaded
from tests.subprocesses import one_thread_env
from tests.training.bad_inputs import Case, Outcome, check
from tests.training.untrusted import KINDS, OVERRIDES, make_untrusted, runs_code
from tests.training.untrusted_checkpoints import CASES, MARKER, REFUSED_AT

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[Outcome, bool]]:
    out = tmp_path_factory.mktemp("untrusted") / "outcomes.json"
    env = one_thread_env(PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    script = str(ROOT / "tests/training/untrusted_checkpoints.py")
    run = preloaded.run([sys.executable, script, str(out)], env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {k: (Outcome(**outcome), ran) for k, (outcome, ran) in json.loads(out.read_text()).items()}


@pytest.mark.slow  # about 25 runs of sppo, sppo-export and Fabric's load, in one process
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_entry_point_refuses_the_checkpoint_and_runs_none_of_it(outcomes, case: Case):
    outcome, ran = outcomes[case.id]
    assert not ran, f"{case.id}: the checkpoint's command ran"
    assert not check(case, outcome), (check(case, outcome), outcome.output[-2000:] or outcome.error)


@pytest.mark.parametrize("kind", KINDS)
def test_each_malicious_checkpoint_runs_its_code_when_read_as_before(tmp_path, kind):
    """The negative control: read with ``torch.load(weights_only=False)`` and DCP's own reader and planner, as every
    entry point read checkpoints before issue 36, each of them runs its command (so a test above can fail)."""
    paths = make_untrusted(tmp_path, tmp_path / MARKER)
    assert runs_code(paths[kind], tmp_path / MARKER)


def _fit_config(tmp: Path, devices: int, pipeline_parallel: int) -> Path:
    strategy = {"num_subsequences": 2, "pipeline_parallel": pipeline_parallel}
    config = {
        "trainer": {"accelerator": "cpu", "devices": devices, "max_steps": 4, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": "runs/fit",
                    "strategy": {"class_path": "lightning_sppo.SPPOTrainerStrategy", "init_args": strategy}},
        "model": {"model": "tiny", "model_overrides": OVERRIDES},
        "data": {"path": str(ROOT / "data/demo"), "seq_len": 32, "batch_size": 2},
    }  # fmt: skip
    path = tmp / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _error_lines(stderr: str, program: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{program}: error:")]


@pytest.mark.slow  # sppo fit on 2 processes
def test_sppo_fit_on_two_processes_refuses_a_folder_whose_dcp_metadata_runs_code(tmp_path):
    """pp=2: the folder's ``meta.pt`` is clean (the command's own checks read it), its ``.metadata`` is not: each rank
    reads it in the strategy's load and refuses; one line, exit status 2, no marker."""
    paths = make_untrusted(tmp_path, tmp_path / MARKER)
    env = one_thread_env()  # without the launch variables an in-process test left behind
    command = [sys.executable, "-m", "lightning_sppo.training.cli", "fit", "--config", str(_fit_config(tmp_path, 2, 2)),
               "--ckpt_path", str(paths["folder-metadata"])]  # fmt: skip
    run = preloaded.run(command, cwd=tmp_path, env=env, timeout=600)
    [line] = _error_lines(run.stderr, "sppo")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert REFUSED_AT["folder-metadata"] in line and "posix.system" in line, line
    assert not (tmp_path / MARKER).exists()


@pytest.mark.slow  # the recipe's start-up and a Fabric load
@pytest.mark.parametrize("kind", ["folder-meta", "folder-metadata"])
def test_the_fabric_recipe_refuses_to_resume_from_a_checkpoint_that_runs_code(tmp_path, kind):
    """``recipes/pretrain_fabric.py --resume true`` loads the newest checkpoint of its ``out_dir`` with Fabric."""
    paths = make_untrusted(tmp_path, tmp_path / MARKER)
    (tmp_path / "out/checkpoints").mkdir(parents=True)
    paths[kind].rename(tmp_path / "out/checkpoints/step-000002")
    command = [sys.executable, str(ROOT / "recipes/pretrain_fabric.py"), "--model_name", "tiny", "--model_overrides",
               json.dumps(OVERRIDES), "--devices", "1", "--out_dir", "out", "--data.path", str(ROOT / "data/demo"),
               "--data.seq_len", "32", "--data.batch_size", "2", "--train.max_steps", "4", "--resume", "true",
               "--strategy", '{"num_subsequences": 2}']  # fmt: skip
    run = preloaded.run(command, cwd=tmp_path, env=one_thread_env(), timeout=600)
    [line] = _error_lines(run.stderr, "pretrain_fabric")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    refused = REFUSED_AT[kind].replace(f"untrusted-{kind}.ckpt", "step-000002")
    assert refused in line and "posix.system" in line, line
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("owner", ["GPTPretraining", "TokenDataModule"])
def test_lightnings_load_from_checkpoint_is_refused_before_the_file_is_read(tmp_path, monkeypatch, owner):
    """Lightning's ``load_from_checkpoint`` reads the file with PyTorch's defaults, which an environment variable
    (or an ``http`` URL) turns off: our classes refuse it, in one line saying what to use, before reading a byte."""
    import torch

    from lightning_sppo.data.datamodule import TokenDataModule
    from lightning_sppo.training.module import GPTPretraining
    from tests.training.untrusted import RunsCode

    cls = {"GPTPretraining": GPTPretraining, "TokenDataModule": TokenDataModule}[owner]
    marker, path = tmp_path / MARKER, tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}, "note": RunsCode(marker)}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # set in some environments for old checkpoints
    with pytest.raises(
        NotImplementedError, match=r"is not supported \(it would read the file with Lightning"
    ) as raised:
        cls.load_from_checkpoint(path)
    assert "\n" not in str(raised.value) and "sppo" in str(raised.value) and not marker.exists()
    with contextlib.suppress(Exception):  # the negative control: Lightning's own (what they inherited) runs it
        super(cls, cls).load_from_checkpoint(path)
    assert marker.exists()
