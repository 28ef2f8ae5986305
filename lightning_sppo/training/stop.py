"""Stopping a run on a signal: the step in flight is finished, every rank saves, and the exit status says why.

SIGINT (Ctrl-C), SIGTERM (a scheduler's preemption, ``scancel``, ``docker stop``, torchrun passing one on) and,
under SLURM with Lightning's auto-requeue, SLURM's pre-timeout signal (``--signal=USR1@90``) only set a flag while
training runs. At the end of every step the ranks agree, with one all-reduce of that flag, whether any of them was
signalled; if so, all of them stop after the same step, the checkpoint callback saves it (the checkpoint it writes at
every interval, resumable bit for bit, ``last`` relinked), and the run exits with 130 (SIGINT) or 143 (SIGTERM, and
SLURM's signal once the job is requeued) after one line: ``stopped at step N; continue with `--ckpt_path last```.
A signal may reach only some ranks (``kill PID``, a container's PID 1) or reach them during different steps: the
agreement is what keeps every rank on the same step, so that their shards make one checkpoint.

A second Ctrl-C ends the run at once, saying the checkpoint of the stop was not written (saves are atomic: the newest
complete checkpoint stays, and ``--ckpt_path last`` finds it); a repeated SIGTERM changes nothing. Outside training
(while the run is set up, or in ``sppo validate``) a signal interrupts as Python's Ctrl-C does, and the run ends with
one line and the same exit status: nothing was trained that a checkpoint could keep.

What the agreement costs: one all-reduce of one integer per step, on the host (the gloo group of
``object_group``, beside NCCL on GPUs): no CUDA synchronisation, no kernel; the ranks' host threads meet once per
step (a round trip between hosts), which the step's own collectives make them do already.

Lightning's own SIGTERM handler is not installed (``StopOnSignal.setup``): it calls a collective from inside the
handler (on whichever rank got the signal, in the middle of whatever collective that rank was in) and ends the run
with exit status 0 and no checkpoint, which a scheduler reads as success.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_sppo.strategy.state_gather import object_group
from lightning_sppo.training.failures import end_now, launching_rank_zero

__all__ = [
    "STOP",
    "StopOnSignal",
    "StopSignals",
    "end_of_run",
    "requeue_signal",
    "requeue_slurm_job",
    "signals_stop_the_run",
]

_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


class StopSignals:
    """This process's stop signals: which one arrived, whether the ranks agreed to stop, and at which step.

    One per process (``STOP``): signal handlers belong to the process. ``install`` at the start of a command,
    ``arm`` when training starts, ``agree`` at the end of every step (a collective), ``stopped`` once the run has
    ended, then ``exit_status``.
    """

    def __init__(self, program: str = "sppo", resume: str = "--ckpt_path last") -> None:
        self.program, self.resume = program, resume
        self.received = 0  # the first stop signal this process got (0: none)
        self.agreed = 0  # the signal every rank stops for, once they agreed (0: not stopping)
        self.step: int | None = None  # the step the run stopped after
        self.checkpoint: str | None = None  # the checkpoint of that step, once written
        self.requeue: int | None = None  # SLURM's pre-timeout signal, when SLURM requeues the job on it
        self._armed = False

    def install(self, program: str, resume: str) -> dict[int, Any]:
        """Handle SIGINT and SIGTERM from now on, as a new command (``program`` and ``resume``, its way to continue,
        name them in the lines it prints). In the main thread only, where Python runs handlers. Returns the handlers
        it replaced, for ``restore``."""
        vars(self).update(vars(StopSignals(program, resume)))  # nothing of an earlier command in this process
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self._handle) for signum in (signal.SIGINT, signal.SIGTERM)}

    def restore(self, handlers: dict[int, Any]) -> None:
        """Put back the handlers ``install`` replaced (a command run inside another program: a test, a notebook);
        SLURM's signal, if armed, goes back to its default."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in {**({self.requeue: signal.SIG_DFL} if self.requeue else {}), **handlers}.items():
            signal.signal(signum, handler)

    def arm(self, requeue: int | None = None) -> None:
        """Training runs: from now on a signal stops the run at the end of a step (until the process ends).
        ``requeue``: SLURM's pre-timeout signal, handled too (the job is requeued after the checkpoint). Installs
        the handlers again: the set-up may have replaced them (Lightning's Ctrl-C handling ignores SIGINT)."""
        self._armed = True
        self.requeue = requeue
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, *([requeue] if requeue else [])):
                signal.signal(signum, self._handle)

    def agree(self) -> bool:
        """Whether every rank stops after this step: some rank got a stop signal. A collective: every rank calls it
        at the same point of every step. Where ranks got different signals, SLURM's requeue wins over SIGTERM, and
        SIGTERM over SIGINT (the scheduler's intent over the user's)."""
        order = [signal.SIGINT, signal.SIGTERM, *([self.requeue] if self.requeue else [])]
        flag = torch.tensor([order.index(self.received) + 1 if self.received in order else 0], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=object_group())
        if int(flag):
            self.agreed = order[int(flag) - 1]
        return bool(self.agreed)

    def stopped(self, step: int, checkpoint: str | None) -> None:
        """The run stopped after ``step``; ``checkpoint``: the checkpoint written of it, if any."""
        self.step, self.checkpoint = step, checkpoint

    def exit_status(self) -> int:
        """130 after a stop for SIGINT, 143 for SIGTERM or SLURM's requeue signal, else 0."""
        if not self.agreed:
            return 0
        return 128 + signal.SIGINT if self.agreed == signal.SIGINT else 128 + signal.SIGTERM

    def final_line(self) -> str:
        """What the run says at its end after a stop (printed by the launching rank 0)."""
        why = _NAMES.get(self.agreed, f"SLURM's {signal.Signals(self.agreed).name}, the job requeued")
        if self.checkpoint is None:
            return (
                f"{self.program}: stopped at step {self.step} ({why}) without a checkpoint of it (checkpointing off, a"
                f" checkpoint callback other than SPPOCheckpoint, or a non-finite loss); `{self.resume}` continues from"
                " the newest one, if any."
            )
        return f"{self.program}: stopped at step {self.step}; continue with `{self.resume}` ({why}; {self.checkpoint})"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received:
            self._end_at_once()
        if self.received:
            return  # a repeated SIGTERM (or SLURM's signal): already stopping
        self.received = signum
        if not self._armed:
            raise KeyboardInterrupt  # not training: nothing to finish, and Lightning ends its ranks on this
        _say(
            f"{self.program}: {_NAMES.get(signum, f'signal {signum}')}: stopping after the step in flight, with a"
            " checkpoint" + (" (Ctrl-C again stops at once, without it)" if signum == signal.SIGINT else "")
        )

    @property
    def armed(self) -> bool:
        """Whether training has started (a signal stops at the end of a step rather than interrupting)."""
        return self._armed

    def _end_at_once(self) -> None:
        if not self._armed:
            done = "nothing was trained"
        elif self.checkpoint is not None:
            done = f"the checkpoint of step {self.step} was written ({self.checkpoint})"
        else:
            done = "the checkpoint of this step was not written; the newest complete one stays"
        _say(f"{self.program}: second Ctrl-C: stopped at once; {done}: continue with `{self.resume}`")
        end_now(128 + signal.SIGINT)


