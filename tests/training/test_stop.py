"""Every stop is a clean stop: SIGTERM and Ctrl-C in the middle of a real 2-process `sppo fit` (and of the Fabric
recipe) stop every rank after the same step with a checkpoint that resumes bit for bit, one line and exit status 143
or 130; a second Ctrl-C ends at once; and a run that finished exits 0 with no thread left running into Python.

Signals are real (the kernel delivers them to the processes), sent by ``tests.training.faults.SignalAt`` when a step
starts: to one rank only, or, as a terminal's Ctrl-C, to the whole process group, which reaches each rank wherever
it is. The runs are the demo config of ``test_cli`` (2 CPU processes, pp=2), 14 steps, checkpoints every 10.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests import preloaded
from tests.training.test_cli import DATA, ROOT, _column, _config, _env, _rows, _sppo

pytestmark = pytest.mark.slow  # every test runs 2-process commands

STEPS = 14
SIGNAL_AT = 6  # the signal arrives when step 6 starts (6 steps done): every rank stops after it, at step 7
STOPPED = SIGNAL_AT + 1


def _signal(**init_args) -> dict:
    return {"class_path": "tests.training.faults.SignalAt", "init_args": {"step": SIGNAL_AT} | init_args}


def _fit(tmp: Path, name: str, *args: str, callbacks: tuple = ()) -> subprocess.CompletedProcess:
    config = _config(tmp, name, callbacks=callbacks, **{"trainer.max_steps": STEPS})
    return _sppo(tmp, "fit", "--config", str(config), *args)


def _lines(run: subprocess.CompletedProcess, start: str) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith(start)]


def _checkpoints(tmp: Path, name: str) -> list[str]:
    return sorted(p.name for p in (tmp / "runs" / name / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The run that nothing stops: its losses are what every stopped and resumed run must give."""
    tmp = tmp_path_factory.mktemp("stop")
    run = _fit(tmp, "full")
    assert run.returncode == 0, run.stderr[-3000:]
    [rows] = _rows(tmp, "full")
    return tmp, _column(rows, "train/loss")


