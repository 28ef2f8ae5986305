"""A training loader whose position in the epoch is part of every checkpoint, in any data-parallel layout.

A long run checkpoints mid-epoch (every 100 steps of a pass that may never end), so resuming exactly needs the
loader's position: which of this epoch's samples were already trained on. The position is saved as samples of
the whole data-parallel group, not of one replica, so a run resumed with another number of data-parallel ranks
(another pipeline or sequence-parallel layout of the same GPUs, or another per-rank batch size with the same
global batch) continues at the same sample of the same shuffled order.

Why that works: the sampler deals each epoch's permutation round-robin, replica r taking positions r, r + R,
r + 2R, ... of it, so the first k samples of every replica are exactly the first k x R of the permutation,
whatever R is. A resume starts every replica ``start = consumed_globally / R`` samples into its share.

Lightning saves ``state_dict()`` in every checkpoint and calls ``load_state_dict`` on resume (its fit loop treats
any loader with both methods as stateful); the Fabric recipe does the same itself. The sampler skips at the
index level, so no sample is loaded to be thrown away, with any number of workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_sppo.errors import SPPOConfigError

__all__ = ["ResumableLoader", "ResumableSampler"]


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled, ``drop_last``) whose pass for one epoch can start some samples in."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self._resume: tuple[int, int] | None = None  # (epoch, samples of this replica already trained on)

    def resume_at(self, epoch: int, start: int) -> None:
        """The next pass over ``epoch`` skips this replica's first ``start`` samples (other epochs: none)."""
        self._resume = (epoch, start)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        resume, self._resume = self._resume, None
        start = resume[1] if resume is not None and resume[0] == self.epoch else 0
        return iter(indices[start:])

    @property
    def pending_start(self) -> int:
        """Samples the next pass will skip (0 unless a resume is pending for the current epoch)."""
        return self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0


class ResumableLoader(DataLoader):
    """Training batches of one replica; ``state_dict`` is the position in the current epoch (module docstring)."""

    def __init__(self, dataset: Dataset, batch_size: int, sampler: ResumableSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)
        self._epoch = sampler.epoch
        self._consumed = 0  # samples of this replica trained on in ``_epoch`` (skipped ones included)

    def __iter__(self) -> Iterator[Any]:
        sampler: ResumableSampler = self.sampler
        self._epoch, self._consumed = sampler.epoch, sampler.pending_start
        for batch in super().__iter__():
            # Counted before the batch is handed out: a checkpoint written while it trains includes it.
            self._consumed += self.batch_size
            yield batch

    def state_dict(self) -> dict[str, int]:
        sampler: ResumableSampler = self.sampler
        order = {"samples": len(self.dataset), "seed": sampler.seed}  # what decides each epoch's permutation
        return {"epoch": self._epoch, "global_samples": self._consumed * sampler.num_replicas} | order

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler: ResumableSampler = self.sampler
        consumed, replicas = state["global_samples"], sampler.num_replicas
        saved = (state.get("samples", len(self.dataset)), state.get("seed", sampler.seed))  # older checkpoints: none
        if saved != (len(self.dataset), sampler.seed):
            raise SPPOConfigError(
                f"The checkpoint's data loader drew from {saved[0]} samples shuffled with seed {saved[1]}; this run's"
                f" data gives {len(self.dataset)} samples with seed {sampler.seed}, so its position would point at"
                " other samples (data.path, data.seq_len, data.packing, data.val_fraction or data.seed changed):"
                " resume with the data settings of the run that saved it, or start a new run from its weights"
                " (--model.init_from CHECKPOINT)."
            )
        if consumed % replicas:
            raise SPPOConfigError(
                f"The checkpoint's data loader had drawn {consumed} samples of epoch {state['epoch']} over all"
                f" data-parallel ranks, which does not split over {replicas} ranks: resume with a data-parallel size"
                " that divides it (the same global batch size as the run that saved it resumes exactly)."
            )
        sampler.resume_at(state["epoch"], consumed // replicas)
        self._epoch, self._consumed = state["epoch"], consumed // replicas