STOP = StopSignals()
"""This process's stop signals (a process has one set of signal handlers)."""


def _say(line: str) -> None:
    """One line on stderr from the launching rank 0, written directly: a handler may run while ``print`` is
    writing, and the buffered stream refuses a reentrant call."""
    if launching_rank_zero():
        os.write(2, (line + "\n").encode())


@contextmanager
def signals_stop_the_run(program: str, resume: str, stop: StopSignals = STOP) -> Iterator[StopSignals]:
    """The block is a command (``program``; ``resume``: how to continue it) that SIGINT and SIGTERM stop: ``stop``
    handles them inside it (``StopSignals.install``), and a signal outside training (``KeyboardInterrupt``, or
    Lightning's exit after one) ends the command with one line and the signal's exit status, since nothing had been
    trained that a checkpoint could keep. That end is at once (``os._exit``): the other ranks may be gone or
    blocked, so there is nothing to shut down in order."""
    handlers = stop.install(program, resume)
    try:
        yield stop
    except KeyboardInterrupt:
        if not stop.received:
            raise  # a KeyboardInterrupt of someone else's making
        _interrupted(stop)
    except SystemExit:
        if not stop.received or stop.armed:
            raise
        _interrupted(stop)  # Lightning's Ctrl-C handling ends with sys.exit(1)
    finally:
        stop.restore(handlers)