def _stopped_run_resumes_exactly(tmp: Path, name: str, reference: dict[int, float]) -> None:
    """The stop's checkpoint is the newest, `last` links to it, and `--ckpt_path last` says where it continues and
    gives the uninterrupted run's losses, bit for bit."""
    assert _checkpoints(tmp, name) == [f"epoch=0-step={STOPPED}.ckpt", "last.ckpt"]
    assert os.readlink(tmp / "runs" / name / "checkpoints" / "last.ckpt") == f"epoch=0-step={STOPPED}.ckpt"
    resumed = _fit(tmp, name, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [said] = [line for line in resumed.stderr.splitlines() if line.startswith("Resuming from")]
    assert said.endswith(
        f"epoch=0-step={STOPPED}.ckpt: step {STOPPED} done, continuing at step {STOPPED + 1} (epoch 0)."
    )
    losses = _column(_rows(tmp, name)[-1], "train/loss")
    assert sorted(losses) == list(range(STOPPED, STEPS)), losses
    assert all(losses[s] == reference[s] for s in losses), [(s, losses[s], reference[s]) for s in losses]


def test_sigterm_to_one_rank_stops_every_rank_after_the_step_with_a_checkpoint_and_exit_143(reference):
    """A scheduler's SIGTERM that reaches rank 1 only (rank 0 never sees it): both ranks agree to stop after the
    same step, save it, and exit 143 (it was 0, with no checkpoint, which a scheduler reads as success)."""
    tmp, losses = reference
    stopped = _fit(tmp, "sigterm", callbacks=(_signal(signal="SIGTERM", ranks=[1]),))
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    checkpoint = tmp / "runs/sigterm/checkpoints" / f"epoch=0-step={STOPPED}.ckpt"
    assert _lines(stopped, "sppo:") == [
        f"sppo: stopped at step {STOPPED}; continue with `--ckpt_path last` (SIGTERM; {checkpoint})"
    ], stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    _stopped_run_resumes_exactly(tmp, "sigterm", losses)


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_exit_130(reference):
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group, each rank wherever it is in its step."""
    tmp, losses = reference
    stopped = _fit(tmp, "sigint", callbacks=(_signal(signal="SIGINT", ranks=[0], group=True),))
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    checkpoint = tmp / "runs/sigint/checkpoints" / f"epoch=0-step={STOPPED}.ckpt"
    assert _lines(stopped, "sppo:") == [
        "sppo: SIGINT (Ctrl-C): stopping after the step in flight, with a checkpoint (Ctrl-C again stops at once,"
        " without it)",
        f"sppo: stopped at step {STOPPED}; continue with `--ckpt_path last` (SIGINT (Ctrl-C); {checkpoint})",
    ], stopped.stderr[-3000:]
    assert "KeyboardInterrupt" not in stopped.stderr and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    _stopped_run_resumes_exactly(tmp, "sigint", losses)


def test_a_second_ctrl_c_ends_at_once_and_says_the_checkpoint_was_not_written(tmp_path):
    """Ctrl-C twice during step 11: no checkpoint of the stop, the step-10 one stays the newest, status 130."""
    twice = {"class_path": "tests.training.faults.SignalAt",
             "init_args": {"step": 11, "signal": "SIGINT", "ranks": [0], "group": True, "repeat": 2}}  # fmt: skip
    run = _fit(tmp_path, "twice", callbacks=(twice,))
    assert run.returncode == 130, run.stderr[-3000:]
    assert _lines(run, "sppo:")[-1] == (
        "sppo: second Ctrl-C: stopped at once; the checkpoint of this step was not written; the newest complete one"
        " stays: continue with `--ckpt_path last`"
    ), run.stderr[-3000:]
    assert _checkpoints(tmp_path, "twice") == ["epoch=0-step=10.ckpt", "last.ckpt"]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


def _recipe(tmp: Path, out: str, *args: str, signal_at: str | None = None) -> subprocess.CompletedProcess:
    script = ROOT / ("tests/training/faults.py" if signal_at else "recipes/pretrain_fabric.py")
    overrides = ["--data.path", str(DATA), "--data.seq_len", "64", "--data.batch_size", "2",
                 "--strategy.num_subsequences", "2", "--train.max_steps", str(STEPS), "--train.save_interval", "10",
                 "--train.val_interval", "10", "--log.wandb_project", "null", "--out_dir", f"runs/{out}"]  # fmt: skip
    env = _env(**({"SPPO_TEST_SIGNAL_AT": signal_at} if signal_at else {}))
    command = [sys.executable, str(script), "--config", str(ROOT / "configs/fabric-demo-cpu.yaml"), *overrides, *args]
    return preloaded.run(command, cwd=tmp, env=env, timeout=600)


def _recipe_losses(tmp: Path, out: str) -> dict[int, float]:
    with (tmp / "runs" / out / "metrics.csv").open() as f:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(f)}  # the last row wins


def test_the_fabric_recipe_stops_on_sigterm_with_a_checkpoint_and_resumes_exactly(tmp_path):
    full = _recipe(tmp_path, "full")
    assert full.returncode == 0, full.stderr[-3000:]
    stopped = _recipe(tmp_path, "stopped", signal_at=f"{SIGNAL_AT}:SIGTERM:1")  # rank 1 only
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    checkpoint = tmp_path / "runs/stopped/checkpoints" / f"step-{STOPPED:06d}"
    assert _lines(stopped, "pretrain_fabric:") == [
        f"pretrain_fabric: stopped at step {STOPPED}; continue with `--resume true` (SIGTERM; runs/stopped/checkpoints/"
        f"{checkpoint.name})"
    ], stopped.stderr[-3000:]
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [checkpoint.name]
    resumed = _recipe(tmp_path, "stopped", "--resume", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{checkpoint.name} at step {STOPPED}" in resumed.stdout, resumed.stdout[-2000:]
    expected, losses = _recipe_losses(tmp_path, "full"), _recipe_losses(tmp_path, "stopped")
    assert all(losses[s] == expected[s] for s in range(STEPS)), [(s, losses[s], expected[s]) for s in range(STEPS)]


# -- a run that finished ends cleanly ---------------------------------------------------------------------------

_WATCHER_AT_EXIT = """
import atexit, sys, threading, time
import torch.distributed as dist
from lightning_sppo.training import failures
rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, is_master=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
del store
failures._POLL_S = 0.0  # the watcher inside a store call nearly all the time: the race, made certain
failures.watch_peers()
time.sleep(0.5)
if mode == "left-running":
    atexit.unregister(failures.stop_watching_peers)  # neither the shutdown nor its exit-hook safety net
"""


@pytest.mark.parametrize("mode", ["left-running", "exit-hook"])
def test_the_peer_watcher_left_running_at_exit_aborts_the_process_and_its_exit_hook_stops_it(tmp_path, mode):
    """The cause of "terminate called without an active exception" (SIGABRT) after a finished 2-process fit: the
    peer watcher, a daemon thread inside a store call (C++) when the interpreter finalizes. Left running (the
    negative control), it aborts; its exit hook, the safety net for ways out that skip the shutdown (which stops it
    first: the next test), stops it. Fresh interpreters: a process forked from the preloaded server skips the
    finalization."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # held here: no port race
    command = [sys.executable, "-c", _WATCHER_AT_EXIT]
    ranks = [
        subprocess.Popen(
            [*command, str(r), str(server.port), mode], env=_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True
        )  # fmt: skip
        for r in (0, 1)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in ranks]
    if mode == "left-running":
        assert any(code == -6 and "terminate called" in err for code, err in results), results
    else:
        assert all(code == 0 and "terminate called" not in err for code, err in results), results


def test_a_finished_run_exits_0_with_no_thread_left_running_each_time_under_load(tmp_path):
    """A short demo fit (2 fresh interpreters; W&B offline and CSV, then resumed for one more step twice, CSV only),
    beside a CPU hog: exit 0, no abort message, and once the command returns (before the watcher's exit hook) no
    thread but the main one is left on either rank (Lightning's observer of the ranks it started may still be
    asleep: pure Python, given nothing to watch): neither the peer watcher nor W&B's."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], env=_env())
    try:
        for attempt in range(3):
            changes = {"trainer.max_steps": 2 + attempt, "trainer.val_check_interval": 2}
            config = _config(tmp_path, "finished", wandb=attempt == 0, **changes)
            prefix = tmp_path / f"threads-{attempt}"
            command = [sys.executable, str(ROOT / "tests/training/exit_probe.py"), "fit", "--config", str(config)]
            run = subprocess.run([*command, *(["--ckpt_path", "last"] if attempt else [])], cwd=tmp_path,
                                 env=_env(SPPO_TEST_THREADS_AT_EXIT=str(prefix)), capture_output=True, text=True,
                                 timeout=600)  # fmt: skip
            assert run.returncode == 0, run.stderr[-3000:]
            assert "terminate called" not in run.stderr, run.stderr[-3000:]
            for rank in (0, 1):
                threads = json.loads(Path(f"{prefix}.{rank}").read_text())["python"]
                assert set(threads) <= {"child-process-observer"}, (attempt, rank, threads)
    finally:
        hog.kill()
        hog.wait()
