"""The `sppo` command: LightningCLI over GPTPretraining and TokenDataModule.

    sppo fit                                              # the demo (configs/demo-cpu.yaml): 2 CPU processes, pp=2
    sppo fit --config my.yaml                             # my.yaml alone, over the classes' defaults
    sppo fit --config my.yaml --ckpt_path last            # resume from the newest complete checkpoint
    sppo validate --config my.yaml --ckpt_path last       # val/loss and val/ppl of a checkpoint
    sppo fit --config configs/gpt-7b-1m.yaml              # on a cluster (torchrun / SLURM), every node

Without ``--config`` the demo config is the defaults; with one, nothing of the demo applies. Loggers whose
``save_dir`` is unset, "" or "." (CSV and TensorBoard loggers require one: write "") and checkpoint callbacks
without a ``dirpath`` write under ``trainer.default_root_dir``; a W&B
logger gets a run id kept beside its files, so ``--ckpt_path`` continues the same W&B run. Options must be
spelled out (no abbreviations). Mistakes in the settings end with one ``sppo: error: ...`` line and exit
status 2; bugs keep their traceback (``lightning_sppo.training.failures``). What is settled before anything is
built (``--ckpt_path``, a used checkpoint folder, the accelerator, CPU threads) is in ``run_checks``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import string
import sys
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError, Namespace
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from typing_extensions import override

from lightning_sppo.callbacks.checkpoint import SPPOCheckpoint
from lightning_sppo.data import TokenDataModule
from lightning_sppo.errors import SPPOConfigError, config_errors
from lightning_sppo.model import GPTConfig
from lightning_sppo.quiet import quiet_dependencies
from lightning_sppo.strategy import SPPOConfig, SPPOTrainerStrategy
from lightning_sppo.strategy.checkpoint_files import newest_complete_checkpoint
from lightning_sppo.strategy.safe_load import check_weights_only
from lightning_sppo.training.failures import FailFast, exit_on_failure, launching_rank_zero, specific_line
from lightning_sppo.training.log_folders import DropUnusedLogFolders
from lightning_sppo.training.model_source import model_config, start_line
from lightning_sppo.training.module import GPTPretraining
from lightning_sppo.training.printed_config import print_request, printed_config, tensorboard_installed
from lightning_sppo.training.progress import SPPOProgressBar
from lightning_sppo.training.run_checks import (
    check_accelerator,
    check_layout,
    check_resume,
    check_root,
    check_trainer_values,
    checkpoint_folder,
    class_entries,
    cpu_threads,
    float32_matmul_precision,
    fresh_run_folder_error,
    is_subclass,
    resolve_ckpt_path,
    trainer_setting_error,
)
from lightning_sppo.training.run_settings import LogRunSettings
from lightning_sppo.training.shutdown import shut_down
from lightning_sppo.training.stop import StopOnSignal, end_of_run, signals_stop_the_run
from lightning_sppo.training.suggest import known_options, suggestion

__all__ = [
    "DEFAULT_STRATEGY",
    "DEMO_CONFIG",
    "SPPOCLI",
    "check_strategy_settings",
    "main",
    "pin_wandb_runs",
    "place_outputs",
    "wandb_run_id",
]

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo-cpu.yaml"
"""The defaults of ``sppo fit`` / ``sppo validate`` without ``--config`` (in a checkout of the repository)."""
DEFAULT_STRATEGY = {"class_path": "lightning_sppo.SPPOTrainerStrategy"}
"""A config without a strategy trains with SPPO's defaults; named as a class, not as "sppo", so that
``--trainer.strategy.init_args.X`` works on its own (jsonargparse refuses init_args for a registered name)."""
WANDB_RUN_ID_FILE = "wandb-run-id"
"""Beside a W&B logger's files (in its ``save_dir``): the id of the run that ``--ckpt_path`` continues."""


