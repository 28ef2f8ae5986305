"""``TokenDataModule``: a token file as training batches for a Lightning ``Trainer``."""

from __future__ import annotations

import os

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from lightning_sppo.data.dataset import PackedSequences
from lightning_sppo.data.token_file import TokenFile

__all__ = ["TokenDataModule"]


class TokenDataModule(LightningDataModule):
    """Shuffled batches ``{"input_ids": [B, S], "targets": [B, S]}`` of ``PackedSequences`` from a token file
    (plus ``"document_ids": [B, S]`` with ``packing`` and ``document_mask``).

    Args:
        path: the token file (``NAME`` or ``NAME.bin``), as written by ``sppo-prepare``.
        seq_len: tokens per sequence (S).
        batch_size: sequences per batch on each data-parallel replica (B).
        packing: concatenate documents into full windows (see ``PackedSequences``).
        document_mask: with packing, batches carry ``document_ids`` [B, S] and every document is trained alone
            (attention and positions within it, no target across a boundary); False: tokens attend across
            document boundaries. Ignored without packing.
        num_workers: DataLoader worker processes.
        seed: seeds the document order and the sampler's shuffling.

    Sharding: when the trainer's strategy has ``distributed_sampler_kwargs`` (data-parallel rank and
    size), the sampler is a ``DistributedSampler`` over those, so all pipeline and sequence-parallel
    ranks of one data-parallel replica draw the same batch; otherwise every process draws the whole
    dataset from a ``RandomSampler`` with the same seed. Incomplete batches are dropped, so every
    batch has ``batch_size`` rows (pipeline schedules split the batch into micro-batches).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        batch_size: int,
        packing: bool = False,
        num_workers: int = 0,
        seed: int = 0,
        document_mask: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"TokenDataModule.batch_size must be a positive integer, got batch_size={batch_size!r}.")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"TokenDataModule.num_workers must be >= 0, got num_workers={num_workers!r}.")
        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.packing = packing
        self.num_workers = num_workers
        self.seed = seed
        self.document_mask = document_mask
        self.train_dataset: PackedSequences | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None:
            self.train_dataset = PackedSequences(
                TokenFile.open(self.path), self.seq_len, self.packing, self.seed, self.document_mask
            )

    def train_dataloader(self) -> DataLoader:
        strategy = getattr(self.trainer, "strategy", None)
        return self.dataloader(getattr(strategy, "distributed_sampler_kwargs", None))

    def dataloader(self, sampler_kwargs: dict | None = None) -> DataLoader:
        """Batches for one data-parallel replica: ``sampler_kwargs`` are ``num_replicas`` and ``rank`` (as a
        strategy's ``distributed_sampler_kwargs`` give them); None draws from the whole dataset."""
        self.setup("fit")
        sampler = self._sampler(self.train_dataset, sampler_kwargs)
        if len(sampler) < self.batch_size:
            raise ValueError(
                f"{self.train_dataset!r} gives {len(sampler)} samples per replica, fewer than"
                f" batch_size={self.batch_size}; use a smaller batch_size or seq_len."
            )
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            drop_last=True,
            persistent_workers=self.num_workers > 0,
        )

    def _sampler(self, dataset: PackedSequences, kwargs: dict | None) -> Sampler:
        if kwargs is not None:
            return DistributedSampler(dataset, **kwargs, shuffle=True, seed=self.seed, drop_last=True)
        return RandomSampler(dataset, generator=torch.Generator().manual_seed(self.seed))
