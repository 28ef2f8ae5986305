"""The `sppo` command: LightningCLI over GPTPretraining and TokenDataModule.

    sppo fit --config configs/demo-cpu.yaml            # 2 CPU processes, pp=2, a few minutes
    sppo fit --config configs/demo-cpu.yaml --ckpt_path last   # resume
    sppo fit --config configs/gpt-7b-1m.yaml           # on a cluster (torchrun / SLURM)

``trainer.strategy`` is "sppo" or ``class_path: lightning_sppo.SPPOTrainerStrategy`` with ``init_args``.
Expected mistakes (missing data, bad layout, a sequence too long for the model) end with one line on
stderr and exit status 2, not a traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningCLI

from lightning_sppo.data import TokenDataModule
from lightning_sppo.training.module import GPTPretraining

__all__ = ["SPPOCLI", "main"]

_REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, KeyError, NotImplementedError)


class SPPOCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("trainer.max_steps", "model.max_steps")


def _wandb_offline_without_key() -> None:
    """W&B logs offline (to disk, syncable later) unless an API key is configured."""
    netrc = Path.home() / ".netrc"
    has_key = "WANDB_API_KEY" in os.environ or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    if not has_key:
        os.environ.setdefault("WANDB_MODE", "offline")


def main(args: list[str] | None = None) -> None:
    _wandb_offline_without_key()
    defaults = [str(_REPO_CONFIGS / "demo-cpu.yaml")] if (_REPO_CONFIGS / "demo-cpu.yaml").exists() else []
    try:
        SPPOCLI(
            GPTPretraining,
            TokenDataModule,
            args=args,
            seed_everything_default=1337,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False, "fit": {"default_config_files": defaults, "exit_on_error": False}},
        )
    except (*USER_ERRORS, ArgumentError) as error:
        if os.environ.get("SPPO_TRACEBACK"):
            raise
        if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":  # one line, not one per process
            print(f"sppo: error: {_one_line(error)}", file=sys.stderr)
        sys.exit(2)


def _one_line(error: BaseException) -> str:
    """The most specific line of a (possibly nested, multi-line) configuration error.

    jsonargparse wraps the error of a class it could not build (ours name the setting) into a Union
    report; the line from our own checks, or the "not accepted" option, is the one worth showing.
    """
    lines = [line.strip(" -") for line in str(error).splitlines() if line.strip(" -")]
    ours = [line for line in lines if "=" in line and ("Unknown" in line or "must" in line)]
    options = [line for line in lines if "not accepted" in line or "does not exist" in line]
    text = (ours or options or lines or [repr(error)])[0]
    return f"{text} (see `sppo fit --help`)" if isinstance(error, ArgumentError) and not ours else text


if __name__ == "__main__":
    main()
