"""Subsequence lengths every rank agrees on: chosen on global rank 0 and broadcast to the world.

The lengths shape every message: the P2P activations and gradients between stages, the Ulysses all-to-all
splits, the blocks of multiplexed (MSP) units. Some inputs of the choice are local to a rank: the
``"adaptive"`` partition reads the offloader's measured costs (forward times differ between stages, the first
holding the embedding and the last the head; copy bandwidths differ between GPUs), and
``num_subsequences="auto"`` plans from the rank's own device (its memory and name). Ranks that chose for
themselves could cut differently, and NCCL then hangs or mixes data. So rank 0 chooses and the others take
its answer; a rank other than 0 never runs the choice at all. (alpha, the share each subsequence offloads,
stays local: it changes what a rank copies to its own host memory, never what it sends.)

What it costs: a choice is *final* when the same batch shape will give the same lengths from now on: every
partition but ``"adaptive"`` at once, ``"adaptive"`` once the offloader has fixed its lengths for the shape
(after its measuring steps). Final choices are kept per batch shape and never sent again; until then each
step broadcasts two small int64 tensors (a header, then the lengths) on the batch's device, which is a CUDA
tensor under NCCL. Packed documents: "flops" and "adaptive" cut each batch by where its documents start (rank
0's batch decides for all), so those choices are never final and every step broadcasts them; batches with
documents are kept apart from batches without (every rank passes ``document_ids`` or none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_sppo.errors import PeerFailedError

__all__ = ["LengthChoice", "SharedLengths"]

BatchShape = tuple[int, int]
"""(sequence length, sequences per micro-batch)."""

_FAILED = -1
"""The header's length count when rank 0's choice raised (its own error says why)."""


@dataclass(frozen=True)
class LengthChoice:
    lengths: list[int]
    final: bool
    """The same batch shape will give these lengths from now on: keep them, stop asking."""


class SharedLengths:
    """Rank 0's subsequence lengths on every rank, asked for once per batch shape once they are final."""

    def __init__(self) -> None:
        self._final: dict[tuple[BatchShape, bool], list[int]] = {}

    def decide(
        self, shape: BatchShape, choose: Callable[[], LengthChoice], device: torch.device, documents: bool = False
    ) -> list[int]:
        """The lengths for a batch of ``shape``: from the cache, or ``choose`` run on rank 0 and broadcast.

        Every rank must call this at the same step with the same ``shape`` (a pipeline needs that anyway);
        ``device`` is where the broadcast tensors live (the batch's: CPU under gloo, the GPU under NCCL).
        ``documents``: the batch has packed documents (its cached choices are kept apart).
        """
        key = (shape, documents)
        if key in self._final:
            return list(self._final[key])
        if dist.is_initialized() and dist.get_world_size() > 1:
            choice = _from_rank_zero(shape, choose, device)
        else:
            choice = choose()
        if choice.final:
            self._final[key] = list(choice.lengths)
        return list(choice.lengths)


def _from_rank_zero(shape: BatchShape, choose: Callable[[], LengthChoice], device: torch.device) -> LengthChoice:
    """Rank 0 runs ``choose`` and broadcasts [seq_len, batch, N, final] and then the N lengths."""
    if dist.get_rank() == 0:
        try:
            choice = choose()
        except Exception:
            dist.broadcast(torch.tensor([*shape, _FAILED, 0], dtype=torch.int64, device=device), src=0)
            raise  # the others raise too instead of waiting for lengths that never come
        header = torch.tensor([*shape, len(choice.lengths), int(choice.final)], dtype=torch.int64, device=device)
        dist.broadcast(header, src=0)
        dist.broadcast(torch.tensor(choice.lengths, dtype=torch.int64, device=device), src=0)
        return choice
    header = torch.empty(4, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    seq_len, batch, count, final = header.tolist()  # one host sync, only while the choice is not final
    if count == _FAILED:
        raise PeerFailedError(
            "Rank 0 could not choose the subsequence lengths (its own error says why); this rank stops too."
        )
    lengths = torch.empty(count, dtype=torch.int64, device=device)
    dist.broadcast(lengths, src=0)
    if (seq_len, batch) != tuple(shape):
        raise RuntimeError(
            f"Rank 0 cuts micro-batches of {batch} x {seq_len} tokens but rank {dist.get_rank()} has"
            f" {shape[1]} x {shape[0]}: every rank must step with the same batch shape (use a sampler that pads"
            " or drops the last batch, e.g. drop_last=True)."
        )
    return LengthChoice(lengths.tolist(), bool(final))
