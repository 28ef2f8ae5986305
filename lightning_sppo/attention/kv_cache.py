"""Per-layer K/V cache and its gradient cache (SPPO's level-1, "skeletal" activations).

One cache holds one micro-batch's sequence: K/V are written subsequence by subsequence in forward,
and the gradient buffers collect dK/dV contributions that later subsequences make to earlier ones.
The K/V buffer is allocated once and reused across steps (no per-subsequence cat); dK/dV live for one backward.

Shape legend: B batch, G K/V groups, S sequence length, Dh head size.

Every buffer is a [B, G, S, Dh] view of [B, S, G, Dh] memory, the layout flash-attn takes. With one
sequence per micro-batch (B = 1) a prefix ``k[:, :, :o]`` transposed back to [B, o, G, Dh] is then
contiguous, so the kernel reads the cache in place instead of copying the whole prefix in every call.

What is allocated is what can be read (at N = 1 the cache is the plain model's K/V and nothing more):

* K/V: told the last subsequence's offset o_last (``last_offset``, the engine knows its partition), the buffer holds
  [0, o_last) only, what later subsequences read. The last subsequence's K/V are kept as they arrive (the "tail"):
  K by reference when it owns its memory (RoPE's output does), V copied (it is a view of the fused qkv projection,
  whose other parts would otherwise stay alive), and dropped after its backward. Without ``last_offset`` (the
  pipeline runtimes) the buffer holds the whole sequence as before.
* dK/dV: only tokens [0, o_last) can receive contributions (from later subsequences), so the accumulators cover
  that much, are allocated at the first backward that adds into them (never at N = 1, never for forward-only
  passes), zeroed lazily from the first token a backward touches, and freed after the sequence's first subsequence
  (the last backward). ``later_grads`` hands out only the part some later subsequence can have written, so the
  last subsequence (and N = 1) adds nothing.

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
from lightning_sppo.attention.layouts import tokens_joined

__all__ = ["KV_GRAD_DTYPES", "GradSpan", "KVBlock", "KVCache", "KVGradBlock", "KVGradDtype", "grad_tokens"]

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


class GradSpan(NamedTuple):
    """dK/dV sums [start, start + n) on the device, [B, G, n, Dh] (``KVCache.later_grads``)."""

    start: int
    dk: Tensor
    dv: Tensor


def grad_tokens(spans: list[tuple[int, int]], seq_len: int) -> int:
    """Tokens whose dK/dV later subsequences can add to: [0, o_last) once the sequence is complete (0 at N = 1), else
    all of them (more subsequences may still come)."""
    filled = spans[-1][0] + spans[-1][1] if spans else 0
    return spans[-1][0] if filled == seq_len else seq_len


class KVCache:
    """K/V [B, G, S, Dh] in the compute dtype, dK/dV [B, G, o_last, Dh] in fp32 (allocated at the first backward
    that adds into them; module docstring).

    ``grad_dtype`` overrides the dK/dV dtype (``kv_grad_dtype="bf16"``: two bytes less per element, but the
    sums round in bf16, so their error grows with the number of subsequences; fp32 is exact to rounding).

    The buffers are allocated at the first ``write`` of a sequence, from the shape and dtype of the K/V
    that arrive (so autocast decides the dtype), and reused by later sequences of the same shape.

    ``spill``: keep only [0, spill.device_tokens) on the device (``k``, ``v`` and ``grad_buffers`` are that part)
    and the rest in host memory (module docstring). Without it ``k``, ``v`` hold the whole sequence, or with
    ``last_offset`` [0, last_offset) and the last subsequence's K/V apart (the tail).

    ``strict`` enforces the contract that makes the gradients exact: forward writes subsequences
    left to right without gaps, and backward visits them in exactly the reverse order.
    """

    def __init__(
        self,
        seq_len: int,
        strict: bool = True,
        grad_dtype: torch.dtype | None = None,
        spill: KVSpill | None = None,
        last_offset: int | None = None,
    ) -> None:
        self.seq_len = seq_len
        self.strict = strict
        self.grad_dtype = grad_dtype
        self.spill = spill
        self.last_offset = last_offset
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self._tail: tuple[Tensor, Tensor] | None = None  # K, V of [last_offset, S) as they arrived
        self._dk: Tensor | None = None
        self._dv: Tensor | None = None
        self._grad_end = seq_len  # dK/dV cover [0, min(R, _grad_end)) on the device
        self._zeroed_from = 0  # device dK/dV hold sums (or zeros) from here to their end; garbage before
        self._peak = 0
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

    @property
    def _keeps_tail(self) -> bool:
        """Whether the last subsequence's K/V are kept apart (its offset known, nothing spilled)."""
        return self.spill is None and self.last_offset is not None

    @property
    def buffer_tokens(self) -> int:
        """Tokens of the K/V buffer ``k``, ``v``: [0, R) with a spill, [0, last_offset) with a tail, else all."""
        return self.last_offset if self._keeps_tail else self.device_tokens

    def reset(self, seq_len: int | None = None, last_offset: int | None = None) -> None:
        """Start a new sequence (whose last subsequence starts at ``last_offset``, if known): forget spans, tail and
        dK/dV, keep the K/V buffer if it fits."""
        if seq_len is not None and seq_len != self.seq_len:
            self.seq_len = seq_len
            self.release()
        self.last_offset = last_offset
        self.spans.clear()
        self._backward_done = 0
        self._touched.clear()
        self._tail = self._dk = self._dv = None
        self._peak = self.nbytes()

    def release(self) -> None:
        """Free the buffers (they are allocated again on the next write)."""
        self.k = self.v = self._tail = self._dk = self._dv = None
        self.drop_host()

    def drop_host(self) -> None:
        """Forget the host part (its ``KVSpill`` hands the memory out again from the next step on)."""
        self._host = self._host_grads = None

    def nbytes(self) -> int:
        """Device bytes held now: the K/V buffer, the tail, dK/dV (the chunks streamed in flight are not counted)."""
        return sum(t.nbytes for t in (self.k, self.v, *(self._tail or ()), self._dk, self._dv) if t is not None)

    def peak_nbytes(self) -> int:
        """The most device bytes this cache held at once since its last ``reset``: at the end of the last
        subsequence's backward, K/V of the whole sequence and dK/dV of [0, o_last) (on the device part)."""
        return self._peak

    def _note_peak(self) -> None:
        self._peak = max(self._peak, self.nbytes())

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
        if self._keeps_tail and offset + length > self.last_offset:
            self._write_tail(offset, k, v)
            return
        R = self.buffer_tokens
        shape = (B, G, R, Dh)
        if self.k is None or self.k.shape != shape or self.k.dtype != k.dtype or self.k.device != k.device:
            if self.spans:
                raise RuntimeError("K/V shape or dtype changed in the middle of a sequence.")
            self.release()
            self.k, self.v = _sequence_major(shape, k.dtype, k.device), _sequence_major(shape, v.dtype, v.device)
            self._told(self.k, self.v)
            self._note_peak()
        if self._host is None and self.spill is not None and R < self.seq_len:
            self._host = (self._take(k.dtype), self._take(v.dtype))
        on_device = max(0, min(offset + length, R) - offset)
        self.k[:, :, offset : offset + on_device].copy_(k[:, :, :on_device].detach())
        self.v[:, :, offset : offset + on_device].copy_(v[:, :, :on_device].detach())
        if on_device < length:  # the rest goes to host, asynchronously
            a, b = offset + on_device - R, offset + length - R
            self.spill.store([(self._host[0][a:b], _host_layout(k[:, :, on_device:].detach())),
                              (self._host[1][a:b], _host_layout(v[:, :, on_device:].detach()))])  # fmt: skip
        self.spans.append((offset, length))

    def _write_tail(self, offset: int, k: Tensor, v: Tensor) -> None:
        """The last subsequence's K/V, kept as they are where they own their memory (no copy), else copied."""
        if offset != self.last_offset or offset + k.shape[2] != self.seq_len:
            raise RuntimeError(
                f"The K/V cache was told the last subsequence starts at {self.last_offset} of {self.seq_len} tokens,"
                f" got the subsequence {offset}..{offset + k.shape[2]}; pass the partition's last offset to reset()."
            )
        self._tail = (_kept(k), _kept(v))
        self.spans.append((offset, k.shape[2]))
        self._note_peak()

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

    def end_backward(self, offset: int) -> None:
        """The backward of the subsequence at ``offset`` is done: what no later backward reads is let go (the tail
        after the last subsequence's, the dK/dV after the first subsequence's)."""
        if self._tail is not None and offset == self.last_offset:
            self._tail = None
        if offset == 0:
            self._dk = self._dv = None

    def grad_buffers(self) -> tuple[Tensor, Tensor]:
        """dK/dV accumulators of the device part ([B, G, min(R, o_last), Dh]), zeroed; allocated on first use so
        forward-only passes never pay for them."""
        dk, dv = self._grads()
        self._zero_grads_from(0)
        return dk, dv

    def later_grads(self, first: int, end: int) -> GradSpan | None:
        """What later subsequences added to the dK/dV of tokens [first, end): the part some of them can have
        written, or None when none can (N = 1, the last subsequence, tokens no later query attends)."""
        if self._dk is None and self._host_grads is None:  # no backward has added anything
            return None
        end = min(end, self._grad_end)
        first = first if end > min(self.device_tokens, self._grad_end) else max(first, self._zeroed_from)
        if first >= end:
            return None
        return GradSpan(first, *self.read_grads(first, end))

    def _grads(self) -> tuple[Tensor, Tensor]:
        """The device dK/dV, allocated (uninitialised) for [0, min(R, o_last)) on first use; host ones with them."""
        if self._dk is None:
            like = self.k if self.k is not None else self._tail[0]
            B, G, _, Dh = like.shape
            self._grad_end = grad_tokens(self.spans, self.seq_len)
            shape = (B, G, min(self.device_tokens, self._grad_end), Dh)
            dtype = self.grad_dtype or accumulation_dtype(like.dtype)
            self._dk, self._dv = (_sequence_major(shape, dtype, like.device) for _ in range(2))
            self._zeroed_from = shape[2]
            self._note_peak()
        if self._host_grads is None and self.device_tokens < self.seq_len:
            # dK/dV on host only for [R, o_last): no later query adds to the tokens after it
            self._host_grads = tuple(self._take(self._dk.dtype, self._grad_end) for _ in range(2))
        return self._dk, self._dv

    def _zero_grads_from(self, first: int) -> None:
        """Make the device dK/dV hold sums or zeros from ``first`` on (zeroing only what was never touched)."""
        if first < self._zeroed_from:
            self._dk[:, :, first : self._zeroed_from].zero_()
            self._dv[:, :, first : self._zeroed_from].zero_()
            self._zeroed_from = first

    # -- reading: blocks of a prefix, or a range materialised on the device ---------------------------

    def prefix_blocks(self, first: int, end: int) -> Iterator[KVBlock]:
        """K/V [first, end) as blocks in order: the device part in place, then host chunks streamed in.

        The copy of chunk i + 1 is issued before chunk i is handed out, so it overlaps the attention over chunk i;
        drop a block's tensors before asking for the next one, and at most two chunks are on the device.
        """
        if first >= end:
            return
        R, chunks = self.buffer_tokens, self._chunks(first, end)
        ahead = self._fetch(*chunks[0], kv=True, grads=False) if chunks else None
        if first < R:
            yield KVBlock(first, self.k[:, :, first : min(end, R)], self.v[:, :, first : min(end, R)])
        if self._keeps_tail and end > R:
            a = max(first, R)
            yield KVBlock(a, *(x[:, :, a - R : end - R] for x in self._tail))
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
        dk, dv = self._grads()
        if end > self._grad_end:
            raise RuntimeError(
                f"dK/dV of tokens {first}..{end} asked for, but no later query attends past {self._grad_end}."
            )
        R, chunks = self.device_tokens, self._chunks(first, end)
        ahead = self._fetch(*chunks[0], kv=True, grads=True) if chunks else None
        if first < R:
            self._zero_grads_from(first)
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
        else a new tensor, sequence-major as the buffers are (device part and host part copied in)."""
        return self._read(first, end, grads=False)

    def read_spans(self, spans: list[tuple[int, int]]) -> Iterator[tuple[Tensor, Tensor]]:
        """``read`` of each (offset, length) in turn, the next span's host part copied while the current one is in
        use (drop a span's tensors before asking for the next: at most two spans' host parts are on the device)."""
        if self._keeps_tail:  # nothing on host: views of the buffer or of the tail
            for offset, length in spans:
                yield self.read(offset, offset + length)
            return
        R = self.device_tokens

        def issue(offset: int, length: int) -> tuple[list[Tensor], object | None] | None:
            return self._fetch(max(offset, R), offset + length, kv=True, grads=False) if offset + length > R else None

        ahead = issue(*spans[0]) if spans else None
        for i, (offset, length) in enumerate(spans):
            current, ahead = ahead, issue(*spans[i + 1]) if i + 1 < len(spans) else None
            yield self._assemble(offset, offset + length, (self.k, self.v), current)
            del current

    def read_grads(self, first: int, end: int) -> tuple[Tensor, Tensor]:
        """The dK/dV sums [first, end) on the device, as ``read`` (zeros where nothing was added; a new tensor where
        the range reaches past the tokens that can receive any)."""
        self._grads()
        stop = min(end, self._grad_end)
        if stop >= end:
            return self._read(first, end, grads=True)
        like = self._dk
        zeros = [like.new_zeros((*like.shape[:2], end - max(first, stop), like.shape[3])) for _ in range(2)]
        if first >= stop:
            return zeros[0], zeros[1]
        return tuple(
            torch.cat([part, rest], dim=2) for part, rest in zip(self._read(first, stop, True), zeros, strict=True)
        )

    @contextmanager
    def grad_window(self, first: int, end: int) -> Iterator[tuple[Tensor, Tensor]]:
        """dK/dV [first, end) on the device to add into; what lies on host is written back when the window closes."""
        self._grads()
        if end > self._grad_end:
            raise RuntimeError(
                f"dK/dV of tokens {first}..{end} asked for, but no later query attends past {self._grad_end}."
            )
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

    def _take(self, dtype: torch.dtype, end: int | None = None) -> Tensor:
        """Host memory for tokens [R, end) (default: to the sequence's end)."""
        B, G, R, Dh = self.k.shape
        end = self.seq_len if end is None else end
        return self.spill.take((max(0, end - R), B, G, Dh), dtype)

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
        if not grads and self._keeps_tail and end > self.buffer_tokens:
            return self._read_with_tail(first, end)
        R = self.device_tokens
        if grads:
            device_part = self._grads()
            self._zero_grads_from(min(first, R))
        else:
            device_part = (self.k, self.v)
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
        joined = tuple(tokens_joined([part[:, :, first:R], rest]) for part, rest in zip(device_part, host, strict=True))
        self._told(*joined)
        return joined

    def _read_with_tail(self, first: int, end: int) -> tuple[Tensor, Tensor]:
        """K/V [first, end) reaching into the tail: views when all of it is in the tail, else a copy."""
        T = self.buffer_tokens
        tail = [x[:, :, max(first, T) - T : end - T] for x in self._tail]
        if first >= T:
            return tail[0], tail[1]
        return tuple(tokens_joined([x[:, :, first:T], t]) for x, t in zip((self.k, self.v), tail, strict=True))


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


def _kept(x: Tensor) -> Tensor:
    """``x`` (detached) when it is the whole of its memory (nothing else is kept alive through it), else a
    sequence-major copy."""
    x = x.detach()
    if x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size():
        return x
    return _sequence_major(tuple(x.shape), x.dtype, x.device).copy_(x)


def _host_layout(x: Tensor) -> Tensor:
    """[B, G, n, Dh] -> [n, B, G, Dh] (the host part's layout; a view)."""
    return x.permute(2, 0, 1, 3)


def _attention_layout(x: Tensor) -> Tensor:
    """[n, B, G, Dh] -> [B, G, n, Dh] (a view; for B = 1 the memory is [B, n, G, Dh], as the device part's; for
    B > 1 the tokens are outermost, and the attention kernels copy such a chunk into their layout: ``layouts``)."""
    return x.permute(1, 2, 0, 3)
