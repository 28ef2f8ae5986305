"""Per-layer K/V cache and its gradient cache (SPPO's level-1, "skeletal" activations).

One cache holds one micro-batch's sequence: K/V are written subsequence by subsequence in forward,
and the gradient buffers collect dK/dV contributions that later subsequences make to earlier ones.
The buffers are allocated once for the whole sequence and reused across steps (no per-subsequence cat).

Shape legend: B batch, G K/V groups, S sequence length, Dh head size.

Every buffer is a [B, G, S, Dh] view of [B, S, G, Dh] memory, the layout flash-attn takes. With one
sequence per micro-batch (B = 1) a prefix ``k[:, :, :o]`` transposed back to [B, o, G, Dh] is then
contiguous, so the kernel reads the cache in place instead of copying the whole prefix in every call.

With a ``KVSpill`` (``kv_device_tokens=R``) only tokens [0, R) live in those device buffers; K/V and dK/dV of
[R, S) live in host memory as [S - R, B, G, Dh] (one token's rows contiguous, so a chunk of tokens is one plain
copy), and reach the attention as blocks: ``prefix_blocks`` streams them chunk by chunk, double-buffered (the
next chunk's copy is issued before the current one is handed out), ``grad_blocks`` does the same with the dK/dV
chunks and writes each back after its use. Host dK/dV are never zeroed: the cache remembers which host tokens
hold written-back sums (``_Intervals``) and reads zeros for the rest, so a step never clears host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lightning_sppo.attention.kernels import accumulation_dtype
from lightning_sppo.attention.kv_spill import KVSpill

__all__ = ["KV_GRAD_DTYPES", "KVBlock", "KVCache", "KVGradBlock", "KVGradDtype"]

KVGradDtype = Literal["fp32", "bf16"]
KV_GRAD_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
"""The ``kv_grad_dtype`` setting: dK/dV accumulators in fp32 (None: fp32, or fp64 for fp64 K/V) or bf16."""


class KVBlock(NamedTuple):
    """Keys [start, start + n) of a prefix: k, v [B, G, n, Dh] on the device."""

    start: int
    k: Tensor
    v: Tensor


class KVGradBlock(NamedTuple):
    """A ``KVBlock`` with the dK/dV accumulators [B, G, n, Dh] its gradient is added to."""

    start: int
    k: Tensor
    v: Tensor
    dk: Tensor
    dv: Tensor


class KVCache:
    """K/V [B, G, S, Dh] in the compute dtype, dK/dV [B, G, S, Dh] in fp32 (allocated at the first backward).

    ``grad_dtype`` overrides the dK/dV dtype (``kv_grad_dtype="bf16"``: two bytes less per element, but the
    sums round in bf16, so their error grows with the number of subsequences; fp32 is exact to rounding).

    The buffers are allocated at the first ``write`` of a sequence, from the shape and dtype of the K/V
    that arrive (so autocast decides the dtype), and reused by later sequences of the same shape.

    ``spill``: keep only [0, spill.device_tokens) on the device (``k``, ``v`` and ``grad_buffers`` are that part)
    and the rest in host memory (module docstring). Without it ``k``, ``v`` hold the whole sequence.

    ``strict`` enforces the contract that makes the gradients exact: forward writes subsequences
    left to right without gaps, and backward visits them in exactly the reverse order.
    """

    def __init__(
        self, seq_len: int, strict: bool = True, grad_dtype: torch.dtype | None = None, spill: KVSpill | None = None
    ) -> None:
        self.seq_len = seq_len
        self.strict = strict
        self.grad_dtype = grad_dtype
        self.spill = spill
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self._dk: Tensor | None = None
        self._dv: Tensor | None = None
        self._host: tuple[Tensor, Tensor] | None = None  # K, V [S - R, B, G, Dh]
        self._host_grads: tuple[Tensor, Tensor] | None = None
        self._touched = _Intervals()  # host tokens whose dK/dV sums were written back
        self.spans: list[tuple[int, int]] = []  # (offset, length) in forward order
        self._backward_done = 0
        self.on_alloc: Callable[[Tensor], None] | None = None
        """Told of every device tensor the cache allocates (its K/V buffers, chunks fetched from host), e.g. to
        measure the bytes it holds over time."""

    @property
    def filled(self) -> int:
        """Tokens written so far."""
        return self.spans[-1][0] + self.spans[-1][1] if self.spans else 0

    @property
    def device_tokens(self) -> int:
        """R: the tokens kept on the device (all of them without a spill)."""
        return self.seq_len if self.spill is None else min(self.spill.device_tokens, self.seq_len)

    def reset(self, seq_len: int | None = None) -> None:
        """Start a new sequence: forget spans, zero the gradient buffers, keep the allocation if it fits."""
        if seq_len is not None and seq_len != self.seq_len:
            self.seq_len = seq_len
            self.release()
        self.spans.clear()
        self._backward_done = 0
        self._touched.clear()
        if self._dk is not None:
            self._dk.zero_()
            self._dv.zero_()

    def release(self) -> None:
        """Free the buffers (they are allocated again on the next write)."""
        self.k = self.v = self._dk = self._dv = None
        self.drop_host()

    def drop_host(self) -> None:
        """Forget the host part (its ``KVSpill`` hands the memory out again from the next step on)."""
        self._host = self._host_grads = None

    def nbytes(self) -> int:
        """Device bytes: K/V and dK/dV of [0, R) (the chunks streamed in flight are not counted)."""
        return sum(t.nbytes for t in (self.k, self.v, self._dk, self._dv) if t is not None)

    def host_nbytes(self) -> int:
        """Host bytes: K/V and dK/dV of [R, S)."""
        return sum(t.nbytes for part in (self._host, self._host_grads) if part for t in part)

    def write(self, offset: int, k: Tensor, v: Tensor) -> None:
        """Store the K/V of the subsequence starting at ``offset`` (autograd does not see this copy)."""
        B, G, length, Dh = k.shape
        if self.strict and offset != self.filled:
            raise RuntimeError(
                f"K/V cache expects the subsequence at offset {self.filled} next, got offset={offset}:"
                " subsequences must run forward in order, without gaps."
            )
        if offset + length > self.seq_len:
            raise RuntimeError(f"Subsequence {offset}..{offset + length} overflows the cache of {self.seq_len}.")
        R = self.device_tokens
        shape = (B, G, R, Dh)
        if self.k is None or self.k.shape != shape or self.k.dtype != k.dtype or self.k.device != k.device:
            if self.spans:
                raise RuntimeError("K/V shape or dtype changed in the middle of a sequence.")
            self.release()
            self.k, self.v = _sequence_major(shape, k.dtype, k.device), _sequence_major(shape, v.dtype, v.device)
            self._told(self.k, self.v)
        if self._host is None and R < self.seq_len:
            self._host = (self._take(k.dtype), self._take(v.dtype))
        on_device = max(0, min(offset + length, R) - offset)
        self.k[:, :, offset : offset + on_device].copy_(k[:, :, :on_device].detach())
        self.v[:, :, offset : offset + on_device].copy_(v[:, :, :on_device].detach())
        if on_device < length:  # the rest goes to host, asynchronously
            a, b = offset + on_device - R, offset + length - R
            self.spill.store([(self._host[0][a:b], _host_layout(k[:, :, on_device:].detach())),
                              (self._host[1][a:b], _host_layout(v[:, :, on_device:].detach()))])  # fmt: skip
        self.spans.append((offset, length))

    def begin_backward(self, offset: int) -> None:
        """Check that the subsequence at ``offset`` is the latest one whose backward has not run yet."""
        if not self.strict:
            return
        index = len(self.spans) - 1 - self._backward_done
        expected = self.spans[index][0] if index >= 0 else None
        if offset != expected:
            raise RuntimeError(
                f"Subsequence backward out of order: expected offset {expected}, got offset={offset}."
                " Backward must run from the last subsequence to the first, or dK/dV of earlier"
                " subsequences would miss the contributions of later ones."
            )
        self._backward_done += 1

    def grad_buffers(self) -> tuple[Tensor, Tensor]:
        """dK/dV accumulators of the device part, allocated (zeroed) on first use so forward-only passes never pay
        for them."""
        if self._dk is None:
            dtype = self.grad_dtype or accumulation_dtype(self.k.dtype)
            self._dk = _sequence_major(self.k.shape, dtype, self.k.device).zero_()
            self._dv = _sequence_major(self.v.shape, dtype, self.v.device).zero_()
        if self._host_grads is None and self.device_tokens < self.seq_len:
            self._host_grads = (self._take(self._dk.dtype), self._take(self._dv.dtype))
        return self._dk, self._dv

    # -- reading: blocks of a prefix, or a range materialised on the device ---------------------------

    def prefix_blocks(self, first: int, end: int) -> Iterator[KVBlock]:
        """K/V [first, end) as blocks in order: the device part in place, then host chunks streamed in.

        The copy of chunk i + 1 is issued before chunk i is handed out, so it overlaps the attention over chunk i;
        drop a block's tensors before asking for the next one, and at most two chunks are on the device.
        """
        if first >= end:
            return
        R, chunks = self.device_tokens, self._chunks(first, end)
        ahead = self._fetch(*chunks[0], kv=True, grads=False) if chunks else None
        if first < R:
            yield KVBlock(first, self.k[:, :, first : min(end, R)], self.v[:, :, first : min(end, R)])
        for i, (a, _) in enumerate(chunks):
            (k, v), ticket = ahead
            ahead = self._fetch(*chunks[i + 1], kv=True, grads=False) if i + 1 < len(chunks) else None
            self.spill.wait(ticket)
            yield KVBlock(a, _attention_layout(k), _attention_layout(v))
            del k, v

    def grad_blocks(self, first: int, end: int) -> Iterator[KVGradBlock]:
        """``prefix_blocks`` with the dK/dV accumulators of each block: in place on the device part; for a host chunk
        read in (zeros where nothing was written back yet) and written back once the next block is asked for.

        On the device at a time: K/V of two chunks (the one in use, the next one arriving) and dK/dV of three (those
        two, and the previous one being written back)."""
        if first >= end:
            return
        dk, dv = self.grad_buffers()
        R, chunks = self.device_tokens, self._chunks(first, end)
        ahead = self._fetch(*chunks[0], kv=True, grads=True) if chunks else None
        if first < R:
            last = min(end, R)
            yield KVGradBlock(first, self.k[:, :, first:last], self.v[:, :, first:last],
                              dk[:, :, first:last], dv[:, :, first:last])  # fmt: skip
        for i, (a, b) in enumerate(chunks):
            (k, v, dk_chunk, dv_chunk), ticket = ahead
            ahead = self._fetch(*chunks[i + 1], kv=True, grads=True) if i + 1 < len(chunks) else None
            self.spill.wait(ticket)
            yield KVGradBlock(a, *(_attention_layout(x) for x in (k, v, dk_chunk, dv_chunk)))
            del k, v
            self._write_grads(a, b, dk_chunk, dv_chunk)
            del dk_chunk, dv_chunk

    def read(self, first: int, end: int) -> tuple[Tensor, Tensor]:
        """K/V [first, end) on the device [B, G, end - first, Dh]: views of the device part when it holds them all,
        else a new tensor (device part and host part copied in)."""
        return self._read(first, end, grads=False)

    def read_spans(self, spans: list[tuple[int, int]]) -> Iterator[tuple[Tensor, Tensor]]:
        """``read`` of each (offset, length) in turn, the next span's host part copied while the current one is in
        use (drop a span's tensors before asking for the next: at most two spans' host parts are on the device)."""
        R = self.device_tokens

        def issue(offset: int, length: int) -> tuple[list[Tensor], object | None] | None:
            return self._fetch(max(offset, R), offset + length, kv=True, grads=False) if offset + length > R else None

        ahead = issue(*spans[0]) if spans else None
        for i, (offset, length) in enumerate(spans):
            current, ahead = ahead, issue(*spans[i + 1]) if i + 1 < len(spans) else None
            yield self._assemble(offset, offset + length, (self.k, self.v), current)
            del current

    def read_grads(self, first: int, end: int) -> tuple[Tensor, Tensor]:
        """The dK/dV sums [first, end) on the device, as ``read`` (zeros where nothing was added)."""
        return self._read(first, end, grads=True)

    @contextmanager
    def grad_window(self, first: int, end: int) -> Iterator[tuple[Tensor, Tensor]]:
        """dK/dV [first, end) on the device to add into; what lies on host is written back when the window closes."""
        dk, dv = self.read_grads(first, end)
        yield dk, dv
        R = self.device_tokens
        if end > R:
            a = max(first, R)
            if first < R:  # the device part was a copy: put it back
                self._dk[:, :, first:R].copy_(dk[:, :, : R - first])
                self._dv[:, :, first:R].copy_(dv[:, :, : R - first])
            self._write_grads(a, end, _host_layout(dk[:, :, a - first :]), _host_layout(dv[:, :, a - first :]))

    # -- internals ---------------------------------------------------------------------------------

    def _take(self, dtype: torch.dtype) -> Tensor:
        B, G, R, Dh = self.k.shape
        return self.spill.take((self.seq_len - R, B, G, Dh), dtype)

    def _chunks(self, first: int, end: int) -> list[tuple[int, int]]:
        """The host part of [first, end) in chunks of ``chunk_tokens``."""
        start, size = max(first, self.device_tokens), self.spill.chunk_tokens if self.spill else 1
        return [(a, min(a + size, end)) for a in range(start, end, size)]

    def _fetch(self, a: int, b: int, *, kv: bool, grads: bool) -> tuple[list[Tensor], object | None]:
        """Device tensors [b - a, B, G, Dh] for host tokens [a, b) (K, V and/or dK, dV) and the copy's ticket."""
        R, device = self.device_tokens, self.k.device
        shape = (b - a, *self.k.shape[:2], self.k.shape[3])
        tensors, pairs = [], []
        if kv:
            for host in self._host:
                tensors.append(torch.empty(shape, dtype=host.dtype, device=device))
                pairs.append((tensors[-1], host[a - R : b - R]))
        if grads:
            covered = self._touched.overlap(a, b)
            whole = covered == [(a, b)]
            for host in self._host_grads:
                buffer = (torch.empty if whole else torch.zeros)(shape, dtype=host.dtype, device=device)
                tensors.append(buffer)
                pairs += [(buffer[c - a : d - a], host[c - R : d - R]) for c, d in covered]
        self._told(*tensors)
        return tensors, (self.spill.fetch(pairs) if pairs else None)

    def _told(self, *tensors: Tensor) -> None:
        if self.on_alloc is not None:
            for tensor in tensors:
                self.on_alloc(tensor)

    def _write_grads(self, a: int, b: int, dk: Tensor, dv: Tensor) -> None:
        """dK/dV [b - a, B, G, Dh] of host tokens [a, b) back to host memory."""
        R, (host_dk, host_dv) = self.device_tokens, self._host_grads
        self.spill.store([(host_dk[a - R : b - R], dk), (host_dv[a - R : b - R], dv)])
        self._touched.add(a, b)

    def _read(self, first: int, end: int, grads: bool) -> tuple[Tensor, Tensor]:
        R = self.device_tokens
        device_part = self.grad_buffers() if grads else (self.k, self.v)
        fetched = self._fetch(max(first, R), end, kv=not grads, grads=grads) if end > R else None
        return self._assemble(first, end, device_part, fetched)

    def _assemble(
        self,
        first: int,
        end: int,
        device_part: tuple[Tensor, Tensor],
        fetched: tuple[list[Tensor], object | None] | None,
    ) -> tuple[Tensor, Tensor]:
        """[first, end) on the device from views of the device part and, beyond R, the ``fetched`` host part."""
        R = self.device_tokens
        if fetched is None:
            return device_part[0][:, :, first:end], device_part[1][:, :, first:end]
        fetched, ticket = fetched
        self.spill.wait(ticket)
        host = [_attention_layout(x) for x in fetched]
        if first >= R:
            return host[0], host[1]
        joined = tuple(
            torch.cat([part[:, :, first:R], rest], dim=2) for part, rest in zip(device_part, host, strict=True)
        )
        self._told(*joined)
        return joined