class SPPOCLI(LightningCLI):
    """``fit`` and ``validate`` over ``GPTPretraining`` and ``TokenDataModule``, with the run's outputs placed
    under ``trainer.default_root_dir``, fail-fast error handling and the run's settings in every logger."""

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate")}

    @override
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("trainer.max_steps", "model.max_steps")

    @override
    def parse_arguments(self, parser, args) -> None:
        """An unknown option or config key ends with the closest known one: ``did you mean ...?``. With
        ``--print_config``, the config that runs is printed (``printed_config``), and the command ends."""
        if args is None:  # the command line: a Lightning launcher's other ranks re-run sys.argv
            sys.argv[1:], dump_options = print_request(sys.argv[1:])
        else:
            args, dump_options = print_request(list(args))
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as error:
            hint = suggestion(str(error), known_options(self._subcommand_parsers.values(), SPPOTrainerStrategy))
            if hint is None:
                raise
            raise ArgumentError(None, f"{specific_line(error)}; {hint}") from error
        if dump_options is not None:
            subcommand = self.config["subcommand"]
            text = printed_config(self._parser(subcommand), self.config[subcommand], dump_options, place_outputs)
            sys.stdout.write(text)
            sys.exit(0)

    @override
    def _parse_ckpt_path(self) -> None:
        """Nothing: Lightning's CLI would apply the checkpoint's hyper-parameters over the command line (a resume
        with ``--model.model small`` trained the checkpoint's ``tiny``); ``before_instantiate_classes`` checks the
        checkpoint against the settings instead."""

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        check_weights_only(
            config.get("weights_only")
        )  # Lightning would not even pass it on (the restore is after setup)
        check_accelerator(config.trainer)
        check_trainer_values(config.trainer)
        check_strategy_settings(config.trainer)
        root = str(config.trainer.get("default_root_dir") or os.getcwd())
        check_root(root)
        place_outputs(config.trainer, root)
        folder = checkpoint_folder(config.trainer, root)
        notes: list[str] = []  # said after the run's first line
        config.ckpt_path = resolve_ckpt_path(config.get("ckpt_path"), folder, notes.append)
        asked = model_config(config.model.model, config.model.get("model_overrides"), config.model.get("init_from"))
        check_layout(config.trainer, asked)
        target = None
        if config.ckpt_path is not None:
            target = newest_complete_checkpoint(folder) if config.ckpt_path == "last" and folder else config.ckpt_path
            if target != "last":
                check_resume(Path(target), asked, config.model)
        elif self.subcommand == "fit" and (problem := fresh_run_folder_error(folder)) is not None:
            raise SPPOConfigError(problem)
        cpu_threads(config.trainer)
        float32_matmul_precision(config.trainer)
        resuming = self.subcommand == "fit" and config.ckpt_path is not None
        pin_wandb_runs(config.trainer, resuming)
        self._say_what_runs(asked, target)
        for note in notes:
            rank_zero_info(note)

    def _say_what_runs(self, asked: GPTConfig, target: str | Path | None) -> None:
        """The run's first line, before Lightning's (the README says so): which model, from which weights. Left to
        the module when Lightning resolves ``--ckpt_path last`` itself (no checkpoint folder of ours)."""
        self._said = target != "last"
        if not self._said:
            return
        model, seed = self.config[self.subcommand].model, self.config[self.subcommand].get("seed_everything")
        line = start_line(asked, model.model, model.get("model_overrides"), model.get("init_from"),
                          None if target is None else str(target), seed if isinstance(seed, int) else None)  # fmt: skip
        rank_zero_info(line)

    @override
    def _set_seed(self) -> None:
        """Seeded without Lightning's "Seed set to N" line: the run's first line (``start_line``) says the seed."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        seed = config.get("seed_everything")
        if seed is False:
            return
        config["seed_everything"] = seed_everything(None if seed is True else seed, workers=True, verbose=False)

    @override
    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        if isinstance(self.model, GPTPretraining) and getattr(self, "_said", False):
            self.model.announce = False  # said in before_instantiate_classes

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        settings = json.loads(self._parser(self.subcommand).dump(self.config[self.subcommand], format="json"))
        callbacks = [*callbacks, FailFast(), StopOnSignal(), LogRunSettings(settings), DropUnusedLogFolders()]
        given = config.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        if config.get("enable_checkpointing") is not False and not any(isinstance(c, ModelCheckpoint) for c in given):
            callbacks.append(SPPOCheckpoint())  # Lightning's default would save only at epoch ends
        bar = config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given)
        if bar and _RICH_AVAILABLE:
            callbacks.append(SPPOProgressBar())  # Lightning's would read "Epoch 0/-2" with max_epochs -1
        if config.get("logger") in (None, True) and not tensorboard_installed():
            # Lightning's default without TensorBoard, made here: it warns about tensorboardX on every run
            config = {**config, "logger": CSVLogger(save_dir=config.get("default_root_dir") or os.getcwd())}
        try:
            return super()._instantiate_trainer(config, callbacks)
        except (ValueError, TypeError, ImportError) as error:
            if (problem := trainer_setting_error(error, config)) is None:
                raise
            raise problem from error


def main(args: list[str] | None = None) -> None:
    """The command; it ends, on every rank, in a fixed order (``shutdown``) and with the status of how it stopped:
    0, 2 for the settings, 1 for a bug, 130 / 143 after SIGINT / SIGTERM (``stop``)."""
    _wandb_offline_without_key()
    with signals_stop_the_run("sppo", resume="--ckpt_path last"), exit_on_failure(), quiet_dependencies():
        cli = SPPOCLI(
            GPTPretraining,
            TokenDataModule,
            args=args,
            seed_everything_default=1337,
            trainer_defaults={"strategy": DEFAULT_STRATEGY},
            save_config_kwargs={"overwrite": True},
            parser_kwargs=_parser_kwargs(sys.argv[1:] if args is None else args),
        )
        end_of_run(shut_down(cli.trainer.strategy.launcher))


def _parser_kwargs(args: list[str]) -> dict[str, Any]:
    """Options spelled out in full, errors raised (not printed by argparse), and the demo as the defaults only
    when no ``--config`` is given: a user's config is never layered over the demo."""
    strict = {"exit_on_error": False, "allow_abbrev": False}
    defaults = [] if _names_config(args) or not DEMO_CONFIG.exists() else [str(DEMO_CONFIG)]
    return strict | {name: strict | {"default_config_files": defaults} for name in SPPOCLI.subcommands()}


