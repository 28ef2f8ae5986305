"""End to end: `sppo fit` and `sppo validate` on 2 CPU processes (pp=2), and the Fabric recipe.

One uninterrupted 25-step run (checkpoints every 10 steps, validation every 10, W&B offline) is the reference
for: the loss curve, validation, the final checkpoint, logged settings, an exact resume after SIGKILL, `sppo
validate` and the Fabric recipe. Failure cases are short runs of their own.

The reference run is a real ``python -m lightning_sppo.training.cli``, whose Lightning launcher starts its second
rank as a fresh interpreter too; every other run is the same command line forked from a server with the imports
done (``tests/preloaded.py``: seconds of CPU less per process), ranks included. The resumed runs equal the
reference bit for bit, so the two ways of starting agree.
"""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import preloaded
from tests.subprocesses import one_thread_env

pytestmark = pytest.mark.slow  # every test runs the sppo command (2 processes)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo-cpu.yaml"
DATA = ROOT / "data" / "demo"
STEPS = 25
KILL_AT = 12


def _set(config: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[leaf] = value


def _config(tmp: Path, name: str, wandb: bool = False, callbacks: tuple = (), **changes) -> Path:
    """The demo config, smaller and faster: 64-token sequences, 2 per batch, 2 subsequences, 25 steps."""
    config = yaml.safe_load(DEMO.read_text())
    trainer = config["trainer"]
    trainer |= {
        "max_steps": STEPS,
        "log_every_n_steps": 1,
        "val_check_interval": 10,
        "default_root_dir": f"runs/{name}",
    }
    trainer["logger"] = [entry for entry in trainer["logger"] if wandb or "Wandb" not in entry["class_path"]]
    checkpoint = next(c for c in trainer["callbacks"] if c["class_path"].endswith("SPPOCheckpoint"))
    checkpoint["init_args"] |= {"every_n_train_steps": 10}
    trainer["callbacks"] += list(callbacks)
    trainer["strategy"]["init_args"]["num_subsequences"] = 2
    config["data"] |= {"path": str(DATA), "seq_len": 64, "batch_size": 2}
    for dotted, value in changes.items():
        _set(config, dotted, value)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _env(**extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # tests.training.faults
    return one_thread_env(PYTHONPATH=pythonpath, WANDB_MODE="offline", WANDB_SILENT="true", **extra)


def _sppo(tmp: Path, *args: str, fresh: bool = False) -> subprocess.CompletedProcess:
    """The command, forked from the preloaded server (``fresh``: a new interpreter, as a user starts it)."""
    command = [sys.executable, "-m", "lightning_sppo.training.cli", *args]
    if fresh:
        return subprocess.run(command, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=600)
    return preloaded.run(command, cwd=tmp, env=_env(), timeout=600)


def _rows(tmp: Path, name: str) -> list[list[dict[str, str]]]:
    """The CSV log of each run into runs/NAME (one list of rows per version, oldest first)."""
    versions = sorted((tmp / "runs" / name / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    return [list(csv.DictReader((v / "metrics.csv").open())) for v in versions]


def _column(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    return {int(row["step"]): float(row[key]) for row in rows if row.get(key)}


def _errors(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("sppo: error:")]


def _wandb_run_ids(tmp: Path, name: str) -> list[str]:
    return [p.name.rsplit("-", 1)[1] for p in sorted((tmp / "runs" / name / "wandb").glob("offline-run-*"))]


_OUTPUT: dict[str, str] = {}  # what the uninterrupted run printed (stdout and stderr of both ranks)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, list[dict[str, str]]]:
    """`sppo fit` of the demo config for 25 steps (`--trainer.max_steps 25` over the config's 5), with W&B (offline)
    and CSV; both ranks are new interpreters."""
    tmp = tmp_path_factory.mktemp("cli")
    config = _config(tmp, "full", wandb=True, **{"trainer.max_steps": 5})
    run = _sppo(tmp, "fit", "--config", str(config), "--trainer.max_steps", str(STEPS), fresh=True)
    assert run.returncode == 0, run.stderr[-3000:]
    _OUTPUT["full"] = run.stdout + run.stderr
    [rows] = _rows(tmp, "full")
    return tmp, rows


def test_a_run_prints_no_lightning_tip_and_no_leafspec_deprecation(uninterrupted):
    """Both were printed at every run start (the deprecation once per rank); Lightning's other messages stay."""
    output = _OUTPUT["full"]
    assert "litlogger" not in output and "💡" not in output, output[-3000:]
    assert "LeafSpec" not in output, output[-3000:]
    assert "GLOBAL_RANK: 0" in output and "GLOBAL_RANK: 1" in output, output[-3000:]  # both ranks ran


def test_readme_s_minimal_run_warns_of_nothing(tmp_path):
    """No logger and no validation set (README's smallest config): Lightning warned that it fell back to CSV without
    tensorboardX, and that the empty validation loader had no batches; both are settled at their source now."""
    config = {"trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2}, "model": {"model": "tiny"}}
    config["data"] = {"path": str(DATA), "seq_len": 64, "batch_size": 2}
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(config))
    run = _sppo(tmp_path, "fit", "--config", "my.yaml")
    assert run.returncode == 0, run.stderr[-3000:]
    warnings = [line for line in run.stderr.splitlines() if re.search(r"\.py:\d+: |Warning", line)]
    assert "Model: 'tiny'" in run.stdout + run.stderr and not warnings, warnings  # the output was read
    assert list((tmp_path / "lightning_logs").glob("version_0/hparams.yaml")), "Lightning's default CSV logger"


def test_fit_learns_validates_keeps_its_final_checkpoint_and_logs_its_settings(uninterrupted):
    tmp, rows = uninterrupted
    losses = _column(rows, "train/loss")
    assert sorted(losses) == list(range(STEPS)), losses
    assert losses[STEPS - 1] < losses[0] - 0.5, losses
    # val_check_interval=10: validation after steps 10 and 20 (logged at step indices 9 and 19), nowhere else.
    val = _column(rows, "val/loss")
    assert sorted(val) == [9, 19], val
    assert all(math.isclose(_column(rows, "val/ppl")[s], math.exp(val[s]), rel_tol=1e-5) for s in val)
    # Every 10 steps, the newest two kept, and the final step whatever it is; last.ckpt links to the newest.
    folder = tmp / "runs/full/checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=20.ckpt", "epoch=0-step=25.ckpt", "last.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "epoch=0-step=25.ckpt"
    # The resolved config and the layout in the loggers' hyperparameters; the W&B run under its kept id.
    hparams = yaml.safe_load(next((tmp / "runs/full/csv").glob("version_*/hparams.yaml")).read_text())
    assert hparams["config"]["data"]["seq_len"] == 64 and hparams["config"]["trainer"]["max_steps"] == STEPS
    assert hparams["layout"] == {"pp": 2, "dp": 1, "sp": 1, "world_size": 2}
    run_id = (tmp / "runs/full/wandb-run-id").read_text().strip()
    assert _wandb_run_ids(tmp, "full") == [run_id]


def test_sigkill_after_a_checkpoint_then_resume_is_bit_identical(uninterrupted):
    """Checkpoint every 10 steps, every rank SIGKILLed after step 12, last.ckpt lost too: `--ckpt_path last`
    resumes from step 10 and every later loss (and validation) equals the uninterrupted run's, bit for bit."""
    tmp, reference = uninterrupted
    kill = {"class_path": "tests.training.faults.KillAt", "init_args": {"step": KILL_AT}}
    config = _config(tmp, "killed", wandb=True, callbacks=(kill,))
    killed = _sppo(tmp, "fit", "--config", str(config))
    assert killed.returncode == -9, killed.stderr[-3000:]
    folder = tmp / "runs/killed/checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=10.ckpt", "last.ckpt"]
    (folder / "last.ckpt").unlink()  # as if the crash had hit between the two renames of a swap

    resumed = _sppo(tmp, "fit", "--config", str(_config(tmp, "killed", wandb=True)), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _rows(tmp, "killed")[-1]
    expected, losses = _column(reference, "train/loss"), _column(rows, "train/loss")
    assert sorted(losses) == list(range(10, STEPS)), losses
    assert all(losses[s] == expected[s] for s in losses), [(s, losses[s], expected[s]) for s in losses]
    assert _column(rows, "val/loss") == {19: _column(reference, "val/loss")[19]}
    ids = _wandb_run_ids(tmp, "killed")  # the resumed run continued the killed run's W&B run
    assert len(ids) == 2 and ids[0] == ids[1], ids


def test_validate_a_checkpoint(uninterrupted):
    """`sppo validate` of the step-20 checkpoint gives the val/loss the run logged after step 20."""
    tmp, reference = uninterrupted
    checkpoint = tmp / "runs/full/checkpoints/epoch=0-step=20.ckpt"
    config = _config(tmp, "validate")
    run = _sppo(tmp, "validate", "--config", str(config), "--ckpt_path", str(checkpoint))
    assert run.returncode == 0, run.stderr[-3000:]
    [rows] = _rows(tmp, "validate")
    [loss] = _column(rows, "val/loss").values()
    assert loss == pytest.approx(_column(reference, "val/loss")[19], rel=1e-6)


def test_nonfinite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    changes = {"model.learning_rate": 1e10, "model.warmup_steps": 100, "model.max_grad_norm": 0.0}
    config = _config(tmp_path, "nan", **changes, **{"trainer.max_steps": 12})
    config.write_text(config.read_text().replace("every_n_train_steps: 10", "every_n_train_steps: 2"))
    run = _sppo(tmp_path, "fit", "--config", str(config))
    assert run.returncode == 1, run.stderr[-3000:]
    [error] = _errors(run)  # every rank stopped at the same step; one report
    assert "Training diverged at step" in error and "Traceback" not in run.stderr, run.stderr[-3000:]
    diverged = int(re.search(r"at step (\d+)", error).group(1))
    folder = tmp_path / "runs/nan/checkpoints"
    steps = sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in folder.glob("epoch=*"))
    assert diverged >= 4 and steps == [diverged // 2 * 2 - 2, diverged // 2 * 2], (diverged, steps)
    newest = os.readlink(folder / "last.ckpt")
    assert newest == f"epoch=0-step={steps[-1]}.ckpt"
    dcp_to_torch_save(folder / newest, tmp_path / "newest.pt")
    weights = torch.load(tmp_path / "newest.pt", weights_only=False)["model"]
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_an_error_on_one_rank_is_reported_once_and_ends_every_rank(tmp_path):
    fault = {"class_path": "tests.training.faults.RaiseOnRank", "init_args": {"rank": 1, "step": 2}}
    run = _sppo(tmp_path, "fit", "--config", str(_config(tmp_path, "fault", callbacks=(fault,))))
    assert run.returncode == 2, run.stderr[-3000:]
    assert _errors(run) == ["sppo: error: rank 1: test.fault=rank1 must not be set (raised on rank 1 only)"], (
        run.stderr[-3000:]
    )
    assert "Traceback" not in run.stderr and "Exception raised from" not in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model.model_overrides": {"n_layer": 1}}, "n_layer=1 layers, fewer than pipeline_parallel=2 stages"),
        ({"trainer.strategy.init_args.layers_per_stage": [2, 1]}, "layers_per_stage=[2, 1] must list 2 positive"),
        (
            {
                "trainer.strategy.init_args.pipeline_parallel": 1,
                "trainer.strategy.init_args.sequence_parallel": 2,
                "trainer.strategy.init_args.num_microbatches": 1,
                "model.model_overrides": {"n_head": 1, "n_query_groups": 1},
            },
            "n_head=1 and n_query_groups=1 must both divide by sequence_parallel=2",
        ),  # fmt: skip
        ({"trainer.strategy.init_args.num_subsequences": 100000}, "num_subsequences=100000 is larger than the"),
    ],
    ids=["pp-above-layers", "layers-per-stage", "sp-heads", "n-above-tokens"],
)
def test_setup_errors_are_one_line_from_the_strategy(tmp_path, changes, message):
    """Checked on every rank when the stage is built, or on rank 0 when it cuts the first batch (the others are
    told it failed and wait for its report): reported once, with its status, not masked by the teardown. The cut
    on rank 0 was reported by rank 1 as "failed with the RuntimeError above" and a traceback, exit status 1."""
    run = _sppo(tmp_path, "fit", "--config", str(_config(tmp_path, "setup", **changes)))
    assert run.returncode == 2, run.stderr[-3000:]
    errors = _errors(run)
    assert len(errors) == 1 and message in errors[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "meta tensor" not in run.stderr, run.stderr[-3000:]
    assert "Exception raised from" not in run.stderr, run.stderr[-3000:]  # no C++ trace of a closed store


def _slurm_ranks(tmp: Path, *args: str) -> list[subprocess.CompletedProcess]:
    """The command as `srun --ntasks 2` starts it: two processes at once, each told its rank by SLURM_PROCID
    and the world size by SLURM_NTASKS only (no WORLD_SIZE)."""
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "1",
             "SLURM_JOB_NAME": "sppo", "SLURM_NODELIST": "localhost"}  # fmt: skip
    command = [sys.executable, "-m", "lightning_sppo.training.cli", *args]
    outputs = [(tmp / f"rank{r}.out", tmp / f"rank{r}.err") for r in range(2)]
    ranks = []
    for r, (out, err) in enumerate(outputs):
        with out.open("w") as stdout, err.open("w") as stderr:
            env = _env(**slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))
            ranks.append(preloaded.Popen(command, cwd=tmp, env=env, stdout=stdout, stderr=stderr))
    codes = [p.wait(timeout=600) for p in ranks]
    return [subprocess.CompletedProcess(p.args, code, out.read_text(), err.read_text())
            for p, code, (out, err) in zip(ranks, codes, outputs, strict=True)]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model.learning_rat", "1e-3"), "did you mean --model.learning_rate?"),
        (("--trainer.strategy.init_args.pipeline_parallel", "3"), "must divide the world size 2"),
    ],
    ids=["misspelt-option", "layout"],
)
def test_a_settings_error_is_printed_once_when_every_rank_runs_the_command(tmp_path, args, message):
    """Under SLURM (or torchrun) every rank parses the same settings and fails alike: one report, every rank
    out with status 2."""
    ranks = _slurm_ranks(tmp_path, "fit", "--data.path", str(DATA), "--trainer.max_steps", "1", *args)
    assert [r.returncode for r in ranks] == [2, 2], [r.stderr[-2000:] for r in ranks]
    output = "".join(r.stdout + r.stderr for r in ranks)
    assert output.count(message) == 1 and output.count("sppo: error:") == 1, output[-3000:]
    assert "rank 0:" not in output and "Traceback" not in output, output[-3000:]


