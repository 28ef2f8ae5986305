"""Packed documents in a batch: where each token's document starts, derived once per (micro-)batch.

Shape legend: B batch rows, S sequence length, o offset and s length of a window (a subsequence, or a block of
one), P pieces of a window.

``document_ids`` [B, S] is an integer tensor, non-decreasing along each row: the tokens of a row that share an id
form one document (contiguous, since ids never decrease). Training on it is training every document alone:

* token t attends to the keys [starts[t], t] of its own document, where ``starts[t]`` is the index of the first
  token of t's document (a cumulative maximum over the positions where the id changes);
* its RoPE position is ``t - starts[t]``: positions restart at 0 at each document's first token.

``Documents`` holds ``starts`` on the batch's device (for positions and dense masks) and, per row, the document
boundaries as host integers, from which every window's ``Pieces`` (what the attention kernels are told) is cut
without reading the device. Windows are memoised: every layer of a stage asks for the same subsequence's pieces.

A window [o, o + s) of a row falls into pieces, one per document it touches: block-diagonal causal attention
within each piece, plus, for the first piece only and only when its document started before o, the keys
[start, o) of the cache (the *prefix* part). Rows whose document starts at o or later skip the prefix entirely.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Documents", "Pieces", "check_document_ids"]


def check_document_ids(document_ids: Tensor, shape: tuple[int, ...] | None = None, ordered: bool = True) -> None:
    """Errors for ``document_ids`` that are not an integer [B, S] tensor, non-decreasing along each row.

    ``shape``: the shape they must have (that of ``input_ids``). ``ordered`` checks the order too, which reads the
    ids on the host (``Documents.from_ids`` does, once per batch).
    """
    if not isinstance(document_ids, Tensor):
        raise TypeError(
            f"document_ids must be an integer tensor [batch, seq_len], got {type(document_ids).__name__}."
            " Pass document_ids as a keyword argument, e.g. model(input_ids, document_ids=ids)."
        )
    if document_ids.dim() != 2 or document_ids.dtype not in (torch.int16, torch.int32, torch.int64, torch.uint8):
        raise ValueError(
            f"document_ids must be an integer tensor [batch, seq_len], got shape {tuple(document_ids.shape)}"
            f" and dtype {document_ids.dtype}; e.g. torch.zeros_like(input_ids) for one document per row."
        )
    if shape is not None and tuple(document_ids.shape) != tuple(shape):
        raise ValueError(
            f"document_ids must have the shape of input_ids {tuple(shape)}, got {tuple(document_ids.shape)}."
        )
    if not ordered:
        return
    ids = document_ids.detach().cpu().to(torch.int64)
    falling = ids[:, 1:] < ids[:, :-1]  # [B, S - 1]
    if bool(falling.any()):
        row, col = (int(x) for x in torch.nonzero(falling)[0])
        raise ValueError(
            "document_ids must be non-decreasing along each row (a document is a contiguous run of tokens), got"
            f" document_ids[{row}, {col}]={int(ids[row, col])} followed by {int(ids[row, col + 1])}; number the"
            " documents of a row in order, e.g. 0, 0, 0, 1, 1, 2."
        )


@dataclass(eq=False)
class Pieces:
    """The documents inside the window [offset, offset + length) of every row: what a kernel call is told.

    ``bounds[b]``: piece boundaries of row b relative to the window, 0 = b_0 < b_1 < ... < b_P = length; piece j
    is the queries (and, on the diagonal, the keys) [b_j, b_{j+1}). ``first_starts[b]``: absolute position where
    the document of the window's first token starts (< offset when that document began earlier).
    """

    offset: int
    length: int
    bounds: tuple[tuple[int, ...], ...]
    first_starts: tuple[int, ...]
    _device_tensors: dict = field(default_factory=dict, repr=False)

    @property
    def split(self) -> bool:
        """Whether some row's window holds more than one document (else the diagonal is plainly causal)."""
        return any(len(b) > 2 for b in self.bounds)

    @property
    def max_length(self) -> int:
        """The longest piece."""
        return max(b[j + 1] - b[j] for b in self.bounds for j in range(len(b) - 1))

    @property
    def num_pieces(self) -> int:
        return sum(len(b) - 1 for b in self.bounds)

    def prefix_groups(self) -> list[tuple[slice, int, int]]:
        """(rows, m, start): queries [0, m) of ``rows`` attend to the cached keys [start, offset).

        One group for all rows when they agree (one batched call, as without documents), else one per row that
        has a prefix part. Rows whose first document starts at ``offset`` or later have none.
        """
        parts = [(b[1], start) for b, start in zip(self.bounds, self.first_starts, strict=True)]
        if len(set(parts)) == 1 and parts[0][1] < self.offset:
            return [(slice(None), *parts[0])]
        return [(slice(r, r + 1), m, start) for r, (m, start) in enumerate(parts) if start < self.offset]

    def cu_seqlens(self, device: torch.device) -> Tensor:
        """int32 [P + 1]: piece boundaries over the B * length tokens of the rows laid end to end (varlen form)."""
        key = ("cu_seqlens", device)
        if key not in self._device_tensors:
            flat = [0]
            for row, b in enumerate(self.bounds):
                flat.extend(row * self.length + x for x in b[1:])
            self._device_tensors[key] = _to_device(torch.tensor(flat, dtype=torch.int32), device)
        return self._device_tensors[key]

    def segment_ids(self, device: torch.device) -> Tensor:
        """int64 [B, length]: the index of each token's piece within its row (for masks built from comparisons)."""
        key = ("segment_ids", device)
        if key not in self._device_tensors:
            rows = []
            for b in self.bounds:
                sizes = torch.tensor([b[j + 1] - b[j] for j in range(len(b) - 1)])
                rows.append(torch.repeat_interleave(torch.arange(len(sizes)), sizes))
            self._device_tensors[key] = _to_device(torch.stack(rows), device)
        return self._device_tensors[key]


