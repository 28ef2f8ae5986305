"""What the ``sppo`` command settles before it builds anything: the settings a run cannot start with (one line
each, naming the option), where ``--ckpt_path`` resumes from and whether that checkpoint is the model asked for,
and the process-wide defaults a CPU or GPU run should have.

* ``trainer.accelerator`` asking for a GPU that is not there, and a ``trainer.default_root_dir`` that cannot be
  a folder, stop here rather than in Lightning's set-up (its messages name no setting, or none at all).
* ``--ckpt_path``: ``last`` is the newest complete checkpoint of the run's checkpoint folder (said, and a fresh
  start, when there is none yet: a job that always passes ``--ckpt_path last`` starts and resumes alike); a path
  must be a complete checkpoint; the architecture it records must be the one the settings ask for (else a
  resume would silently train the checkpoint's model, since Lightning's CLI applies a checkpoint's
  hyper-parameters over the command line: ``SPPOCLI`` does not). ``block_size`` may differ (it sizes no weight).
* A fresh ``fit`` refuses a checkpoint folder holding an earlier run's checkpoints (``SPPOCheckpoint``).
* The strategy's ``pipeline_parallel`` and ``sequence_parallel`` against the model and the world size the trainer
  settings give (``check_layout``), so that the values an error suggests are ones that run.
* Trainer values Lightning takes but cannot run (``val_check_interval: 0``), and Lightning's own refusals of
  ``trainer.accelerator``, ``devices``, ``num_nodes`` and ``strategy`` (plain exceptions, with a traceback), are one
  line naming the ``trainer.`` setting; a ``--ckpt_path`` file without Trainer state points to ``--model.init_from``.
* On CPU, one intra-op thread per process unless ``OMP_NUM_THREADS`` says otherwise; on a GPU with mixed
  precision, TF32 for the few float32 matmuls outside autocast (``torch.set_float32_matmul_precision("high")``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sppo.callbacks.checkpoint import SPPOCheckpoint, earlier_run_error
from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.model import GPTConfig
from lightning_sppo.parallel.dims import ParallelDims
from lightning_sppo.strategy.checkpoint_files import is_complete, newest_complete_checkpoint

__all__ = [
    "architecture_difference",
    "check_accelerator",
    "check_layout",
    "check_trainer_values",
    "check_root",
    "check_resume",
    "checkpoint_folder",
    "class_entries",
    "cpu_threads",
    "float32_matmul_precision",
    "fresh_run_folder_error",
    "is_subclass",
    "resolve_ckpt_path",
    "trainer_setting_error",
]

_GPU_ACCELERATORS = ("gpu", "cuda")
_MIXED = ("16-mixed", "bf16-mixed", "16", "bf16", "16-true", "bf16-true")
_FREE_FIELDS = ("name", "block_size")  # fields a resume may change: no weight depends on them


def check_accelerator(trainer: Namespace) -> None:
    accelerator = trainer.get("accelerator")
    if isinstance(accelerator, str) and accelerator in _GPU_ACCELERATORS and not torch.cuda.is_available():
        raise SPPOConfigError(
            f"trainer.accelerator={accelerator!r} but torch sees no CUDA GPU (torch.cuda.is_available() is False:"
            f" no GPU, no driver, or a CPU build of torch {torch.__version__}); use trainer.accelerator: cpu or auto."
        )


def check_trainer_values(trainer: Namespace) -> None:
    """Trainer values Lightning accepts but cannot run: an integer ``val_check_interval`` or a
    ``check_val_every_n_epoch`` below 1 (a division by zero in the training loop)."""
    every = trainer.get("check_val_every_n_epoch")
    if isinstance(every, int) and not isinstance(every, bool) and every < 1:
        raise SPPOConfigError(
            f"trainer.check_val_every_n_epoch={every} must be a positive number of epochs, or null to validate by"
            " trainer.val_check_interval alone; e.g. trainer.check_val_every_n_epoch: 1."
        )
    interval = trainer.get("val_check_interval")
    if isinstance(interval, int) and not isinstance(interval, bool) and interval < 1:
        raise SPPOConfigError(
            f"trainer.val_check_interval={interval} must be a positive number of batches, or a fraction of an epoch"
            " in (0.0, 1.0]; e.g. trainer.val_check_interval: 100."
        )


def check_layout(trainer: Namespace, config: GPTConfig) -> None:
    """``trainer.strategy.init_args``' pipeline_parallel and sequence_parallel against ``config`` and the world size
    of ``trainer.devices`` x ``trainer.num_nodes``, before any process starts: one line whose suggested values fit
    both (a value that fits the world alone, pp=3 for 3 processes and a 2-layer model, failed on the next run).
    Skipped where the world size is not known from the settings (``devices: auto`` on a GPU) or a size is left
    to the planner."""
    entry = trainer.get("strategy")
    init = entry.get("init_args") if isinstance(entry, Namespace) else None
    pp = init.get("pipeline_parallel", 1) if init is not None else 1
    sp = init.get("sequence_parallel", 1) if init is not None else 1
    world = world_size(trainer)
    if world is None or not isinstance(pp, int) or not isinstance(sp, int) or pp < 1 or sp < 1:
        return
    try:
        ParallelDims.from_world(world, pp, sp, config)
    except ValueError as error:
        devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
        raise SPPOConfigError(
            f"trainer.strategy.init_args: {str(error).rstrip('.')} (world size {world}: trainer.devices={devices!r}"
            f" x trainer.num_nodes={nodes!r})."
        ) from error


def world_size(trainer: Namespace) -> int | None:
    """Processes the trainer settings ask for (devices per node x nodes), or None where only Lightning's set-up
    can tell (``devices: auto`` or -1 on a GPU machine)."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    accelerator = trainer.get("accelerator")
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())
    if isinstance(devices, str):  # Lightning's "2" (a count) and "0,1" (device indices)
        text = devices.strip()
        if text.lstrip("-").isdigit():
            devices = int(text)
        elif "," in text:
            devices = [d for d in text.split(",") if d.strip()]
    if isinstance(devices, bool) or not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        return None
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    elif devices in ("auto", None) and on_cpu:
        count = 1  # Lightning's CPU accelerator: one process
    else:
        return None
    return count * nodes


