"""K/V caches of the micro-batches in flight on one stage.

Each micro-batch whose subsequences are between their first forward and their last backward needs its own
set of per-layer caches. Sets are pooled: a set is taken at a micro-batch's first forward, returned after
its last backward, and reused (allocation kept) by later micro-batches and steps, so the pool grows only
to the schedule's largest number of micro-batches in flight.

With ``kv_device_tokens`` set, every cache keeps only that many tokens on the device and the rest in host memory
(``attention.kv_spill``); the caches of the pool share one ``KVSpill``, whose host memory is handed out again
from its start every step.
"""

from __future__ import annotations

import torch

from lightning_sppo.attention import KVCache, SubsequenceAttention
from lightning_sppo.attention.kv_spill import DEFAULT_KV_CHUNK_TOKENS, KVSpill

__all__ = ["CachePool"]


class CachePool:
    """``grad_dtype``: the dK/dV accumulators' dtype (None: fp32, or wider; see ``KVCache``). ``device_tokens``
    (``kv_device_tokens``): tokens of each cache kept on the device, None: all; ``chunk_tokens``
    (``kv_chunk_tokens``): tokens per chunk streamed from host."""

    def __init__(
        self,
        cores: list[SubsequenceAttention],
        grad_dtype: torch.dtype | None = None,
        device_tokens: int | None = None,
        chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS,
    ) -> None:
        self.cores = cores
        self.grad_dtype = grad_dtype
        self.spill = None if device_tokens is None else KVSpill(device_tokens, chunk_tokens)
        self._sets: list[list[KVCache]] = []
        self._free: list[int] = []
        self._owner: dict[int, int] = {}  # micro-batch -> set index
        self._seq_len = 0
        self._strict = True
        self._last_offset: int | None = None

    def use_spill(self, device_tokens: int | None, chunk_tokens: int | None) -> None:
        """Spill as the step's plan says (``StepPlan.spill``); caches built for another spill are let go."""
        if (device_tokens, chunk_tokens) != self.settings():
            self.free_memory()
            self._sets, self._free, self._owner = [], [], {}
            self.spill = None if device_tokens is None else KVSpill(device_tokens, chunk_tokens)

    def begin_step(self, seq_len: int, strict: bool = True, last_offset: int | None = None) -> None:
        """A new step over sequences of ``seq_len`` tokens whose last subsequence starts at ``last_offset`` (when the
        caller knows its partition: the caches then hold only what later subsequences read, ``KVCache``)."""
        self._seq_len, self._strict, self._last_offset = seq_len, strict, last_offset
        if self.spill is not None:  # the host parts are handed out again this step
            self.spill.begin_step()
            for cache in self.caches():
                cache.drop_host()
        self._owner.clear()
        self._free = list(range(len(self._sets)))

    def bind(self, microbatch: int) -> None:
        """Point every layer's core at ``microbatch``'s caches (taking a free set at its first forward)."""
        if microbatch not in self._owner:
            if not self._free:
                self._sets.append(
                    [KVCache(self._seq_len, grad_dtype=self.grad_dtype, spill=self.spill) for _ in self.cores]
                )
                self._free.append(len(self._sets) - 1)
            index = self._free.pop()
            for cache in self._sets[index]:
                cache.strict = self._strict
                cache.reset(self._seq_len, self._last_offset)
            self._owner[microbatch] = index
        for core, cache in zip(self.cores, self._sets[self._owner[microbatch]], strict=True):
            core.cache = cache

    def release(self, microbatch: int) -> None:
        """``microbatch`` finished its last backward: its caches may serve another micro-batch."""
        self._free.append(self._owner.pop(microbatch))

    def unbind(self) -> None:
        for core in self.cores:
            core.cache = None

    @property
    def num_sets(self) -> int:
        return len(self._sets)

    def caches(self) -> list[KVCache]:
        """Every cache of every set, bound or free."""
        return [cache for caches in self._sets for cache in caches]

    def settings(self) -> tuple[int | None, int | None]:
        """(kv_device_tokens, kv_chunk_tokens) this pool was built for ((None, None) without a spill)."""
        return (None, None) if self.spill is None else (self.spill.device_tokens, self.spill.chunk_tokens)

    def nbytes(self) -> int:
        """Device bytes every cache holds now (K/V and dK/dV of the tokens kept on the device)."""
        return sum(cache.nbytes() for cache in self.caches())

    def peak_nbytes(self) -> int:
        """The sum of every cache's most device bytes since its reset (``KVCache.peak_nbytes``): K/V of the whole
        sequence and dK/dV of [0, o_last) per layer."""
        return sum(cache.peak_nbytes() for cache in self.caches())

    def host_nbytes(self) -> int:
        """Host bytes of every cache (K/V and dK/dV of the spilled tokens)."""
        return sum(cache.host_nbytes() for cache in self.caches())

    def free_memory(self) -> None:
        for cache in self.caches():
            cache.release()
        if self.spill is not None:
            self.spill.release()
