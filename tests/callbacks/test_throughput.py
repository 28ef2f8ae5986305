"""SPPOMetrics on one CPU process: every metric logged, finite, at the logging interval, from a fake clock."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_sppo import SPPOTrainerStrategy
from lightning_sppo.callbacks import SPPOMetrics, ThroughputWindow, training_flops_per_token
from lightning_sppo.data import TokenDataModule, write_tokens
from lightning_sppo.offload import OffloadCallback
from lightning_sppo.training import GPTPretraining

SEQ, BATCH = 32, 2
TOKENS_PER_STEP = SEQ * BATCH


def test_window_smooths_a_slow_interval():
    window = ThroughputWindow(window=4)
    for seconds in (2.0, 2.0):
        window.add(2, seconds, tokens=100)
    assert window.rate("tokens") == pytest.approx(50.0) and window.step_s == pytest.approx(1.0)
    window.add(2, 6.0, tokens=100)  # a slow interval: alone it reads 100 / 6
    assert window.steps == 4 and window.rate("tokens") == pytest.approx(200 / 8)  # the last 4 steps
    window.add(2, 2.0, tokens=100)
    assert window.rate("tokens") == pytest.approx(200 / 8)
    window.add(2, 2.0, tokens=100)
    assert window.rate("tokens") == pytest.approx(50.0)  # the slow interval has left the window
    with pytest.raises(ValueError, match=r"window=0"):
        ThroughputWindow(0)


def test_an_interval_longer_than_the_window_is_kept_alone():
    window = ThroughputWindow(window=2)
    window.add(5, 10.0, tokens=50)
    window.add(3, 3.0, tokens=30)
    assert (window.steps, window.rate("tokens")) == (3, 10.0)


@pytest.fixture
def data(tmp_path) -> TokenDataModule:
    text = b"the quick brown fox jumps over the lazy dog. " * 20
    write_tokens(tmp_path / "toy", [list(text)], vocab_size=256, tokenizer="bytes")
    return TokenDataModule(tmp_path / "toy", seq_len=SEQ, batch_size=BATCH)


def _logged_rows(save_dir: Path) -> list[dict[str, float]]:
    (path,) = save_dir.glob("**/metrics.csv")
    with path.open() as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return [row for row in rows if "perf/tokens_per_s" in row]


def test_logged_metrics_exist_are_finite_and_follow_the_fake_clock(tmp_path, data, monkeypatch, one_thread):
    times = iter([0.0, 2.0, 4.0, 10.0])  # first batch start, then steps 2, 4, 6: one read per logged step
    metrics = SPPOMetrics(window=4, peak_flops=1e12, clock=lambda: next(times))
    offload = OffloadCallback("full", min_bytes=0, slab_bytes=2**20)
    trainer = Trainer(
        # num_subsequences="auto": the planner cuts each batch shape, and its predictions are logged beside
        strategy=SPPOTrainerStrategy(num_subsequences="auto", offload=offload), accelerator="cpu", devices=1,
        max_steps=6, log_every_n_steps=2, logger=CSVLogger(tmp_path / "logs"), callbacks=[metrics, offload],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = GPTPretraining(model="tiny", warmup_steps=1, max_steps=6)
    trainer.fit(module, data)

    rows = _logged_rows(tmp_path / "logs")
    assert len(rows) == 3  # steps 2, 4, 6
    assert all(math.isfinite(v) for row in rows for v in row.values())
    expected_keys = {
        "perf/tokens_per_s", "perf/tokens_per_gpu_per_s", "perf/step_s", "perf/mfu", "perf/mfu_full_attention",
        "offload/host_gib_sum", "offload/host_gib_max", "offload/offloaded_gib_sum", "pipeline/bubble_ratio",
        "pipeline/num_subsequences", "planner/predicted_peak_gpu_gib", "planner/predicted_peak_host_gib",
        "planner/predicted_step_s", "planner/predicted_tokens_per_gpu_per_s", "planner/predicted_mfu",
    }  # fmt: skip
    assert expected_keys <= rows[-1].keys(), expected_keys - rows[-1].keys()
    assert not any(key.startswith("memory/") for key in rows[-1])  # CUDA only

    # Steps 2 and 4 took 2 s each, steps 5-6 took 6 s: the 4-step window gives 4 steps' tokens over 8 s.
    assert [row["perf/tokens_per_s"] for row in rows] == pytest.approx([64.0, 64.0, 4 * TOKENS_PER_STEP / 8])
    last = rows[-1]
    assert last["perf/step_s"] == pytest.approx(2.0) and last["perf/tokens_per_gpu_per_s"] == last["perf/tokens_per_s"]
    causal = training_flops_per_token(module.config, SEQ) * last["perf/tokens_per_s"] / 1e12
    assert last["perf/mfu"] == pytest.approx(causal, rel=1e-9)
    full = training_flops_per_token(module.config, SEQ, "full") * last["perf/tokens_per_s"] / 1e12
    assert last["perf/mfu_full_attention"] == pytest.approx(full, rel=1e-9) and full > causal

    plan = trainer.strategy.core.planner.last_plan  # the plan behind the run's cut, logged as predictions
    assert plan is not None
    pool = trainer.strategy.core.hooks.pool  # one rank: the sum and the maximum are its own pool
    assert last["offload/host_gib_sum"] == last["offload/host_gib_max"] > 0
    assert last["offload/offloaded_gib_sum"] > 0 and last["pipeline/num_subsequences"] == plan.num_subsequences
    assert pool.capacity_bytes == 0  # released at teardown: the logged figure was read during the run
    assert last["planner/predicted_step_s"] == pytest.approx(plan.step_time_s)
    assert last["planner/predicted_peak_gpu_gib"] == pytest.approx(plan.peak_gpu_bytes / 2**30)
    assert {"perf/tokens_per_s", "perf/mfu", "train/loss"} <= trainer.progress_bar_metrics.keys()


class _Recorder:
    """What the callback needs of a LightningModule: ``log``, and no GPT config (no MFU)."""

    def __init__(self):
        self.logged: dict[int, dict[str, float]] = {}
        self.step = 0

    def log(self, name, value, **kwargs):
        self.logged.setdefault(self.step, {})[name] = value


def _fake_trainer(log_every_n_steps: int) -> SimpleNamespace:
    strategy = SimpleNamespace(root_device=torch.device("cpu"))  # not an SPPO strategy: no core
    return SimpleNamespace(strategy=strategy, log_every_n_steps=log_every_n_steps, world_size=1, global_step=0)


def test_validation_time_is_not_training_time_and_a_repeated_step_logs_once():
    times = iter([0.0, 1.0, 1.5, 11.5, 12.0, 13.0])
    metrics = SPPOMetrics(log_every_n_steps=1, clock=lambda: next(times))
    trainer, module = _fake_trainer(1), _Recorder()
    batch = {"input_ids": torch.zeros(BATCH, SEQ, dtype=torch.long)}
    metrics.on_train_batch_start(trainer, module, batch, 0)  # clock 0
    trainer.global_step = module.step = 1
    metrics.on_train_batch_end(trainer, module, None, batch, 0)  # clock 1: step 1 took 1 s
    metrics.on_validation_start(trainer, module)  # clock 1.5
    metrics.on_validation_end(trainer, module)  # clock 11.5: 10 s of validation
    metrics.on_train_batch_start(trainer, module, batch, 1)
    trainer.global_step = module.step = 2
    metrics.on_train_batch_end(trainer, module, None, batch, 1)  # clock 12: step 2 took 12 - 1 - 10 = 1 s
    metrics.on_train_batch_end(trainer, module, None, batch, 2)  # an accumulating batch: still step 2, no log
    assert module.logged[1]["perf/tokens_per_s"] == pytest.approx(TOKENS_PER_STEP)
    assert module.logged[2]["perf/step_s"] == pytest.approx(1.0)
    assert "perf/mfu" not in module.logged[2]  # no peak FLOP/s known for the CPU
    assert next(times) == 13.0  # the repeated step read no clock


def test_settings_are_checked():
    with pytest.raises(ValueError, match=r"log_every_n_steps=-1"):
        SPPOMetrics(log_every_n_steps=-1)
    with pytest.raises(ValueError, match=r"peak_flops=0"):
        SPPOMetrics(peak_flops=0)
