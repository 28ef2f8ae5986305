"""What the training tests share: a tiny token file, and a callback that records each step's loss."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from lightning_sppo.data import write_tokens


@pytest.fixture
def data(tmp_path):
    """Three copies of a short English sentence as byte tokens (``tmp_path/toy``)."""
    torch.manual_seed(0)
    text = b"the quick brown fox jumps over the lazy dog. " * 40
    write_tokens(tmp_path / "toy", [list(text)] * 3, vocab_size=256, tokenizer="bytes")
    return tmp_path / "toy"


class Losses(Callback):
    """Each training step's loss, by step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step - 1] = outputs["loss"].item()
