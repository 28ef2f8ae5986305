"""Host memory for offloaded activations: a pool of slabs, allocated once and reused every step.

Allocating pinned memory inside a step synchronises the device and is slow, so slabs are only added
while a step needs more than any step before (in practice: the first) or when ``reserve`` is called
before the run. Each step takes slices from the start again (``reset``), in the same order, so a
steady run touches the same bytes every step and the pool never grows. Slab sizes are powers of two:
PyTorch's pinned-memory allocator rounds requests up to one, so nothing is lost to that rounding.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["DEFAULT_SLAB_BYTES", "HostMemoryError", "HostPool", "available_host_bytes", "check_host_memory"]

DEFAULT_SLAB_BYTES = 2**28
"""256 MiB: larger than any single activation of a subsequence of up to 16K tokens of a 7B model."""
_ALIGN = 512
_GIB = 2**30


class HostMemoryError(MemoryError):
    """Offloaded activations do not fit in host memory."""


def available_host_bytes() -> int | None:
    """Host memory available to new allocations: MemAvailable from /proc/meminfo, else free pages; None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(needed_bytes: int, setting: str = "offload") -> None:
    """Raise ``HostMemoryError`` naming ``setting`` when ``needed_bytes`` more host memory is not available."""
    available = available_host_bytes()
    if available is not None and needed_bytes > available:
        raise HostMemoryError(
            f"{setting} needs {needed_bytes} more bytes ({needed_bytes / _GIB:.2f} GiB) of host memory for"
            f" offloaded activations, but only {available} bytes ({available / _GIB:.2f} GiB) are available"
            " (MemAvailable). Offload less (offload='adaptive' instead of 'full'), train shorter sequences, or"
            " use a machine with more host memory."
        )


class HostPool:
    """Slabs of host memory (pinned for CUDA) handed out as aligned slices; ``reset`` makes all of them free again.

    Args:
        pin_memory: page-lock the slabs (needed for asynchronous copies from a CUDA device).
        slab_bytes: size of a new slab; a larger request gets a slab of its own (a power of two).
        setting: how errors name the setting that asked for host memory, e.g. ``"offload='full'"``.
    """

    def __init__(self, *, pin_memory: bool = False, slab_bytes: int = DEFAULT_SLAB_BYTES, setting: str = "offload"):
        if slab_bytes < _ALIGN:
            raise ValueError(f"slab_bytes must be at least {_ALIGN}, got slab_bytes={slab_bytes}.")
        self.pin_memory = pin_memory
        self.slab_bytes = 1 << (slab_bytes - 1).bit_length()
        self.setting = setting
        self._slabs: list[Tensor] = []
        self._slab = self._offset = self._used = 0

    @property
    def capacity_bytes(self) -> int:
        """Host bytes the pool holds."""
        return sum(slab.numel() for slab in self._slabs)

    @property
    def used_bytes(self) -> int:
        """Bytes handed out since the last ``reset``."""
        return self._used

    @property
    def num_slabs(self) -> int:
        return len(self._slabs)

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A host buffer of ``numel`` elements of ``dtype``, valid until ``reset``."""
        nbytes = numel * dtype.itemsize
        while True:
            if self._slab == len(self._slabs):
                self._slabs.append(self._allocate(max(nbytes, self.slab_bytes)))
            slab = self._slabs[self._slab]
            start = -(-self._offset // _ALIGN) * _ALIGN
            if start + nbytes <= slab.numel():
                self._offset, self._used = start + nbytes, self._used + nbytes
                return slab[start : start + nbytes].view(dtype)
            self._slab, self._offset = self._slab + 1, 0

    def reset(self) -> None:
        """Every slice is free again (the step that used them is over); the memory is kept."""
        self._slab = self._offset = self._used = 0

    def reserve(self, nbytes: int) -> None:
        """Make sure the pool holds at least ``nbytes`` (checking host memory first), before the run starts."""
        missing = nbytes - self.capacity_bytes
        if missing > 0:
            check_host_memory(missing, self.setting)
            while self.capacity_bytes < nbytes:
                self._slabs.append(self._allocate(self.slab_bytes))

    def release(self) -> None:
        """Free every slab."""
        self._slabs.clear()
        self.reset()

    def _allocate(self, nbytes: int) -> Tensor:
        nbytes = 1 << (nbytes - 1).bit_length()  # what the pinned allocator would take anyway
        check_host_memory(nbytes, self.setting)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        except RuntimeError as error:  # the allocator's out-of-memory error, whatever its wording
            raise HostMemoryError(
                f"{self.setting} could not allocate {nbytes} bytes ({nbytes / _GIB:.2f} GiB) of"
                f" {'pinned ' if self.pin_memory else ''}host memory for offloaded activations"
                f" (the pool already holds {self.capacity_bytes} bytes): {error}"
            ) from error
