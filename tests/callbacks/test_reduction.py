"""Values reduced over ranks (real processes on gloo): the reduction the name says, with every rank taking part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_sppo import SPPOTrainerStrategy
from lightning_sppo.callbacks import SPPOMetrics, reduce_over_ranks
from lightning_sppo.data import TokenDataModule, write_tokens
from lightning_sppo.offload import OffloadCallback
from lightning_sppo.training import GPTPretraining
from tests.distributed.harness import run_distributed

GIB = 2**30


def test_one_process_reduces_to_its_own_values():
    assert reduce_over_ranks({"a": 3.0}, torch.device("cpu")) == {"a_max": 3.0, "a_sum": 3.0}
    assert reduce_over_ranks({}, torch.device("cpu")) == {}


class _PoolBytes(Callback):
    """Each rank's own offload pool size at every logged step, written to a file for the test to compare."""

    def __init__(self, out: Path):
        self.out, self.seen = out, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen[trainer.global_step] = trainer.strategy.core.hooks.pool.capacity_bytes

    def on_train_end(self, trainer, pl_module):
        logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"pool": self.seen, "logged": logged}))


def reduced_over_two_ranks(rank: int, world_size: int, folder: str) -> None:
    # Different fake values per rank: the names say which reduction each got. (The Trainer below joins this group.)
    dist.init_process_group("gloo")
    values = {"offload/bytes": [3.0, 5.0][rank], "memory/gib": [1.5, -2.0][rank]}
    reduced = reduce_over_ranks(values, torch.device("cpu"))
    assert reduced == {
        "offload/bytes_max": 5.0,
        "memory/gib_max": 1.5,
        "offload/bytes_sum": 8.0,
        "memory/gib_sum": -0.5,
    }, (rank, reduced)

    # A real 2-stage pipeline: each stage offloads its own activations, and every rank reaches the collective.
    out = Path(folder)
    offload = OffloadCallback("full", min_bytes=0, slab_bytes=2**16)
    trainer = Trainer(
        strategy=SPPOTrainerStrategy(pipeline_parallel=2, num_subsequences=2, offload=offload), accelerator="cpu",
        devices=world_size, max_steps=4, log_every_n_steps=2, logger=CSVLogger(out / "logs"),
        callbacks=[SPPOMetrics(window=2), _PoolBytes(out)], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(GPTPretraining(model="tiny", warmup_steps=1, max_steps=4), TokenDataModule(out / "toy", 32, 2))


@pytest.mark.slow
def test_reductions_over_ranks_are_the_ones_named(tmp_path):
    text = b"the quick brown fox jumps over the lazy dog. " * 20
    write_tokens(tmp_path / "toy", [list(text)], vocab_size=256, tokenizer="bytes")
    run_distributed(reduced_over_two_ranks, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    pools = [rank["pool"]["4"] for rank in ranks]  # at the last logged step
    assert pools[0] != pools[1], pools  # the stages hold different activations: the reductions differ
    logged = ranks[0]["logged"]  # rank 0 logs, with the values of both ranks
    assert logged["offload/host_gib_sum"] == pytest.approx(sum(pools) / GIB, rel=1e-12)
    assert logged["offload/host_gib_max"] == pytest.approx(max(pools) / GIB, rel=1e-12)
    assert logged["offload/offloaded_gib_sum"] > 0
