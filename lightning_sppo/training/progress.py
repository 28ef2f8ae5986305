"""The progress bar of the ``sppo`` command: Lightning's, reading right when training is bounded by steps.

Lightning's rich progress bar titles the training bar ``Epoch {epoch}/{max_epochs - 1}``; with ``max_epochs: -1``
(training bounded by ``max_steps``, as every shipped config is) that reads ``Epoch 0/-2``. This one writes
``Epoch 0`` then, and Lightning's title otherwise.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

__all__ = ["SPPOProgressBar"]


class SPPOProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training title leaves out the last epoch when there is none (``max_epochs`` -1)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs is None or self.trainer.max_epochs < 0:
            description = description.replace(
                f"Epoch {current_epoch}/{self.trainer.max_epochs - 1}", f"Epoch {current_epoch}"
            )
        return description
