"""What one subsequence's forward saves for backward, grouped into the units the offloader moves.

A unit is the span of one storage that the subsequence's saved tensors view (several saved tensors are
often views of one storage: q and k of one qkv projection). Copying the span, not each view, moves every
byte once, keeps the views' strides, and frees the device storage once the unit lets go of it. Spans start
on a 512-byte boundary of the storage, so a restored view has the same address alignment as the original
and kernels take the same code path: the gradients stay bit-identical.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["SavedRef", "SavedUnit", "SubsequenceSaves", "kept_on_device", "unpack"]

ALIGN_BYTES = 512
_TO_COPY = getattr(torch._C._functions, "ToCopyBackward0", None)
_ACCUMULATE = getattr(torch._C._functions, "AccumulateGrad", None)


def kept_on_device(t: Tensor) -> bool:
    """Weights and other tensors owned outside the autograd graph, which offloading could not free.

    That is leaves that require grad (parameters, a pipeline stage's received hidden states, which the
    runtime holds for their gradient) and views of them (``weight.t()`` saved by a matmul), and autocast
    copies of parameters (and their views), which autocast caches for the whole forward.
    """
    base = t._base if t._base is not None else t
    if base.is_leaf:
        return base.requires_grad
    fn = base.grad_fn
    if _TO_COPY is None or _ACCUMULATE is None or not isinstance(fn, _TO_COPY):
        return False
    return any(
        isinstance(next_fn, _ACCUMULATE) and isinstance(next_fn.variable, nn.Parameter)
        for next_fn, _ in fn.next_functions
    )


class SavedRef:
    """What autograd holds in place of one saved tensor: its unit and how to view the unit's bytes."""

    __slots__ = ("unit", "tensor", "size", "stride", "offset", "version")

    def __init__(self, unit: SavedUnit, t: Tensor) -> None:
        self.unit = unit
        self.tensor: Tensor | None = t.detach()  # detached: holding an output must not keep its graph alive
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.version = t._version  # hooks switch off autograd's in-place check; this restores it

    def get(self) -> Tensor:
        if self.tensor is not None:
            self.check_version()
            return self.tensor
        return self.unit.view(self)

    def check_version(self) -> None:
        if self.tensor is not None and self.tensor._version != self.version:
            raise RuntimeError(
                f"A tensor saved for backward (shape {tuple(self.size)}) was modified in place after it was saved"
                f" (version {self.version} -> {self.tensor._version}); the offloader cannot restore its old value."
            )


class SavedUnit:
    """Elements [lo, hi) of one storage, as one dtype: what is copied to the host and back in one piece."""

    def __init__(self, t: Tensor) -> None:
        self.dtype = t.dtype
        self.source: Tensor | None = t.detach()  # keeps the device storage alive until the copy is done
        self.refs: list[SavedRef] = []
        self.first = self.hi = t.storage_offset()
        self.host: Tensor | None = None
        self.restored: Tensor | None = None

    def add(self, t: Tensor) -> SavedRef:
        start = t.storage_offset()
        end = start + sum((n - 1) * s for n, s in zip(t.size(), t.stride(), strict=True)) + 1 if t.numel() else start
        self.first, self.hi = min(self.first, start), max(self.hi, end)
        ref = SavedRef(self, t)
        self.refs.append(ref)
        return ref

    @property
    def lo(self) -> int:
        step = max(1, ALIGN_BYTES // self.dtype.itemsize)
        return self.first // step * step

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def device_span(self) -> Tensor:
        """The span as a flat tensor over the device storage (the source of the device-to-host copy)."""
        return self.source.as_strided((self.numel,), (1,), self.lo)

    def check_versions(self) -> None:
        for ref in self.refs:
            ref.check_version()

    def drop_device(self) -> None:
        """Let go of the device storage (the caller has made sure the copy out of it is done)."""
        for ref in self.refs:
            ref.tensor = None
        self.source = None

    def view(self, ref: SavedRef) -> Tensor:
        if self.restored is None:
            raise RuntimeError(
                "A saved activation is in host memory and was not brought back before backward: run backward"
                " through the engine (it calls before_backward), and without retain_graph."
            )
        return self.restored.as_strided(ref.size, ref.stride, ref.offset - self.lo)

    def clear(self) -> None:
        self.drop_device()
        self.refs.clear()
        self.host = self.restored = None


class SubsequenceSaves:
    """The pack side of ``saved_tensors_hooks`` for one subsequence: level-2 tensors grouped into units."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._units: dict[tuple[int, torch.dtype], SavedUnit] = {}

    def pack(self, t: Tensor) -> Tensor | SavedRef:
        # Only plain strided tensors on our device are candidates; weights and the like stay as they are.
        if type(t) is not Tensor or t.layout != torch.strided or t.device != self.device or kept_on_device(t):
            return t
        key = (t.untyped_storage().data_ptr(), t.dtype)  # storages saved here stay alive: pointers are unique
        unit = self._units.get(key)
        if unit is None:
            unit = self._units[key] = SavedUnit(t)
        return unit.add(t)

    def units(self) -> list[SavedUnit]:
        """Units in the order their first tensor was saved."""
        return list(self._units.values())

    def clear(self) -> None:
        for unit in self._units.values():
            unit.clear()
        self._units.clear()


def unpack(packed: Tensor | SavedRef) -> Tensor:
    """The unpack side of ``saved_tensors_hooks``: the saved tensor, from the device or from its restored copy."""
    return packed.get() if isinstance(packed, SavedRef) else packed