ONE_DEVICE = {"trainer.devices": 1, "trainer.strategy.init_args.pipeline_parallel": 1}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (ONE_DEVICE | {"data.path": "data/missing"}, "data.path='data/missing'"),
        (ONE_DEVICE | {"data.seq_len": 8192}, "data.seq_len=8192 is above the model's block_size=4096"),
        (
            ONE_DEVICE | {"model.model_overrides": {"vocab_size": 128}},
            "vocab_size=256, above the model's vocab_size=128",
        ),
        ({"trainer.strategy.init_args.pipeline_parallel": 3}, "pipeline_parallel * sequence_parallel = 3 * 1"),
        ({"trainer.strategy.init_args.pipline_parallel": 2}, "Option 'pipline_parallel' is not accepted"),
        ({"trainer.strategy.init_args.partition": "lenght"}, "Unknown partition='lenght'"),
    ],
    ids=["missing-data", "too-long", "vocabulary", "layout", "unknown-option", "bad-choice"],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, changes, message):
    result = _sppo(tmp_path, "fit", "--config", str(_config(tmp_path, "bad", **changes)))
    assert result.returncode == 2
    errors = _errors(result)
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_user_config_stands_alone_and_options_are_not_abbreviated(tmp_path):
    """Nothing of the demo under --config (--print_config shows the classes' defaults and the user's values);
    a misspelt option is an error, not a silent abbreviation."""
    minimal = {"trainer": {"max_steps": 7}, "model": {"model": "tiny"}, "data": {"path": "corpus", "seq_len": 32}}
    minimal["data"]["batch_size"] = 1
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(minimal))
    printed = _sppo(tmp_path, "fit", "--config", "mine.yaml", "--print_config")
    assert printed.returncode == 0, printed.stderr[-3000:]
    config = yaml.safe_load(printed.stdout)
    strategy = config["trainer"]["strategy"]  # SPPO's defaults, as a class: its init_args can be set on their own
    assert config["trainer"]["max_steps"] == 7 and strategy["class_path"] == "lightning_sppo.SPPOTrainerStrategy"
    # what the command adds is printed (issue 39): the default logger, the checkpoint callback, under the root
    assert config["trainer"]["logger"]["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    assert [c["class_path"] for c in config["trainer"]["callbacks"]][0] == "lightning_sppo.callbacks.SPPOCheckpoint"
    assert config["trainer"]["callbacks"][0]["init_args"]["dirpath"] == "./checkpoints"
    assert config["trainer"]["limit_train_batches"] is None and config["trainer"]["devices"] == "auto"
    assert config["model"]["learning_rate"] == 3e-4 and config["data"]["val_fraction"] == 0.0
    assert "demo" not in printed.stdout, printed.stdout
    misspelt = _sppo(tmp_path, "fit", "--config", "mine.yaml", "--model.learning_rat", "0.1")
    assert misspelt.returncode == 2
    assert _errors(misspelt) == [
        "sppo: error: unrecognized arguments: --model.learning_rat 0.1; did you mean --model.learning_rate?"
    ], misspelt.stderr[-3000:]


def _recipe(tmp: Path, out: str, *args: str, kill_at: int | None = None) -> subprocess.CompletedProcess:
    script = ROOT / ("tests/training/faults.py" if kill_at else "recipes/pretrain_fabric.py")
    overrides = ["--data.path", str(DATA), "--data.seq_len", "64", "--data.batch_size", "2",
                 "--strategy.num_subsequences", "2", "--train.max_steps", str(STEPS), "--train.save_interval", "10",
                 "--train.val_interval", "10", "--log.wandb_project", "null", "--out_dir", f"runs/{out}"]  # fmt: skip
    env = _env(**({"SPPO_TEST_KILL_AT": str(kill_at)} if kill_at else {}))
    command = [sys.executable, str(script), "--config", str(ROOT / "configs/fabric-demo-cpu.yaml"), *overrides, *args]
    return preloaded.run(command, cwd=tmp, env=env, timeout=600)


def _recipe_column(tmp: Path, out: str, key: str) -> dict[int, float]:
    with (tmp / "runs" / out / "metrics.csv").open() as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row[key]}  # the last row wins