def _names_config(args: list[str]) -> bool:
    return any(arg in ("-c", "--config") or arg.startswith("--config=") for arg in args)


def check_strategy_settings(trainer: Namespace) -> None:
    """Check an SPPO strategy's settings before jsonargparse builds it: it would re-raise our error as a
    ``ValueError`` of its own (every type it tried, as text), which the command could not tell from a bug."""
    entry = trainer.get("strategy")
    other = isinstance(entry, str) and entry != "sppo"
    if other or (
        isinstance(entry, Namespace) and entry.get("class_path") and not is_subclass(entry, SPPOTrainerStrategy)
    ):
        named = entry if isinstance(entry, str) else entry.class_path
        raise SPPOConfigError(
            f"trainer.strategy={named!r}: sppo trains with the SPPO strategy only (GPTPretraining builds its model on"
            " the meta device for it to place); set trainer.strategy: sppo or leave it out, with its settings under"
            " trainer.strategy.init_args."
        )
    if not isinstance(entry, Namespace) or not entry.get("class_path") or not is_subclass(entry, SPPOTrainerStrategy):
        return
    fields = {f.name for f in dataclasses.fields(SPPOConfig)}
    settings = {k: v for k, v in (entry.get("init_args") or Namespace()).items() if k in fields}
    if not isinstance(settings.get("offload", "none"), str):
        settings.pop("offload")  # an OffloadCallback: it checks its own policy
    try:
        with config_errors():
            SPPOConfig(**settings)
    except SPPOConfigError as error:
        raise SPPOConfigError(f"trainer.strategy.init_args: {error}") from error


def place_outputs(trainer: Namespace, root: str) -> None:
    """Loggers whose ``save_dir`` is unset, "" or "." (W&B's default) and checkpoint callbacks without a
    ``dirpath`` write under ``root`` (``default_root_dir``): ``root`` and ``root/checkpoints``."""
    for logger in class_entries(trainer.get("logger")):
        init = logger.get("init_args")
        if init is not None and "save_dir" in init and init.save_dir in (None, "", "."):
            init.save_dir = root
    for callback in class_entries(trainer.get("callbacks")):
        init = callback.get("init_args")
        if init is not None and init.get("dirpath", ...) is None and is_subclass(callback, ModelCheckpoint):
            init.dirpath = os.path.join(root, "checkpoints")


def pin_wandb_runs(trainer: Namespace, resuming: bool) -> None:
    """Give each W&B logger without an ``id`` one kept in its ``save_dir``: a fresh id for a new run, the saved
    one when resuming (``--ckpt_path``), so the W&B run continues too (the logger opens it with
    ``resume="allow"``). Only the process that becomes global rank 0 (the one that logs) reads and writes it."""
    if not launching_rank_zero():
        return
    for logger in class_entries(trainer.get("logger")):
        init = logger.get("init_args")
        if init is None or not is_subclass(logger, WandbLogger) or init.get("id") or init.get("version"):
            continue
        init.id = wandb_run_id(Path(init.get("save_dir") or "."), resuming)


def wandb_run_id(folder: Path, resuming: bool) -> str:
    """The W&B run id kept in ``folder/wandb-run-id``: the saved one when resuming (and there is one), else a
    new one (eight lowercase letters and digits, as W&B's own), written there for the next resume."""
    path = folder / WANDB_RUN_ID_FILE
    saved = path.read_text().strip() if resuming and path.is_file() else ""
    run_id = saved or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def _wandb_offline_without_key() -> None:
    """W&B logs offline (to disk, syncable later) unless an API key is configured."""
    netrc = Path.home() / ".netrc"
    has_key = "WANDB_API_KEY" in os.environ or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    if not has_key:
        os.environ.setdefault("WANDB_MODE", "offline")


if __name__ == "__main__":
    main()