class _Intervals:
    """Disjoint, sorted token ranges [a, b)."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def clear(self) -> None:
        self.ranges.clear()

    def add(self, a: int, b: int) -> None:
        merged, rest = (a, b), []
        for c, d in self.ranges:
            if d < merged[0] or c > merged[1]:
                rest.append((c, d))
            else:
                merged = (min(c, merged[0]), max(d, merged[1]))
        self.ranges = sorted([*rest, merged])

    def overlap(self, a: int, b: int) -> list[tuple[int, int]]:
        """The parts of [a, b) inside the ranges, in order."""
        return [(max(a, c), min(b, d)) for c, d in self.ranges if c < b and d > a]


def _sequence_major(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised [B, G, S, Dh] tensor laid out as [B, S, G, Dh] in memory (module docstring)."""
    B, G, S, Dh = shape
    return torch.empty((B, S, G, Dh), dtype=dtype, device=device).transpose(1, 2)


def _host_layout(x: Tensor) -> Tensor:
    """[B, G, n, Dh] -> [n, B, G, Dh] (the host part's layout; a view)."""
    return x.permute(2, 0, 1, 3)


def _attention_layout(x: Tensor) -> Tensor:
    """[n, B, G, Dh] -> [B, G, n, Dh] (a view; for B = 1 the memory is [B, n, G, Dh], as the device part's)."""
    return x.permute(1, 2, 0, 3)