_LIGHTNING_SETTING = re.compile(r"`(?:Trainer\()?(accelerator|devices|num_nodes|strategy|precision)\b")
_CONNECTOR_FILES = ("accelerator_connector.py", "device_parser.py", f"accelerators{os.sep}")


def trainer_setting_error(error: BaseException, trainer: dict[str, Any]) -> SPPOConfigError | None:
    """Lightning's refusal of a ``Trainer`` argument while it picks the accelerator, devices, nodes, strategy and
    precision (a plain ``ValueError``, ``TypeError`` or ``ImportError`` of its accelerator connector) as one line
    naming ``trainer.<argument>``; None for any other error (a bug keeps its traceback)."""
    if not isinstance(error, (ValueError, TypeError, ImportError)) or error.__traceback__ is None:
        return None
    frame = error.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    where = frame.tb_frame.f_code.co_filename
    if f"lightning{os.sep}" not in where or not any(part in where for part in _CONNECTOR_FILES):
        return None
    message = " ".join(str(error).split())
    named = _LIGHTNING_SETTING.search(message)
    setting = named.group(1) if named else "accelerator"  # e.g. a missing package for trainer.accelerator=tpu
    return SPPOConfigError(f"trainer.{setting}={trainer.get(setting)!r}: {message}")


def check_root(root: str) -> None:
    """``trainer.default_root_dir`` must be a folder this process can create."""
    path = Path(root)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            raise SPPOConfigError(
                f"trainer.default_root_dir={root!r}: {str(parent)!r} is a file, not a folder; choose another"
                " trainer.default_root_dir."
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SPPOConfigError(f"trainer.default_root_dir={root!r} cannot be created: {error}.") from error


def checkpoint_folder(trainer: Namespace, root: str) -> str | None:
    """The folder of the run's ``SPPOCheckpoint`` (the one the command adds when the config lists no checkpoint
    callback: ``root/checkpoints``); None when checkpointing is off or only other callbacks save."""
    if trainer.get("enable_checkpointing") is False:
        return None
    savers = [c for c in class_entries(trainer.get("callbacks")) if is_subclass(c, ModelCheckpoint)]
    if not savers:
        return os.path.join(root, "checkpoints")
    ours = [c for c in savers if is_subclass(c, SPPOCheckpoint)]
    return (ours[0].get("init_args") or Namespace()).get("dirpath") if ours else None


def resolve_ckpt_path(
    ckpt_path: str | None, folder: str | None, say: Callable[[str], None] = rank_zero_info
) -> str | None:
    """``ckpt_path`` as the run will use it: ``last`` -> the newest complete checkpoint of ``folder`` (None, with
    a line given to ``say`` when there is none yet); a path is checked (exists, complete)."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        if folder is None:
            return ckpt_path  # only Lightning's own checkpoint callbacks: Lightning resolves it
        newest = newest_complete_checkpoint(folder)
        if newest is None:
            say(
                f"ckpt_path=last: no checkpoint in {folder} yet, so training starts from step 0; later runs with"
                " --ckpt_path last resume from the newest checkpoint there."
            )
        return None if newest is None else ckpt_path
    path = Path(ckpt_path)
    if not path.exists():
        beside = _newest_beside(path)
        raise SPPOConfigError(
            f"ckpt_path={ckpt_path!r} does not exist; give a checkpoint file or folder of this project, or"
            f" --ckpt_path last for the newest in the run's checkpoint folder{beside}."
        )
    if path.is_dir() and not any(path.glob("*.distcp")):
        raise SPPOConfigError(
            f"ckpt_path={ckpt_path!r} is a folder but not a checkpoint of this project (no meta.pt, no shards);"
            " give a checkpoint file or folder, or --ckpt_path last for the newest in the run's checkpoint folder."
        )
    if not is_complete(path):
        raise SPPOConfigError(
            f"ckpt_path={ckpt_path!r} is not a complete checkpoint (cut short by a full disk, a kill or a partial"
            f" copy){_newest_beside(path)}; resume from a complete one (--ckpt_path last picks the newest)."
        )
    return ckpt_path


def _newest_beside(path: Path) -> str:
    newest = newest_complete_checkpoint(path.parent) if path.parent.is_dir() else None
    return f"; the newest complete checkpoint there is {str(newest)!r}" if newest is not None else ""


def check_resume(path: Path, asked: GPTConfig, model: Namespace) -> None:
    """Stop when the checkpoint at ``path`` records another architecture than ``asked``: one line naming both,
    and the two ways on (resume the checkpoint's model, or take its weights alone with ``--model.init_from``)."""
    from lightning_sppo.model.export import checkpoint_meta, resolve_config

    try:
        meta = checkpoint_meta(path)
    except FileNotFoundError:
        return
    if path.is_file() and "pytorch-lightning_version" not in meta:
        raise SPPOConfigError(
            f"ckpt_path={str(path)!r} is not a checkpoint of an `sppo fit` run (no Trainer state: step, optimizer,"
            " loops; a Fabric or plain torch.save file?), so --ckpt_path cannot load it; start a new run from its"
            f" weights with --model.init_from {path} in place of --ckpt_path, or give a checkpoint `sppo fit` wrote."
        )
    try:
        saved = resolve_config(meta, source=path)
    except SPPOConfigError:  # records no architecture: the load compares shapes instead
        return
    differences = architecture_difference(saved, asked)
    if not differences:
        return
    theirs = ", ".join(f"{k}={getattr(saved, k)!r}" for k in differences[:4])
    ours = ", ".join(f"{k}={getattr(asked, k)!r}" for k in differences[:4])
    how = (
        f"model.model: {saved.name}" if saved.name in GPTConfig.available() else "the model settings it was saved with"
    )
    raise SPPOConfigError(
        f"The checkpoint {path} (--ckpt_path) is of {saved.name or 'a custom model'!r} ({theirs}), but the settings ask"
        f" for {_asked_name(asked, model)!r} ({ours}); resume it with its own architecture ({how}), or start a new"
        f" run from its weights alone with --model.init_from {path} in place of --ckpt_path (model.model_overrides on"
        " top)."
    )


def _asked_name(asked: GPTConfig, model: Namespace) -> str:
    return asked.name or str(model.get("init_from") or model.get("model"))


def architecture_difference(saved: GPTConfig, asked: GPTConfig) -> list[str]:
    """The ``GPTConfig`` fields whose values differ, but those a resume may change (``block_size``, ``name``)."""
    theirs, ours = saved.to_dict(), asked.to_dict()
    return [k for k in ours if k not in _FREE_FIELDS and theirs.get(k) != ours[k]]


def fresh_run_folder_error(folder: str | None) -> str | None:
    """A fresh ``fit`` writing into a folder of an earlier run's checkpoints (see ``SPPOCheckpoint``)."""
    return earlier_run_error(folder, "--ckpt_path")


def cpu_threads(trainer: Namespace, environ: dict[str, str] | None = None) -> int | None:
    """On a CPU run, one intra-op thread per process unless ``OMP_NUM_THREADS`` is set; returns what it set.

    torch's default is one thread per core in every process. The CPU runs this command is for (the demo, small
    models, tests) gain nothing from more, and lose much when the cores are busy: OpenMP's threads spin against
    each other and against other processes. The README's minimal config (``benchmarks/cpu_threads.py``, 2 cores
    under a load average of 8-18): 8.95 steps/s with one thread, 0.39 with torch's default of two (medians of 3).
    """
    environ = os.environ if environ is None else environ
    accelerator = trainer.get("accelerator")
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())
    if not on_cpu or "OMP_NUM_THREADS" in environ:
        return None
    torch.set_num_threads(1)
    return 1


def float32_matmul_precision(trainer: Namespace) -> str | None:
    """With mixed precision on a GPU, TF32 for float32 matmuls (those outside autocast): Lightning otherwise prints
    its ``set_float32_matmul_precision`` tip on every run. A float32 run keeps full precision (and the tip)."""
    precision = str(trainer.get("precision") or "")
    if precision not in _MIXED or not torch.cuda.is_available() or trainer.get("accelerator") == "cpu":
        return None
    if torch.get_float32_matmul_precision() == "highest":
        torch.set_float32_matmul_precision("high")
    return torch.get_float32_matmul_precision()


def class_entries(value: Any) -> list[Namespace]:
    """The class entries (``class_path``/``init_args``) of a logger or callbacks setting."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, Namespace) and v.get("class_path")]


def is_subclass(entry: Namespace, base: type) -> bool:
    """Whether a class entry names a subclass of ``base`` (False for a class that cannot be imported: jsonargparse
    reports that one)."""
    module, _, name = entry.class_path.rpartition(".")
    try:
        cls = getattr(import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, base)
