"""``TokenDataModule``: a token file as training and validation batches for a Lightning ``Trainer``."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.data import suggested_max_num_workers
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler
from typing_extensions import override

from lightning_sppo.data.dataset import PackedSequences
from lightning_sppo.data.loader import ResumableLoader, ResumableSampler
from lightning_sppo.data.token_file import TOKEN_FILE_SUFFIXES, TokenFile, token_file_paths
from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.loss import IGNORE_INDEX

__all__ = ["PADDING_WARNING_SHARE", "TokenDataModule", "held_out_documents", "padding_share"]

PADDING_WARNING_SHARE = 0.25
"""Above this share of padded target positions (without packing) a run warns once, naming ``data.packing``."""


class TokenDataModule(LightningDataModule):
    """Shuffled batches ``{"input_ids": [B, S], "targets": [B, S]}`` of ``PackedSequences`` from a token file
    (plus ``"document_ids": [B, S]`` with ``packing`` and ``document_mask``), and a held-out validation set.

    Args:
        path: the token file (``NAME`` or ``NAME.bin``), as written by ``sppo-prepare``.
        seq_len: tokens per sequence (S).
        batch_size: sequences per batch on each data-parallel replica (B), for training and validation.
        packing: concatenate documents into full windows (see ``PackedSequences``).
        document_mask: with packing, batches carry ``document_ids`` [B, S] and every document is trained alone
            (attention and positions within it, no target across a boundary); False: tokens attend across
            document boundaries. Ignored without packing.
        num_workers: DataLoader worker processes; None (default): 2 where the machine has cores to spare for
            them (Lightning's ``suggested_max_num_workers`` for the trainer's devices is above 1, as on a GPU node),
            else 0 (a machine with a core or two per process, where workers would compete with the step).
        seed: seeds the document order, the held-out split and the sampler's shuffling.
        val_path: a token file to validate on (the whole file). Excludes ``val_fraction``.
        val_fraction: share of the documents of ``path`` held out for validation (at least one document, chosen
            by ``seed``, never trained on); 0 (default) and no ``val_path``: no validation.

    Sharding: when the trainer's strategy has ``distributed_sampler_kwargs`` (data-parallel rank and
    size), the sampler shuffles and deals every epoch over those, so all pipeline and sequence-parallel
    ranks of one data-parallel replica draw the same batch; otherwise every process draws the whole
    dataset in the same seeded order. Incomplete training batches are dropped, so every batch has
    ``batch_size`` rows (pipeline schedules split the batch into micro-batches).

    Exact resume: the training loader is a ``ResumableLoader`` (``lightning_sppo.data.loader``); the Trainer saves
    its position in every checkpoint and resumes mid-epoch from it (Lightning's fit loop calls its ``state_dict``
    and ``load_state_dict``). The position counts samples of the whole data-parallel group, so a resume with
    another data-parallel size and the same global batch continues at the same sample.

    Without packing, a sample is one document's window, padded at the end: a run whose samples would be mostly
    padding (``data.seq_len`` above the longest training document, or more than ``PADDING_WARNING_SHARE`` of the
    target positions padded) warns once, on rank 0, naming ``data.packing: true``. A data set too short for one
    sample of ``seq_len`` is a one-line error naming what to change (``data.seq_len``, ``data.val_fraction``, ...).

    Validation visits every held-out sample exactly once: the set is padded with rows whose targets are all
    ignored up to a multiple of ``batch_size`` x data-parallel size, so every rank runs the same number of full
    batches and the padding adds nothing to the loss.
    """

    @classmethod
    @override
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> TokenDataModule:
        """Refused before the file is read: Lightning's loader reads it with PyTorch's defaults, not as data only
        (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` in the environment, or an ``http`` URL, runs a pickle's code); the
        data module's position is restored by ``sppo fit --ckpt_path`` (the Trainer) instead."""
        raise NotImplementedError(
            f"TokenDataModule.load_from_checkpoint({str(checkpoint_path)!r}) is not supported (it would read the"
            " file with Lightning's loader, not as data only); build TokenDataModule(...) with its settings, and"
            " resume its position with `sppo fit --ckpt_path` (docs/checkpoints.md)."
        )

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        batch_size: int,
        packing: bool = False,
        num_workers: int | None = None,
        seed: int = 0,
        document_mask: bool = True,
        val_path: str | os.PathLike | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        super().__init__()
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise SPPOConfigError(
                f"data.seq_len must be a positive integer (tokens per sequence), got seq_len={seq_len!r}; e.g."
                " seq_len=4096."
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise SPPOConfigError(
                f"data.batch_size must be a positive integer, got batch_size={batch_size!r}; e.g. batch_size=1."
            )
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 0):
            raise SPPOConfigError(f"data.num_workers must be >= 0, got num_workers={num_workers!r}.")
        if not str(path).strip():
            raise SPPOConfigError(
                "data.path is empty; name a token file written by sppo-prepare, without its extension, e.g."
                " data.path: data/demo."
            )
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise SPPOConfigError(f"data.seed must be a non-negative integer, got seed={seed!r}; e.g. seed=0.")
        if not 0.0 <= val_fraction < 1.0:
            raise SPPOConfigError(
                f"data.val_fraction is a share of the documents in [0, 1), got val_fraction={val_fraction!r};"
                " e.g. val_fraction=0.05."
            )
        if val_path is not None and val_fraction > 0:
            raise SPPOConfigError(
                f"data.val_path={str(val_path)!r} and data.val_fraction={val_fraction} both choose the validation"
                " set; set one of them."
            )
        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.packing = packing
        self.num_workers = num_workers
        self._limit_val_batches: int | float | None = None  # the trainer's, while a fit without validation runs
        self.seed = seed
        self.document_mask = document_mask
        self.val_path = val_path
        self.val_fraction = val_fraction
        self.train_dataset: PackedSequences | None = None
        self.val_dataset: PackedSequences | None = None
        self._padding_checked = False

    @property
    def has_validation(self) -> bool:
        return self.val_path is not None or self.val_fraction > 0

    def setup(self, stage: str | None = None) -> None:
        if stage == "validate" and not self.has_validation:
            raise SPPOConfigError(
                "sppo validate needs validation data: set data.val_path (a token file) or data.val_fraction"
                " (e.g. 0.05 of the documents of data.path, as in training)."
            )
        if stage == "fit" and not self.has_validation and hasattr(self.trainer, "limit_val_batches"):
            # No validation loop to feed (an empty loader would only draw Lightning's warning); teardown restores it.
            if self._limit_val_batches is None:  # a second setup before teardown keeps the first value
                self._limit_val_batches = self.trainer.limit_val_batches
            self.trainer.limit_val_batches = 0
        if self.train_dataset is not None:
            return
        token_file = _open(self.path, "data.path")
        train_documents = None
        if self.val_path is not None:
            val_file = _open(self.val_path, "data.val_path")
            self.val_dataset = self._samples(val_file, None, None, f"data.val_path={str(self.val_path)!r}")
        elif self.val_fraction > 0:
            train_documents, val_documents = held_out_documents(token_file.num_documents, self.val_fraction, self.seed)
            what = f"the validation set (data.val_fraction={self.val_fraction} of data.path)"
            self.val_dataset = self._samples(token_file, None, val_documents, what)
        what = f"data.path={str(self.path)!r}" + (" (its training documents)" if train_documents is not None else "")
        self.train_dataset = self._samples(token_file, self.seed, train_documents, what)
        self._warn_about_padding()

    def teardown(self, stage: str | None = None) -> None:
        if self._limit_val_batches is not None and self.trainer is not None:
            self.trainer.limit_val_batches, self._limit_val_batches = self._limit_val_batches, None

    def _samples(
        self, token_file: TokenFile, seed: int | None, documents: np.ndarray | None, what: str
    ) -> PackedSequences:
        """The samples of ``documents`` of ``token_file``; none at all is one line naming what to change."""
        try:
            return PackedSequences(token_file, self.seq_len, self.packing, seed, self.document_mask, documents)
        except ValueError as error:
            if "gives no sample" not in str(error):
                raise
        lengths = _lengths(token_file, documents)
        more = "raise data.val_fraction, " if what.startswith("the validation set") else ""
        need = (
            f"with data.packing: true a sample needs data.seq_len + 1 = {self.seq_len + 1} tokens"
            if self.packing
            else "without data.packing every document has fewer than 2 tokens"
        )
        raise SPPOConfigError(
            f"{what} gives no sample of data.seq_len={self.seq_len}: its {len(lengths)} documents hold"
            f" {int(lengths.sum())} tokens, and {need}; {more}lower data.seq_len, or use a token file with more text."
        )

    def _warn_about_padding(self) -> None:
        """Once, on rank 0: most of an epoch's target positions would be padding (no packing)."""
        if self.packing or self._padding_checked or self.train_dataset is None:
            return
        self._padding_checked = True
        lengths = self.train_dataset.document_lengths
        padded, positions = padding_share(lengths, self.seq_len)
        longest = int(lengths.max()) if len(lengths) else 0
        if positions and (padded / positions > PADDING_WARNING_SHARE or self.seq_len > longest):
            rank_zero_warn(
                f"data.seq_len={self.seq_len} without data.packing: {padded / positions:.0%} of the target positions"
                f" of an epoch are padding ({padded:,} of {positions:,}; the longest of the {len(lengths)} training"
                f" documents has {longest:,} tokens), and a padded position costs as much compute as a real one. Set"
                " data.packing: true to fill every sample with documents (data.document_mask: true, the default,"
                " still trains each alone), or lower data.seq_len."
            )

    def _workers(self) -> int:
        """``num_workers``, or when None: 2 where the trainer's devices leave cores to spare, else 0."""
        if self.num_workers is not None:
            return self.num_workers
        trainer = getattr(self, "trainer", None)
        devices = getattr(trainer, "num_devices", 1) or 1
        return 2 if suggested_max_num_workers(devices) > 1 else 0

    def train_dataloader(self) -> ResumableLoader:
        strategy = getattr(self.trainer, "strategy", None)
        return self.dataloader(getattr(strategy, "distributed_sampler_kwargs", None))

    def val_dataloader(self) -> DataLoader | list:
        if not self.has_validation:
            return []  # no validation set: the Trainer runs no validation
        strategy = getattr(self.trainer, "strategy", None)
        return self.validation_dataloader(getattr(strategy, "distributed_sampler_kwargs", None))

    def dataloader(self, sampler_kwargs: dict | None = None) -> ResumableLoader:
        """Training batches for one data-parallel replica: ``sampler_kwargs`` are ``num_replicas`` and ``rank``
        (as a strategy's ``distributed_sampler_kwargs`` give them); None draws from the whole dataset.

        A ``ResumableLoader``: its ``state_dict`` is the position in the epoch, as samples of the whole
        data-parallel group (checkpoint it to resume exactly, also with another data-parallel size); call
        ``loader.sampler.set_epoch(epoch)`` before each epoch, as the Trainer does.
        """
        self.setup("fit")
        sampler = self._sampler(self.train_dataset, sampler_kwargs)
        if len(sampler) < self.batch_size:
            raise SPPOConfigError(
                f"{self.train_dataset!r} gives {len(sampler)} samples per replica, fewer than"
                f" data.batch_size={self.batch_size}; use a smaller batch_size or seq_len."
            )
        workers = self._workers()
        return ResumableLoader(
            self.train_dataset, self.batch_size, sampler, num_workers=workers, persistent_workers=workers > 0
        )

    def validation_dataloader(self, sampler_kwargs: dict | None = None) -> DataLoader:
        """Validation batches for one data-parallel replica: its share of every held-out sample, in order,
        padded so every replica runs the same number of full batches (see the class docstring)."""
        self.setup("validate")
        replicas = sampler_kwargs["num_replicas"] if sampler_kwargs else 1
        samples = _Padded(self.val_dataset, replicas * self.batch_size)
        sampler = DistributedSampler(samples, **sampler_kwargs, shuffle=False) if sampler_kwargs else None
        workers = self._workers()
        return DataLoader(
            samples,
            batch_size=self.batch_size,
            sampler=sampler or SequentialSampler(samples),
            num_workers=workers,
            persistent_workers=workers > 0,  # validation runs every few hundred steps: keep them
        )

    def _sampler(self, dataset: PackedSequences, kwargs: dict | None) -> ResumableSampler:
        kwargs = kwargs or {"num_replicas": 1, "rank": 0}
        return ResumableSampler(dataset, kwargs["num_replicas"], kwargs["rank"], seed=self.seed)


def held_out_documents(num_documents: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) document indices, each ascending: ``round(fraction * num_documents)`` documents, at
    least one, drawn by ``seed``. The same on every process and every run with the same arguments."""
    held_out = max(1, round(fraction * num_documents))
    if held_out >= num_documents:
        raise SPPOConfigError(
            f"data.val_fraction={fraction} holds out {held_out} of the {num_documents} documents of data.path,"
            " leaving none to train on; lower val_fraction or give a separate data.val_path."
        )
    order = np.random.default_rng(seed).permutation(num_documents)
    return np.sort(order[held_out:]), np.sort(order[:held_out])


def padding_share(lengths: np.ndarray, seq_len: int) -> tuple[int, int]:
    """(padded target positions, all target positions) of an epoch without packing, for documents of
    ``lengths`` tokens (each plus its eos, if any): a document of L tokens gives ceil((L - 1) / seq_len) windows
    of ``seq_len`` positions, L - 1 of them real."""
    real = np.maximum(lengths.astype(np.int64) - 1, 0)
    windows = (real + seq_len - 1) // seq_len
    positions = int(windows.sum()) * seq_len
    return positions - int(real.sum()), positions


def _lengths(token_file: TokenFile, documents: np.ndarray | None) -> np.ndarray:
    lengths = token_file.offsets[1:] - token_file.offsets[:-1]
    return lengths if documents is None else lengths[np.asarray(documents, dtype=np.int64)]


def _open(path: str | os.PathLike, setting: str) -> TokenFile:
    if (problem := _not_a_token_file(str(path), setting)) is not None:
        raise SPPOConfigError(f"{setting}={str(path)!r} {problem}")
    try:
        return TokenFile.open(path)
    except (FileNotFoundError, ValueError) as error:  # missing, or not a token file this version reads
        raise SPPOConfigError(f"{setting}={str(path)!r}: {error}") from error


def _not_a_token_file(path: str, setting: str) -> str | None:
    """What to do when ``path`` names the input of ``sppo-prepare`` (a text file, a folder of them) rather than the
    token file it writes (``NAME`` for ``NAME.bin``, ``.idx`` and ``.json``); None otherwise. The command it
    suggests writes the token file beside the input, under the name to set."""
    if not path.strip():
        return None
    given = Path(path)
    if given.is_file() and given.suffix not in TOKEN_FILE_SUFFIXES:
        if given.stat().st_size == 0:
            return (
                "is an empty file: there is no text in it to train on. Put text in it, or give another"
                f" file: prepare text with `sppo-prepare TEXT_FILES... --output NAME` and set {setting}: NAME."
            )
        name = str(given.with_suffix(""))
    elif given.is_dir():
        name = str(given) + "-tokens"
    else:
        return None
    if token_file_paths(name)[2].is_file():
        return f"is the input of a token file, not one; the token file beside it is {name!r}: set {setting}: {name}."
    return (
        f"is {'a folder of texts' if given.is_dir() else 'a text file'}, not a token file (NAME.bin, NAME.idx and"
        f" NAME.json from sppo-prepare): prepare it with `sppo-prepare {path} --output {name}` and set"
        f" {setting}: {name}."
    )


class _Padded(Dataset):
    """``dataset``, then rows whose targets are all ignored, up to a multiple of ``multiple`` samples."""

    def __init__(self, dataset: PackedSequences, multiple: int) -> None:
        self.dataset = dataset
        self.length = math.ceil(len(dataset) / multiple) * multiple

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < len(self.dataset):
            return self.dataset[index]
        seq_len = self.dataset.seq_len
        row = {
            "input_ids": torch.full((seq_len,), self.dataset.pad_id, dtype=torch.long),
            "targets": torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long),
        }
        if self.dataset.document_mask:  # a batch's rows carry the same keys
            row["document_ids"] = torch.zeros(seq_len, dtype=torch.long)
        return row
