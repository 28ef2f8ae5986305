"""TokenDataModule: batches, and data-parallel sharding from the strategy's distributed_sampler_kwargs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from lightning_sppo.data import TokenDataModule, write_tokens


@pytest.fixture
def path(tmp_path):
    write_tokens(tmp_path / "t", [list(range(k, k + 50)) for k in range(0, 200, 50)], vocab_size=256)
    return tmp_path / "t"


def _batches(dm):
    return [batch["input_ids"] for batch in dm.train_dataloader()]


def test_single_process_batches(path):
    dm = TokenDataModule(path, seq_len=8, batch_size=3, seed=5)
    loader = dm.train_dataloader()  # no trainer: every sample, shuffled with the seed
    assert isinstance(loader.sampler, RandomSampler)
    batches = _batches(dm)
    assert len(batches) == len(dm.train_dataset) // 3  # 4 documents * 7 windows, incomplete batch dropped
    assert all(b.shape == (3, 8) and b.dtype == torch.long for b in batches)
    assert [b.tolist() for b in batches] == [b.tolist() for b in _batches(TokenDataModule(path, 8, 3, seed=5))]


def test_shards_over_data_parallel_ranks_only(path):
    seen = []
    for rank in range(2):
        dm = TokenDataModule(path, seq_len=8, batch_size=2, packing=True, seed=5)
        dm.trainer = SimpleNamespace(
            strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank})
        )
        loader = dm.train_dataloader()
        assert isinstance(loader.sampler, DistributedSampler)
        assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, rank)
        seen.append(list(loader.sampler))
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) == len(seen[1]) == len(dm.train_dataset) // 2


def test_errors_name_the_setting(path):
    with pytest.raises(ValueError, match="batch_size=0"):
        TokenDataModule(path, 8, 0)
    with pytest.raises(ValueError, match="fewer than batch_size=100"):
        TokenDataModule(path, 8, 100).train_dataloader()


def test_packed_batches_carry_document_ids_unless_switched_off(path):
    batch = next(iter(TokenDataModule(path, seq_len=16, batch_size=2, packing=True, seed=5).train_dataloader()))
    assert set(batch) == {"input_ids", "targets", "document_ids"} and batch["document_ids"].shape == (2, 16)
    assert (batch["document_ids"].diff(dim=1) >= 0).all()
    off = TokenDataModule(path, seq_len=16, batch_size=2, packing=True, seed=5, document_mask=False)
    assert set(next(iter(off.train_dataloader()))) == {"input_ids", "targets"}
    plain = TokenDataModule(path, seq_len=16, batch_size=2, seed=5)  # one document per sample: nothing to mask
    assert set(next(iter(plain.train_dataloader()))) == {"input_ids", "targets"}
