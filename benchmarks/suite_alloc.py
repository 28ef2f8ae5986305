"""Which failures mean "does not fit": an allocation of any kind that failed, named by what failed.

Why: a search for the longest sequence, or a cell near the device's capacity, must tell "this length does not fit"
from "this path is broken". PyTorch's caching allocator raises ``torch.OutOfMemoryError``, but not every byte a step
needs comes from it: cuDNN's attention may allocate its workspace itself and fail with a ``RuntimeError`` that
names cuDNN; a cuBLAS or NCCL workspace allocated by ``cudaMalloc`` fails as "CUDA error: out of memory"; pinned host
memory fails in ``cudaHostAlloc`` (a ``RuntimeError``) or in the offloader's own check (``HostMemoryError``, a
``MemoryError``). Each of those is "does not fit" here, with the allocation that failed in the reason.
"""

from __future__ import annotations

import torch

__all__ = ["allocation_failure", "does_not_fit"]


_CUDNN_MEMORY = ("alloc", "workspace", "memory")
_PINNED = ("pinned", "cudahostalloc", "cudahostregister", "host alloc")
_DEVICE = ("out of memory", "cudaerrormemoryallocation", "cuda_error_out_of_memory")


def allocation_failure(error: BaseException) -> str | None:
    """What failed to allocate, when ``error`` is a failed allocation ("device memory (caching allocator): ...",
    "cuDNN workspace: ...", "pinned host memory: ...", "host memory: ...", "device memory outside the caching
    allocator: ..."), else None (a broken path, not a size)."""
    text = (str(error).splitlines() or [""])[0][:240]
    lower = str(error).lower()
    if isinstance(error, torch.OutOfMemoryError):
        return f"device memory (caching allocator): {text}"
    if isinstance(error, MemoryError):  # the offloader's HostMemoryError, or the host's own
        return f"host memory: {text or type(error).__name__}"
    if not isinstance(error, RuntimeError):
        return None
    if "cudnn" in lower and any(word in lower for word in _CUDNN_MEMORY):
        return f"cuDNN workspace: {text}"
    if any(word in lower for word in _PINNED) and any(word in lower for word in (*_DEVICE, "alloc")):
        return f"pinned host memory: {text}"
    if any(word in lower for word in _DEVICE):
        return f"device memory outside the caching allocator: {text}"
    return None


def does_not_fit(error: BaseException) -> dict[str, str] | None:
    """A row's fields for ``error`` when it is a failed allocation, else None: ``status`` "OOM" (device memory of any
    kind) or "host OOM" (what ``sppo-plan --fit-suite`` reads), and ``does_not_fit``, the allocation that failed."""
    what = allocation_failure(error)
    if what is None:
        return None
    return {"status": "host OOM" if what.startswith(("host", "pinned")) else "OOM", "does_not_fit": what}
