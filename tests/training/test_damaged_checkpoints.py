"""Damaged and forged checkpoints (``damaged.py``) given to every entry point that reads a checkpoint a user names:
each ends in one line naming the checkpoint (exit status 2 for the commands), never in a traceback or in an
allocation of a size the checkpoint declares (red team of issue 36).

The one-process cases run in one process forked from the preloaded server (``damaged_checkpoints.py``; run it
alone to see the table). The negative control of each case is main before this change: every one of them ended
in a traceback there (the module docstring of ``damaged_checkpoints.py``). ``sppo fit`` on two processes runs here.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests import preloaded
from tests.subprocesses import one_thread_env
from tests.training.bad_inputs import Case, Outcome, check
from tests.training.damaged_checkpoints import CASES
from tests.training.untrusted import FIXTURES, OVERRIDES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    out = tmp_path_factory.mktemp("damaged") / "outcomes.json"
    env = one_thread_env(PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    script = str(ROOT / "tests/training/damaged_checkpoints.py")
    run = preloaded.run([sys.executable, script, str(out)], env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {k: Outcome(**outcome) for k, outcome in json.loads(out.read_text()).items()}


@pytest.mark.slow  # about 40 runs of sppo, sppo-export and Fabric's load, in one process
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_entry_point_says_in_one_line_that_the_checkpoint_cannot_be_read(outcomes, case: Case):
    outcome = outcomes[case.id]
    assert not check(case, outcome), (check(case, outcome), outcome.output[-2000:] or outcome.error)


@pytest.mark.slow  # sppo fit on 2 processes
def test_sppo_fit_on_two_processes_stops_in_one_line_at_a_folder_with_a_cut_shard(tmp_path):
    """pp=2: rank 1's shard is cut short. Every rank checks the folder's shards before DCP reads one (DCP would
    raise its ``CheckpointException``, a ``BaseException`` the command's failure handling let through): one line,
    exit status 2, and no rank is left waiting."""
    shutil.copytree(FIXTURES / "fit-pp2-folder.ckpt", tmp_path / "cut.ckpt")
    shard = tmp_path / "cut.ckpt" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    strategy = {"num_subsequences": 2, "pipeline_parallel": 2}
    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "max_steps": 4, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": "runs/fit",
                    "strategy": {"class_path": "lightning_sppo.SPPOTrainerStrategy", "init_args": strategy}},
        "model": {"model": "tiny", "model_overrides": OVERRIDES},
        "data": {"path": str(ROOT / "data/demo"), "seq_len": 32, "batch_size": 2},
    }  # fmt: skip
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    env = one_thread_env()  # without the launch variables an in-process test left behind
    command = [sys.executable, "-m", "lightning_sppo.training.cli", "fit", "--config", "fit.yaml", "--ckpt_path",
               "cut.ckpt"]  # fmt: skip
    run = preloaded.run(command, cwd=tmp_path, env=env, timeout=600)
    lines = [line for line in run.stderr.splitlines() if line.startswith("sppo: error:")]
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(lines) == 1, run.stderr[-3000:]
    assert "cut.ckpt/.metadata: it names bytes" in lines[0] and "'__1_0.distcp', which has 100" in lines[0], lines
