"""``sppo fit --print_config``: the config that runs, not only the one given.

jsonargparse prints the parsed settings, in which a config without callbacks reads ``callbacks: null`` although
``sppo`` adds its checkpoint callback, ``logger: null`` although Lightning makes a default logger, and empty
``save_dir`` / ``dirpath`` values that the command places under ``trainer.default_root_dir``. Here the printed config
holds what the run will build (``sppo`` re-parses it, so every entry has its full ``init_args``), and comments above
it say which of ``model.model`` and ``model.init_from`` decides the architecture, what ``sppo`` adds that is not a
setting, and where the planner's predictions come from. Printed as is, it trains as the settings it was printed from.
"""

from __future__ import annotations

import importlib.util
import json
import re
from importlib import import_module
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.model import GPTConfig
from lightning_sppo.training.model_source import model_config, start_line

__all__ = [
    "PRINT_CONFIG",
    "added_callbacks",
    "default_logger",
    "print_request",
    "printed_config",
    "tensorboard_installed",
]

PRINT_CONFIG = "--print_config"
_FLAGS = {"": None, "skip_default": "skip_default", "skip_unset": "skip_unset", "skip_null": "skip_unset"}
CHECKPOINT = "lightning_sppo.callbacks.SPPOCheckpoint"
PROGRESS_BAR = "lightning_sppo.training.progress.SPPOProgressBar"


def print_request(args: list[str]) -> tuple[list[str], dict[str, bool] | None]:
    """``args`` without ``--print_config[=flags]``, and the dump options its flags ask for (None: not asked)."""
    rest, flags = [], None
    for arg in args:
        if arg == PRINT_CONFIG or arg.startswith(PRINT_CONFIG + "="):
            given = arg.partition("=")[2].split(",")
            unknown = [flag for flag in given if flag not in _FLAGS]
            if unknown:
                raise SPPOConfigError(
                    f"{PRINT_CONFIG}={arg.partition('=')[2]}: unknown flag {unknown[0]!r}; flags: skip_default,"
                    " skip_unset (e.g. --print_config=skip_default)"
                )
            flags = {"skip_unset": False} | {_FLAGS[flag]: True for flag in given if _FLAGS[flag]}
        else:
            rest.append(arg)
    return rest, flags


def tensorboard_installed() -> bool:
    """Whether Lightning's default logger is TensorBoard's (it is when either package is installed)."""
    return any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