def _interrupted(stop: StopSignals) -> None:
    """One line, then out; the other ranks, once the processes have met, follow with the same status."""
    _say(
        f"{stop.program}: stopped by {_NAMES.get(stop.received, stop.received)} before a training step; nothing to save"
    )
    end_now(128 + stop.received)


def end_of_run(ranks_status: int, stop: StopSignals = STOP) -> None:
    """After ``shut_down``: a stopped run's line and exit status (the SLURM job requeued first, when that was the
    signal), or else the status of a rank this process started that failed (``ranks_status``); 0 returns."""
    if stop.agreed:
        if stop.agreed == stop.requeue and launching_rank_zero():
            requeue_slurm_job()
        _say(stop.final_line())
        sys.exit(stop.exit_status())
    if ranks_status:
        sys.exit(ranks_status)


class StopOnSignal(L.Callback):
    """The Trainer's side of ``STOP``: armed at the start of training, the agreement at the end of every step, and
    the stop as ``trainer.should_stop``, which the checkpoint callback saves at (``SPPOCheckpoint``). Also says, at
    a resume, which checkpoint and step the run continues from."""

    def __init__(self, stop: StopSignals = STOP) -> None:
        self.stop = stop

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Lightning installs its own SIGTERM handler when ``fit`` starts (after this hook): not on this Trainer."""
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            connector.register_signal_handlers = _keep_ours

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stop.arm(requeue_signal(getattr(trainer.strategy, "cluster_environment", None)))
        if trainer.ckpt_path is not None:
            path = os.path.realpath(trainer.ckpt_path)  # the checkpoint `last.ckpt` links to
            rank_zero_info(
                f"Resuming from {path}: step {trainer.global_step} done, continuing at step"
                f" {trainer.global_step + 1} (epoch {trainer.current_epoch})."
            )

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Before the checkpoint callbacks (Lightning runs them last): they see ``should_stop`` and save."""
        if not self.stop.agree():
            return
        trainer.should_stop = True
        trainer.limit_val_batches = 0  # Lightning validates before an early stop: not for a signal's deadline
        trainer.fit_loop.min_epochs = None  # nor does it stop before min_epochs/min_steps
        trainer.fit_loop.epoch_loop.min_steps = None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.stop.agreed:
            self.stop.stopped(trainer.global_step, _saved(trainer))


def _keep_ours() -> None:
    """In place of Lightning's ``_SignalConnector.register_signal_handlers`` (see the module's docstring)."""


def _saved(trainer: L.Trainer) -> str | None:
    """The checkpoint of the current step, if an ``SPPOCheckpoint`` wrote one."""
    from lightning_sppo.callbacks.checkpoint import SPPOCheckpoint

    for callback in trainer.checkpoint_callbacks:
        ours = isinstance(callback, SPPOCheckpoint) and callback.best_model_path
        if ours and int(callback.best_model_score) == trainer.global_step:
            return callback.best_model_path
    return None


def requeue_signal(environment: Any) -> int | None:
    """SLURM's pre-timeout signal when the job runs under SLURM with Lightning's auto-requeue (its default), else
    None: ``SLURMEnvironment(auto_requeue=False)`` turns it off, and ``requeue_signal`` names another signal."""
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        return int(environment.requeue_signal)
    return None


def requeue_slurm_job(environ: dict[str, str] | None = None) -> bool:
    """``scontrol requeue`` of this SLURM job (an array job's task), as Lightning's auto-requeue does; whether it
    worked (a failure is a warning: the checkpoint is written, the job can be submitted again)."""
    environ = os.environ if environ is None else environ
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{environ['SLURM_ARRAY_TASK_ID']}" if array_job else environ.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, env=dict(environ))
    except OSError as error:
        _say(f"could not requeue SLURM job {job}: {error}; submit it again to continue")
        return False
    if result.returncode != 0:
        _say(f"could not requeue SLURM job {job}: {result.stderr.strip()}; submit it again to continue")
    return result.returncode == 0
