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
            parser_kwargs={"fit": {"default_config_files": defaults}},
        )
    except USER_ERRORS as error:
        if os.environ.get("SPPO_TRACEBACK"):
            raise
        if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":  # one line, not one per process
            print(f"sppo: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
