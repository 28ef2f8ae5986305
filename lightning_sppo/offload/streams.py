"""Copies between device and host, and the marks that time them: a CUDA side stream, or plain CPU copies.

The offloader is written once against ``CopyEngine``. On CUDA, copies run on a side stream ordered by
events, so the host never blocks in the loop; on CPU (tests, CI) the same calls copy at once with ``copy_``.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = ["CopyEngine", "CopyTicket", "CudaCopies", "SyncCopies"]

Mark = Any
"""A point in time on the compute stream: a ``torch.cuda.Event`` on CUDA, a ``perf_counter`` value on CPU."""


class CopyTicket(NamedTuple):
    """A batch of copies in flight: marks before and after them on the copy stream."""

    start: Mark
    done: Mark


class CopyEngine(Protocol):
    def mark(self) -> Mark:
        """A point on the compute stream (now, in stream order)."""

    def elapsed(self, start: Mark, end: Mark) -> float:
        """Seconds between two marks (may block until ``end`` has happened: call it outside the loop)."""

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A device buffer allocated in compute-stream order."""

    def d2h(self, pairs: list[tuple[Tensor, Tensor]]) -> CopyTicket:
        """Copy each (host, device) pair device -> host after everything the compute stream has been given so far."""

    def h2d(self, pairs: list[tuple[Tensor, Tensor]]) -> CopyTicket:
        """Copy each (device, host) pair host -> device, into buffers from ``empty``."""

    def wait(self, ticket: CopyTicket) -> tuple[Mark, Mark] | None:
        """Make the compute stream wait for the copies; returns marks around the wait (GPU only)."""

    def synchronize(self) -> None:
        """Block until every copy is done (teardown only)."""


class SyncCopies:
    """CPU: copies happen at once with ``copy_`` into separate host tensors; nothing to wait for."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, start: float, end: float) -> float:
        return end - start

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def d2h(self, pairs: list[tuple[Tensor, Tensor]]) -> CopyTicket:
        start = time.perf_counter()
        for host, device in pairs:
            host.copy_(device)
        return CopyTicket(start, time.perf_counter())

    def h2d(self, pairs: list[tuple[Tensor, Tensor]]) -> CopyTicket:
        start = time.perf_counter()
        for device, host in pairs:
            device.copy_(host)
        return CopyTicket(start, time.perf_counter())

    def wait(self, ticket: CopyTicket) -> None:
        return None

    def synchronize(self) -> None:
        return None


class CudaCopies:
    """One side stream for both directions (D2H in forward, H2D in backward never overlap in time).

    Buffers are allocated on the compute stream and only ever freed after the compute stream has waited
    for the copy that touches them, so the caching allocator never hands out memory a copy still uses.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._compute())
        return event

    def elapsed(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # waits for this one event, not for the device
        return start.elapsed_time(end) / 1e3

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)  # current (compute) stream's pool

    def d2h(self, pairs: list[tuple[Tensor, Tensor]]) -> CopyTicket:
        # The copies may start only once the forward that wrote the data has run: wait for a mark recorded
        # on the compute stream now. The compute stream itself runs on (the next subsequence) meanwhile.
        self.stream.wait_event(self.mark())
        return self._copy(pairs)

    def h2d(self, pairs: list[tuple[Tensor, Tensor]]) -> CopyTicket:
        # The destinations were just allocated on the compute stream and may reuse memory that kernels already
        # queued there still read or write: start writing only after everything queued so far.
        self.stream.wait_stream(self._compute())
        return self._copy(pairs)

    def _copy(self, pairs: list[tuple[Tensor, Tensor]]) -> CopyTicket:
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)  # pinned host memory: truly asynchronous
            done.record(self.stream)
        return CopyTicket(start, done)

    def wait(self, ticket: CopyTicket) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        # A device-side wait: later compute kernels run after the copy; the host does not block. The marks
        # around it time how long the compute stream stood still.
        before = self.mark()
        self._compute().wait_event(ticket.done)
        return before, self.mark()

    def synchronize(self) -> None:
        self.stream.synchronize()