def default_logger(trainer: dict[str, Any], root: str) -> dict[str, Any] | None:
    """The logger a run without one gets (``logger`` unset or true): Lightning's TensorBoard logger where
    TensorBoard is installed, else the CSV logger ``sppo`` makes in its place; None when the settings name one."""
    if trainer.get("logger") not in (None, True):
        return None
    if tensorboard_installed():
        return {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": root}}
    return {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": root}}


def added_callbacks(trainer: dict[str, Any]) -> list[dict[str, Any]]:
    """The callbacks ``sppo`` adds to a config's (``SPPOCLI._instantiate_trainer``): its checkpoint callback unless
    checkpointing is off or a checkpoint callback is listed, its progress bar unless the bar is off or one is
    listed."""
    given = trainer.get("callbacks") or []
    given = given if isinstance(given, list) else [given]
    added = []
    if trainer.get("enable_checkpointing") is not False and not any(_names(c, ModelCheckpoint) for c in given):
        added.append({"class_path": CHECKPOINT})
    bar = trainer.get("enable_progress_bar") is not False and not any(_names(c, ProgressBar) for c in given)
    if bar and _RICH_AVAILABLE:
        added.append({"class_path": PROGRESS_BAR})
    return added


def _names(entry: Any, base: type) -> bool:
    """Whether a callback entry of a dumped config (a class path, or a dict with one) names a subclass of ``base``."""
    path = entry.get("class_path") if isinstance(entry, dict) else entry
    module, _, name = str(path).rpartition(".")
    try:
        cls = getattr(import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, base)


def printed_config(parser: Any, config: Namespace, dump_options: dict[str, bool], place: Any) -> str:
    """The YAML ``--print_config`` prints: ``config`` with what the run adds made explicit, re-parsed by ``parser``
    (full ``init_args``), outputs placed by ``place(trainer, root)`` as the run places them, and the comments of
    the module docstring."""
    settings = json.loads(parser.dump(config, format="json", skip_validation=True, skip_unset=False))
    trainer = settings.setdefault("trainer", {})
    root = trainer.get("default_root_dir") or "."
    extra = added_callbacks(trainer)
    if extra:
        given = trainer.get("callbacks") or []
        trainer["callbacks"] = [*(given if isinstance(given, list) else [given]), *extra]
    if (logger := default_logger(trainer, root)) is not None:
        trainer["logger"] = logger
    full = parser.parse_object(settings)
    place(full.trainer, root)
    text = parser.dump(full, skip_validation=True, **dump_options)
    return _comments(config, root) + _annotated(text, config)


def _comments(config: Namespace, root: str) -> str:
    model = config.model
    try:
        asked = model_config(model.model, model.get("model_overrides"), model.get("init_from"))
    except SPPOConfigError as error:  # e.g. the placeholder of a shipped config: the run would stop with this line
        asked, line = None, f"Model: not known yet; a run would stop here: {error}"
    else:
        ckpt = config.get("ckpt_path")
        overrides, init_from = model.get("model_overrides"), model.get("init_from")
        line = start_line(asked, model.model, overrides, init_from, ckpt and str(ckpt))
    lines = [
        "# What `sppo` runs with these settings (this config, run as printed, trains the same):",
        f"# {line}",
        f"# Outputs under trainer.default_root_dir ({root}): the loggers' folders and checkpoints/ (a checkpoint"
        " callback's dirpath, where unset).",
        "# Added, not settings: fail-fast error handling across ranks (FailFast) and the run's settings, layout and"
        " planner choices in every logger (LogRunSettings).",
        f"# {_planner_line(config, asked)}",
    ]
    return "\n".join(lines) + "\n"


def _planner_line(config: Namespace, asked: GPTConfig | None) -> str:
    """Where the planner's choices and predictions show: its line when the run starts, or ``sppo-plan`` now."""
    strategy = config.trainer.get("strategy")
    init = strategy.get("init_args") if isinstance(strategy, Namespace) else None
    auto = init is None or init.get("num_subsequences", "auto") == "auto" or init.get("pipeline_parallel", 1) is None
    when = (
        "chosen by the planner when training starts (its 'SPPO planner: ...' line gives each choice with its predicted"
        " memory and step time)"
        if auto
        else "as set above"
    )
    named = config.model.get("model")
    name = asked.name if asked is not None and asked.name in GPTConfig.available() else None
    if name is None and config.model.get("init_from") and named in GPTConfig.available() and named != "tiny":
        name = named  # a shipped config names the registered model its init_from folder holds
    if name is not None:
        plan = f"sppo-plan --model {name} --seq-len {config.data.get('seq_len')}"
        if asked is not None and asked.block_size != GPTConfig.from_name(name).block_size:
            plan += f" --block-size {asked.block_size}"
        plan += " --gpus-per-node G --gpu PROFILE"
    else:
        plan = "sppo-plan --model NAME (a registered model of this architecture's size) --seq-len S --gpu PROFILE"
    return f"Layout and subsequences: {when}; predictions for your GPUs before you run: {plan}."


_MODEL_LINE = re.compile(r"^(model:\n(?:  .*\n)*?)(  model: .*)$", re.MULTILINE)
_INIT_FROM_LINE = re.compile(r"^(model:\n(?:  .*\n)*?)(  init_from: .*)$", re.MULTILINE)


def _annotated(text: str, config: Namespace) -> str:
    """``model.model`` and ``model.init_from`` each say whether they decide the architecture."""
    if config.model.get("init_from"):
        text = _MODEL_LINE.sub(r"\1\2  # ignored: model.init_from decides the architecture", text, count=1)
        return _INIT_FROM_LINE.sub(r"\1\2  # decides the architecture (and the initial weights)", text, count=1)
    return _MODEL_LINE.sub(r"\1\2  # decides the architecture (model.init_from is unset)", text, count=1)
