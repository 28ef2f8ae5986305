"""Training recipes that ship with the package: the pretraining LightningModule and the `sppo` CLI."""

from lightning_sppo.training.module import GPTPretraining

__all__ = ["GPTPretraining"]
