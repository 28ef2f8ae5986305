"""Where the spilled part of the K/V caches lives, and the copies that move it (``kv_device_tokens``).

A cache keeps tokens [0, R) of its layer's K/V and dK/dV on the device and [R, S) in host memory (pinned on
CUDA), R = ``device_tokens``. The host part moves in chunks of ``chunk_tokens`` through a ``CopyEngine``: on
CUDA its own side stream, so a chunk's copy overlaps the attention over the previous chunk; on CPU plain copies.

One ``KVSpill`` serves every cache of a ``CachePool``: its host memory is one ``HostPool`` (taken again from its
start every step, so it never grows once the first step has run), and it keeps each device -> host copy's
source alive until the compute stream has waited for it (``store``). Only the latest store is left in flight:
a store first retires the one before it, so the device holds at most one chunk pair being written back.

Why waits matter: a destination of ``fetch`` holds garbage until ``wait`` (a deferred copy engine in the tests
shows it); a source given to ``store`` may not change or be freed until the copy has run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_sppo.offload.pool import HostPool
    from lightning_sppo.offload.streams import CopyEngine, CopyTicket

__all__ = ["DEFAULT_KV_CHUNK_TOKENS", "KVSpill"]

DEFAULT_KV_CHUNK_TOKENS = 16384


class KVSpill:
    """Host memory and copies for the host part of K/V caches.

    Args:
        device_tokens: R, the tokens of each layer's K/V and dK/dV kept on the device (``kv_device_tokens``).
        chunk_tokens: tokens per chunk streamed back to the device (``kv_chunk_tokens``).
        copies: the copy engine; None builds one for the caches' device at the first copy (``CudaCopies`` on CUDA,
            ``SyncCopies`` elsewhere). Tests pass engines that delay copies.
    """

    def __init__(
        self, device_tokens: int, chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS, copies: CopyEngine | None = None
    ) -> None:
        if device_tokens < 0:
            raise ValueError(f"kv_device_tokens must be >= 0 (or None), got kv_device_tokens={device_tokens}.")
        if chunk_tokens < 1:
            raise ValueError(f"kv_chunk_tokens must be a positive integer, got kv_chunk_tokens={chunk_tokens}.")
        self.device_tokens = device_tokens
        self.chunk_tokens = chunk_tokens
        self.copies = copies
        self._host: HostPool | None = None
        self._in_flight: list[tuple[CopyTicket, tuple[Tensor, ...]]] = []

    # -- host memory ---------------------------------------------------------------------------------

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised host tensor, valid until ``begin_step``."""
        numel = math.prod(shape)
        if self._host is None:
            from lightning_sppo.offload.pool import DEFAULT_SLAB_BYTES, HostPool  # offload imports the runtime

            # Slabs of about 16 parts (at most the pool's default): little rounding for tiny and medium parts;
            # a part larger than a slab gets a slab of its own (rounded up to a power of two, as pinned memory is).
            slab = min(DEFAULT_SLAB_BYTES, max(512, 16 * numel * dtype.itemsize))
            setting = f"kv_device_tokens={self.device_tokens}"
            self._host = HostPool(pin_memory=torch.cuda.is_available(), slab_bytes=slab, setting=setting)
        return self._host.take(numel, dtype).view(shape)

    def begin_step(self) -> None:
        """A new step: every host slice is free again (after the copies still writing them are done)."""
        self.settle()
        if self._host is not None:
            self._host.reset()

    def release(self) -> None:
        self.settle()
        if self._host is not None:
            self._host.release()

    def host_capacity_bytes(self) -> int:
        """Host bytes held by the pool (the caches' host parts, plus the pool's rounding)."""
        return 0 if self._host is None else self._host.capacity_bytes

    # -- copies ----------------------------------------------------------------------------------------

    def engine(self, device: torch.device) -> CopyEngine:
        if self.copies is None:
            from lightning_sppo.offload.streams import CudaCopies, SyncCopies

            self.copies = CudaCopies(device) if device.type == "cuda" else SyncCopies(device)
        return self.copies

    def fetch(self, pairs: list[tuple[Tensor, Tensor]]) -> CopyTicket:
        """Copy each (device, host) pair host -> device; read the destinations only after ``wait``."""
        return self.engine(pairs[0][0].device).h2d(pairs)

    def wait(self, ticket: CopyTicket | None) -> None:
        """Make the compute stream wait for a ``fetch`` (None: nothing was fetched)."""
        if ticket is not None:
            self.copies.wait(ticket)

    def store(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Copy each (host, device) pair device -> host after the compute queued so far; the sources stay alive (and
        must stay unchanged) until a later ``store`` or ``settle`` has the compute stream wait for the copy."""
        self.settle()
        pairs = [(host, device.contiguous()) for host, device in pairs]
        ticket = self.engine(pairs[0][1].device).d2h(pairs)
        self._in_flight.append((ticket, tuple(device for _, device in pairs)))

    def settle(self) -> None:
        """The compute stream waits for every store in flight; their sources may then be freed or reused."""
        for ticket, _ in self._in_flight:
            self.copies.wait(ticket)
        self._in_flight.clear()
