"""The offload callback with Fabric (``fabric.call``) and with the Trainer (``on_train_batch_end`` logging)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_sppo import GPT
from lightning_sppo.offload import OffloadCallback, Offloader
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import make_batch, parity_config


class _Recorder:
    def __init__(self):
        self.logged = []

    def log_dict(self, metrics, step=None):
        self.logged.append((step, metrics))


def test_unknown_policy_names_offload():
    with pytest.raises(ValueError, match=r"offload='sometimes'"):
        OffloadCallback("sometimes")


def test_build_gives_the_engine_its_hooks():
    assert OffloadCallback("none").build("cpu") is None
    callback = OffloadCallback("full", min_bytes=0)
    offloader = callback.build(torch.device("cpu"))
    assert isinstance(offloader, Offloader) and callback.build("cpu") is offloader  # built once
    assert offloader.policy == "full" and offloader.min_bytes == 0


def test_fabric_call_reports_and_logs_each_step():
    callback = OffloadCallback("full", min_bytes=0)
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[callback])
    config = parity_config()
    ids, targets = make_batch(config, 1, 45)
    engine = SubsequenceEngine(3, hooks=callback.build(fabric.device))
    recorder = _Recorder()
    for _ in range(2):
        engine.forward_backward(GPT(config), ids, targets)
        fabric.call("on_offload_step", fabric=recorder)
    assert [step for step, _ in recorder.logged] == [0, 1]
    metrics = recorder.logged[-1][1]
    assert metrics["offload/offloaded_bytes"] == callback.latest.offloaded_bytes > 0
    assert metrics["offload/prefetched_bytes"] > 0 and metrics["offload/peak_saved_bytes"] > 0


class _TinyModule(LightningModule):
    """Trains through the engine with the callback's offloader, as the strategy will."""

    def __init__(self, callback: OffloadCallback):
        super().__init__()
        self.model = GPT(parity_config())
        self.callback = callback
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        engine = SubsequenceEngine(3, hooks=self.callback.build(self.device))
        engine.forward_backward(self.model, ids, targets)
        optimizer = self.optimizers()
        optimizer.step()
        optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_logs_offload_metrics_on_its_logging_steps(monkeypatch):
    """Reduced over the ranks (one rank here: max and sum are its own), on the steps the Trainer logs only."""
    callback = OffloadCallback("adaptive", min_bytes=0)
    ids, targets = make_batch(parity_config(), 4, 45)
    loader = DataLoader(TensorDataset(ids, targets), batch_size=2)
    reads = []
    stats = Offloader.last_stats
    monkeypatch.setattr(Offloader, "last_stats", property(lambda self: reads.append(1) or stats.fget(self)))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        log_every_n_steps=2,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_TinyModule(callback), loader)
    metrics = trainer.callback_metrics
    assert metrics["offload/offloaded_bytes_sum"] == metrics["offload/offloaded_bytes_max"] > 0
    assert callback.latest.step == 1
    assert len(reads) == 1  # step 2 only: step 1 is not a logging step, and reading the stats would sync
    assert callback.offloader.pool.capacity_bytes == 0  # released at teardown
