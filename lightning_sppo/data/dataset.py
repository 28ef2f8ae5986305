"""Fixed-length training samples cut from a token file, with or without packing documents together.

Each sample is ``{"input_ids": LongTensor[seq_len], "targets": LongTensor[seq_len]}`` with
``targets[t]`` the id after ``input_ids[t]`` (``IGNORE_INDEX`` where there is none), the contract of
``SPPOStrategy.forward_backward``; packed samples with document masking add ``"document_ids"``. What a
sample holds decides what attends to what:

- ``packing=False`` (default): a sample never crosses a document boundary. A document is cut into
  windows of ``seq_len + 1`` tokens that overlap by one token, so every next-token pair of the
  document is a target exactly once; the last window is padded (inputs with ``eos_id``, or 0 when
  the file has none; targets with ``IGNORE_INDEX``). Documents shorter than two tokens give no sample.
- ``packing=True``: documents are concatenated, separated by ``eos_id`` (with no separator when the
  file has none), and the stream is cut into full windows. The remainder of the stream, shorter than a
  window, is dropped. With ``document_mask=True`` (the default) each sample also carries
  ``document_ids`` [seq_len] (int64, 0 for the window's first document, +1 at each next one; the eos
  after a document belongs to the document it ends), so every token attends only to its own document
  and positions restart per document (``lightning_sppo.documents``); the target of a document's last
  token (its eos, or without eos its last id), which is the next document's first id, becomes
  ``IGNORE_INDEX``: nothing in a document predicts the next one, exactly as when training documents
  separately. ``document_mask=False``: a token attends to the earlier documents of its window too.

When the file has an ``eos_id``, it also ends every document in both modes (the last target of a
document is eos), so the model learns where documents end.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_sppo.data.token_file import TokenFile
from lightning_sppo.loss import IGNORE_INDEX

__all__ = ["PackedSequences"]


class PackedSequences(Dataset):
    """Map-style dataset of ``seq_len``-token samples from a ``TokenFile`` (see the module docstring).

    Args:
        token_file: an open ``TokenFile``, or the path of one.
        seq_len: tokens per sample (the model's sequence length).
        packing: concatenate documents into full windows (True) or keep each sample inside one document.
        document_mask: with packing, give each sample ``document_ids`` and ignore the targets that cross into
            the next document, so documents are trained as if alone (the default); False lets tokens attend
            across document boundaries. Without packing a sample is one document: nothing to mask.
        seed: order of the documents, a permutation drawn from this seed; ``None`` keeps file order.
            With packing this decides which documents share a window. The order of samples across
            epochs is the sampler's job.
        documents: the file's documents (indices) this dataset draws from, e.g. a training or a held-out
            split; ``None``: all of them.

    The dataset is the same on every process given the same file, ``seq_len``, ``packing`` and
    ``seed``. It does not shard itself: for data parallel training wrap it in a
    ``DistributedSampler`` built from the strategy's ``distributed_sampler_kwargs`` (data-parallel rank
    and size only, so every pipeline and sequence-parallel rank of one replica sees the same batch), as
    ``TokenDataModule`` does.
    """

    def __init__(
        self,
        token_file: TokenFile | str | os.PathLike,
        seq_len: int,
        packing: bool = False,
        seed: int | None = 0,
        document_mask: bool = True,
        documents: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"PackedSequences.seq_len must be a positive integer, got seq_len={seq_len!r}.")
        self.token_file = token_file if isinstance(token_file, TokenFile) else TokenFile.open(token_file)
        self.seq_len = seq_len
        self.packing = bool(packing)
        """Whether samples concatenate documents."""
        self.document_mask = bool(document_mask) and self.packing
        """Whether packed samples carry ``document_ids`` (tokens attend only within their document)."""
        self.seed = seed
        self.eos_id = self.token_file.eos_id
        self.pad_id = 0 if self.eos_id is None else self.eos_id
        """Input id of padding positions (their targets are ``IGNORE_INDEX``)."""

        tf = self.token_file
        chosen = np.arange(tf.num_documents) if documents is None else np.asarray(documents, dtype=np.int64)
        order = chosen if seed is None else chosen[np.random.default_rng(seed).permutation(len(chosen))]
        self._order = order
        # Stream lengths: each document plus its eos, if the file has one.
        lengths = (tf.offsets[1:] - tf.offsets[:-1])[order] + (self.eos_id is not None)  # [D]
        self.document_lengths = lengths
        """Tokens of each of the dataset's documents, in its order (each with its eos, when the file has one)."""
        self._starts = np.concatenate(([0], np.cumsum(lengths)))  # [D + 1], document starts in the stream
        if tf.num_tokens == 0:
            self._length = 0
        elif self.packing:
            self._length = max(0, int(self._starts[-1]) - 1) // seq_len
        else:
            windows = np.maximum(lengths - 1, 0)
            windows = (windows + seq_len - 1) // seq_len  # ceil((len - 1) / seq_len) windows per document
            self._window_starts = np.concatenate(([0], np.cumsum(windows)))  # [D + 1]
            self._length = int(self._window_starts[-1])
        if self._length == 0:
            raise ValueError(
                f"{tf.path} gives no sample of seq_len={seq_len} with packing={self.packing}: it has"
                f" {int(self._starts[-1]) - len(order) * (self.eos_id is not None)} tokens in {len(order)} documents"
                + (
                    " (each sample needs seq_len + 1 tokens); use a smaller seq_len."
                    if self.packing
                    else "; every document has < 2 tokens."
                )
            )

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self._length <= index < self._length:
            raise IndexError(f"Sample index {index} out of range for {self._length} samples.")
        index %= self._length
        if self.packing:
            start = index * self.seq_len
            window, docs = self._read_stream(start, start + self.seq_len + 1)
        else:
            doc = int(np.searchsorted(self._window_starts, index, side="right")) - 1
            start = int(self._starts[doc]) + (index - int(self._window_starts[doc])) * self.seq_len
            window, docs = self._read_stream(start, min(start + self.seq_len + 1, int(self._starts[doc + 1])))
        tokens = torch.from_numpy(window.astype(np.int64))  # [n], n <= seq_len + 1
        n = tokens.numel() - 1  # real next-token pairs
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        input_ids[:n] = tokens[:-1]
        targets[:n] = tokens[1:]
        if not self.document_mask:
            return {"input_ids": input_ids, "targets": targets}
        docs = torch.from_numpy(docs - docs[0])  # [seq_len + 1]: packed windows are full
        targets[docs[1:] != docs[:-1]] = IGNORE_INDEX  # a document's last token: its target opens the next one
        return {"input_ids": input_ids, "targets": targets, "document_ids": docs[:-1]}

    def _read_stream(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions ``[lo, hi)``: the ordered documents, each followed by eos if the file has one; and
        the stream index of each position's document (its eos included)."""
        positions = np.arange(lo, hi)  # [n]
        doc = np.searchsorted(self._starts, positions, side="right") - 1  # [n], stream document index
        within = positions - self._starts[doc]
        file_doc = self._order[doc]
        tokens = self.token_file.ids[
            np.minimum(self.token_file.offsets[file_doc] + within, self.token_file.num_tokens - 1)
        ]
        if self.eos_id is not None:
            # The eos after a document is the last stream position of that document.
            tokens = np.where(positions == self._starts[doc + 1] - 1, self.eos_id, tokens)
        return tokens, doc

    def __repr__(self) -> str:
        if self.packing:
            how = "documents concatenated" + (
                f", separated by eos_id={self.eos_id}" if self.eos_id is not None else " with no separator"
            )
            how += ", each attending only to itself" if self.document_mask else ", attending across boundaries"
        else:
            how = "one document per sample, tails padded"
        return (
            f"PackedSequences({str(self.token_file.path)!r}, seq_len={self.seq_len}, packing={self.packing} ({how}),"
            f" seed={self.seed}, samples={self._length})"
        )
