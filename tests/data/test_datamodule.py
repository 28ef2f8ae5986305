"""TokenDataModule: batches, data-parallel sharding from the strategy's distributed_sampler_kwargs, the held-out
validation set, and a training loader that resumes mid-epoch."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_sppo.data import TokenDataModule, write_tokens
from lightning_sppo.data.datamodule import held_out_documents, padding_share
from lightning_sppo.data.loader import ResumableSampler
from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.loss import IGNORE_INDEX


@pytest.fixture
def path(tmp_path):
    write_tokens(tmp_path / "t", [list(range(k, k + 50)) for k in range(0, 200, 50)], vocab_size=256)
    return tmp_path / "t"


def _batches(dm):
    return [batch["input_ids"] for batch in dm.train_dataloader()]


def test_single_process_batches(path):
    dm = TokenDataModule(path, seq_len=8, batch_size=3, seed=5)
    loader = dm.train_dataloader()  # no trainer: every sample, shuffled with the seed
    assert isinstance(loader.sampler, ResumableSampler) and loader.sampler.num_replicas == 1
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
    with pytest.raises(SPPOConfigError, match="fewer than data.batch_size=100"):
        TokenDataModule(path, 8, 100).train_dataloader()
    with pytest.raises(SPPOConfigError, match=r"data.val_fraction is a share .* got val_fraction=1.5"):
        TokenDataModule(path, 8, 2, val_fraction=1.5)
    with pytest.raises(SPPOConfigError, match="both choose the validation set"):
        TokenDataModule(path, 8, 2, val_path=path, val_fraction=0.1)
    with pytest.raises(SPPOConfigError, match="holds out 4 of the 4 documents"):
        TokenDataModule(path, 8, 2, val_fraction=0.9).setup("fit")
    with pytest.raises(SPPOConfigError, match="sppo validate needs validation data"):
        TokenDataModule(path, 8, 2).setup("validate")
    with pytest.raises(SPPOConfigError, match="data.path='missing'"):
        TokenDataModule("missing", 8, 2).setup("fit")


def test_held_out_documents_split_once_and_deterministically():
    train, held = held_out_documents(40, 0.1, seed=3)
    assert len(held) == 4 and sorted(set(train) | set(held)) == list(range(40)) and not set(train) & set(held)
    assert [a.tolist() for a in held_out_documents(40, 0.1, seed=3)] == [train.tolist(), held.tolist()]
    assert held_out_documents(40, 0.1, seed=4)[1].tolist() != held.tolist()
    assert len(held_out_documents(5, 0.01, seed=0)[1]) == 1  # at least one document


def _rank(dm: TokenDataModule, rank: int, replicas: int) -> TokenDataModule:
    dm.trainer = SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank})
    )
    return dm


def test_validation_visits_every_held_out_sample_once_over_data_parallel_ranks(path):
    dm = TokenDataModule(path, seq_len=8, batch_size=2, seed=5, val_fraction=0.25)  # 1 of 4 documents, 7 windows
    dm.setup("fit")
    held = {tuple(dm.val_dataset[i]["input_ids"].tolist()) for i in range(len(dm.val_dataset))}
    train = {tuple(dm.train_dataset[i]["input_ids"].tolist()) for i in range(len(dm.train_dataset))}
    assert len(held) == len(dm.val_dataset) == 7 and not held & train
    per_rank = [list(_rank(dm, rank, 2).val_dataloader()) for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 2  # 7 samples padded to 8 = 2 ranks x 2 batches x 2 rows
    rows = [
        (tuple(ids.tolist()), tuple(t.tolist()))
        for batches in per_rank
        for batch in batches
        for ids, t in zip(batch["input_ids"], batch["targets"], strict=True)
    ]
    real = [r for r in rows if any(t != IGNORE_INDEX for t in r[1])]
    assert {ids for ids, _ in real} == held and len(real) == 7  # each held-out sample exactly once
    valid = sum(int((dm.val_dataset[i]["targets"] != IGNORE_INDEX).sum()) for i in range(7))
    assert sum(int((b["targets"] != IGNORE_INDEX).sum()) for bs in per_rank for b in bs) == valid


def test_a_separate_validation_file(path, tmp_path):
    write_tokens(tmp_path / "v", [list(range(100, 130))], vocab_size=256)
    dm = TokenDataModule(path, seq_len=8, batch_size=2, val_path=tmp_path / "v")
    dm.setup("fit")
    assert len(dm.train_dataset) == 28 and len(dm.val_dataset) == 4  # all of path; ceil(29 / 8) windows


def test_training_loader_resumes_mid_epoch_from_its_state(path):
    dm = _rank(TokenDataModule(path, seq_len=8, batch_size=2, seed=5), 1, 2)
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(3)
    expected = [b["input_ids"].tolist() for b in loader]
    loader.sampler.set_epoch(3)
    batches = iter(loader)
    first = [next(batches)["input_ids"].tolist() for _ in range(2)]
    state = loader.state_dict()

    resumed = dm.train_dataloader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(3)
    assert first + [b["input_ids"].tolist() for b in resumed] == expected
    fresh = dm.train_dataloader()  # negative control: without the state, the epoch starts over
    fresh.sampler.set_epoch(3)
    assert [b["input_ids"].tolist() for b in fresh][:1] == expected[:1] != expected[2:3]


def test_a_position_saved_with_one_data_parallel_size_resumes_with_another(path):
    """Saved by one replica taking 4 rows per step, resumed by 2 replicas taking 2 each (the same global batch):
    together they train the rows the single replica would have trained next, in the same steps."""
    single = _rank(TokenDataModule(path, seq_len=8, batch_size=4, seed=5), 0, 1).train_dataloader()
    single.sampler.set_epoch(2)
    expected = [b["input_ids"] for b in single]
    single.sampler.set_epoch(2)
    batches = iter(single)
    for _ in range(3):
        next(batches)
    state = single.state_dict()
    assert state == {"epoch": 2, "global_samples": 12, "samples": len(single.dataset), "seed": 5}
    halves = []
    for rank in range(2):
        loader = _rank(TokenDataModule(path, seq_len=8, batch_size=2, seed=5), rank, 2).train_dataloader()
        loader.load_state_dict(state)
        loader.sampler.set_epoch(2)
        halves.append([b["input_ids"] for b in loader])
    assert len(halves[0]) == len(halves[1]) == len(expected) - 3
    for step, batch in enumerate(expected[3:]):  # the sampler deals round-robin: rows 0, 2 and 1, 3
        assert torch.equal(halves[0][step], batch[0::2]) and torch.equal(halves[1][step], batch[1::2]), step
    # The position belongs to its epoch: once the Trainer has moved on, the next epoch starts at its beginning.
    moved_on = _rank(TokenDataModule(path, seq_len=8, batch_size=2, seed=5), 0, 2).train_dataloader()
    moved_on.load_state_dict(state)
    moved_on.sampler.set_epoch(3)
    assert len(list(moved_on)) == len(moved_on)
    odd = _rank(TokenDataModule(path, seq_len=8, batch_size=3, seed=5), 0, 3).train_dataloader()
    odd.load_state_dict({"epoch": 2, "global_samples": 6})  # 2 each; 10 would not split over 3 replicas
    with pytest.raises(SPPOConfigError, match="does not split over 3 ranks"):
        odd.load_state_dict({"epoch": 2, "global_samples": 10})


def test_packed_batches_carry_document_ids_unless_switched_off(path):
    batch = next(iter(TokenDataModule(path, seq_len=16, batch_size=2, packing=True, seed=5).train_dataloader()))
    assert set(batch) == {"input_ids", "targets", "document_ids"} and batch["document_ids"].shape == (2, 16)
    assert (batch["document_ids"].diff(dim=1) >= 0).all()
    off = TokenDataModule(path, seq_len=16, batch_size=2, packing=True, seed=5, document_mask=False)
    assert set(next(iter(off.train_dataloader()))) == {"input_ids", "targets"}
    plain = TokenDataModule(path, seq_len=16, batch_size=2, seed=5)  # one document per sample: nothing to mask
    assert set(next(iter(plain.train_dataloader()))) == {"input_ids", "targets"}


def test_mostly_padding_warns_once_naming_packing(path):
    """4 documents of 50 tokens: seq_len 64 pads every sample (49 real targets of 64), seq_len 32 pads 15 of 64
    positions (23%, under the threshold, the longest document longer than a sample); packing pads nothing."""
    dm = TokenDataModule(path, seq_len=64, batch_size=1)
    with pytest.warns(UserWarning, match=r"data.seq_len=64 without data.packing: 23% .*\(60 of 256; the longest"
                      r" of the 4 training documents has 50 tokens\).*data.packing: true") as seen:  # fmt: skip
        dm.setup("fit")
        dm.setup("fit")  # once per data module
    assert len([w for w in seen if "data.packing" in str(w.message)]) == 1
    assert padding_share(np.array([50, 50, 50, 50]), 32) == (60, 256)  # 2 windows of 32 per 49 targets
    for quiet in (TokenDataModule(path, seq_len=32, batch_size=1), TokenDataModule(path, 64, 1, packing=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the negative controls: nothing to say
            quiet.setup("fit")


def test_data_too_short_for_one_sample_is_one_line_naming_what_to_change(path, tmp_path):
    """200 tokens in 4 documents: no packed sample of 256 tokens, and a held-out document (50 tokens) has no
    packed sample of 64 while the training documents (150 tokens) have two."""
    with pytest.raises(SPPOConfigError, match=r"data.path=.* gives no sample of data.seq_len=256: its 4 documents hold"
                       r" 200 tokens.*lower data.seq_len") as error:  # fmt: skip
        TokenDataModule(path, seq_len=256, batch_size=1, packing=True).setup("fit")
    assert "\n" not in str(error.value)
    with pytest.raises(SPPOConfigError, match=r"the validation set \(data.val_fraction=0.25 of data.path\) gives no"
                       r" sample of data.seq_len=64: its 1 documents hold 50 tokens.*raise data.val_fraction"):  # fmt: skip
        TokenDataModule(path, seq_len=64, batch_size=1, packing=True, val_fraction=0.25).setup("fit")
    TokenDataModule(path, seq_len=32, batch_size=1, packing=True, val_fraction=0.25).setup("fit")  # both have samples
    for bad in (0, -3, True, 2.5):
        with pytest.raises(SPPOConfigError, match="data.seq_len must be a positive integer"):
            TokenDataModule(path, seq_len=bad, batch_size=1)


def test_workers_by_default_only_with_cores_to_spare(path, monkeypatch):
    from lightning_sppo.data import datamodule

    dm = TokenDataModule(path, seq_len=8, batch_size=1)
    for cores, workers in ((16, 2), (2, 0)):
        monkeypatch.setattr(datamodule, "suggested_max_num_workers", lambda devices, cores=cores: max(1, cores - 1))
        assert dm._workers() == workers
    assert TokenDataModule(path, seq_len=8, batch_size=1, num_workers=3)._workers() == 3


def test_without_validation_a_fit_runs_no_validation_loop_and_leaves_the_trainer_as_it_was(path):
    """An empty validation loader only drew Lightning's warning: the fit skips the loop, and the trainer's own
    limit_val_batches is back after it (another fit with validation data validates again)."""
    trainer = SimpleNamespace(limit_val_batches=1.0)
    without, with_validation = TokenDataModule(path, 8, 2), TokenDataModule(path, 8, 2, val_fraction=0.5)
    without.trainer = with_validation.trainer = trainer
    without.setup("fit")
    without.setup("fit")
    assert trainer.limit_val_batches == 0
    without.teardown("fit")
    assert trainer.limit_val_batches == 1.0
    with_validation.setup("fit")  # the negative control: a validation set leaves the limit alone
    assert trainer.limit_val_batches == 1.0


def test_a_position_is_refused_by_data_that_shuffles_other_samples(path):
    """The saved position counts samples of one permutation: other data (another seq_len, seed or split) would
    resume at other samples, silently. A checkpoint from before the loader saved its data resumes as it did."""
    saved = _rank(TokenDataModule(path, seq_len=8, batch_size=2, seed=5), 0, 1).train_dataloader()
    state = saved.state_dict() | {"global_samples": 4}
    for changed in ({"seq_len": 16}, {"seed": 6}, {"val_fraction": 0.5}):
        settings = {"seq_len": 8, "batch_size": 2, "seed": 5} | changed
        other = _rank(TokenDataModule(path, **settings), 0, 1).train_dataloader()
        with pytest.raises(SPPOConfigError, match=r"drew from \d+ samples shuffled with seed 5.*data\.seq_len"):
            other.load_state_dict(state)
    same = _rank(TokenDataModule(path, seq_len=8, batch_size=2, seed=5), 0, 1).train_dataloader()
    same.load_state_dict(state)  # the negative control: the same data resumes
    same.load_state_dict({"epoch": 0, "global_samples": 4})  # an older checkpoint's state