class Documents:
    """Where each token's document starts, for a batch [B, S] (see the module docstring).

    Build it with ``Documents.from_ids(document_ids, device)``; the runtime cuts micro-batches with ``rows``.
    """

    def __init__(self, starts: Tensor, bounds: tuple[tuple[int, ...], ...], host_starts: Tensor) -> None:
        self.starts = starts  # [B, S] int64 on the batch's device
        self.bounds = bounds  # per row: the document start positions, ascending, the first 0
        self._host_starts = host_starts  # [B, S] int64 on the CPU
        self._windows: dict[tuple[int, int], Pieces] = {}

    @classmethod
    def from_ids(cls, document_ids: Tensor, device: torch.device | str | None = None) -> Documents:
        """Validate ``document_ids`` [B, S] and derive the structure; ``starts`` goes to ``device`` (default: the
        ids' device). Give ids on the CPU (as a data loader yields them) to spare a device-to-host copy."""
        check_document_ids(document_ids)
        ids = document_ids.detach().cpu().to(torch.int64)
        B, S = ids.shape
        first = torch.ones(B, 1, dtype=torch.bool)
        is_start = torch.cat([first, ids[:, 1:] != ids[:, :-1]], dim=1)  # [B, S]
        index = torch.arange(S).expand(B, S)
        host_starts = torch.where(is_start, index, 0).cummax(dim=1).values  # [B, S]
        bounds = tuple(tuple(torch.nonzero(row).flatten().tolist()) for row in is_start)
        target = document_ids.device if device is None else torch.device(device)
        return cls(_to_device(host_starts, target), bounds, host_starts)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.starts.shape)

    def rows(self, rows: slice) -> Documents:
        """The documents of some rows (a micro-batch)."""
        return Documents(self.starts[rows], self.bounds[rows], self._host_starts[rows])

    def positions(self, offset: int, length: int) -> Tensor:
        """int64 [B, length]: RoPE positions of the tokens [offset, offset + length) (0 at each document start)."""
        index = torch.arange(offset, offset + length, device=self.starts.device)
        return index - self.starts[:, offset : offset + length]

    def attention_mask(self) -> Tensor:
        """bool [B, 1, S, S]: query t sees key j when starts[t] <= j <= t (the plain model's dense mask)."""
        S = self.starts.shape[1]
        keys = torch.arange(S, device=self.starts.device)
        queries = keys[:, None]
        return ((keys[None, :] <= queries) & (keys[None, None, :] >= self.starts[:, :, None]))[:, None]

    def key_counts(self) -> Tensor:
        """float64 [S] on the CPU: keys each position attends, t - starts[t] + 1, summed over the rows.

        Attention work of a token is proportional to it; partitions balance with it (``partition``).
        """
        S = self._host_starts.shape[1]
        return (torch.arange(1, S + 1) - self._host_starts).sum(dim=0).to(torch.float64)

    def window(self, offset: int, length: int) -> Pieces:
        """The ``Pieces`` of [offset, offset + length) in every row (memoised)."""
        key = (offset, length)
        if key not in self._windows:
            S = self.starts.shape[1]
            if offset < 0 or length < 1 or offset + length > S:
                raise ValueError(f"Window {offset}..{offset + length} is outside the documents' {S} tokens.")
            bounds, first_starts = [], []
            for starts in self.bounds:
                first = bisect.bisect_right(starts, offset) - 1  # the document of the window's first token
                inside = starts[first + 1 : bisect.bisect_left(starts, offset + length)]
                bounds.append((0, *(x - offset for x in inside), length))
                first_starts.append(starts[first])
            self._windows[key] = Pieces(offset, length, tuple(bounds), tuple(first_starts))
        return self._windows[key]


def _to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device``; to CUDA through pinned memory, so the copy does not wait for the device."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