def test_fabric_recipe_trains_to_the_cli_loss_curve_and_resumes_exactly(uninterrupted):
    tmp, reference = uninterrupted
    run = _recipe(tmp, "fabric")
    assert run.returncode == 0, run.stderr[-3000:]
    losses = _recipe_column(tmp, "fabric", "loss")
    cli = _column(reference, "train/loss")
    assert sorted(losses) == list(range(STEPS)), losses
    assert all(losses[s] == pytest.approx(cli[s], rel=1e-5) for s in cli), (losses, cli)
    assert _recipe_column(tmp, "fabric", "val_loss")[19] == pytest.approx(_column(reference, "val/loss")[19], rel=1e-6)
    assert sorted(p.name for p in (tmp / "runs/fabric/checkpoints").iterdir()) == ["step-000020", "step-000025"]

    killed = _recipe(tmp, "fabric-killed", kill_at=KILL_AT)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(p.name for p in (tmp / "runs/fabric-killed/checkpoints").iterdir()) == ["step-000010"]
    resumed = _recipe(tmp, "fabric-killed", "--resume", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step-000010 at step 10" in resumed.stdout, resumed.stdout[-2000:]
    again = _recipe_column(tmp, "fabric-killed", "loss")
    assert all(again[s] == losses[s] for s in range(10, STEPS)), [(s, again[s], losses[s]) for s in range(10, STEPS)]
