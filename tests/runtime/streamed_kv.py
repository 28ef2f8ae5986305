"""Copy engines and a probe for K/V streamed from host in the layer order (one process, or each rank of several).

``RecordingCopies`` is the deferred copy engine of the kv_spill tests (a copy runs only when the compute side waits
for it; a fetched chunk holds NaN until then) that also logs each host -> device copy with the streaming pass that
issued it (one ``KVCache.prefix_blocks`` or ``read_spans`` call, tagged by ``tagged_passes``) and each wait:
``double_buffered`` checks from the log that every chunk's successor in its pass was issued before the chunk was
waited for. ``StaleCopies`` plants the bug a stale prefetch would be: each copy brings the host chunk of the copy
before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lightning_sppo.attention.kv_cache import KVCache
from lightning_sppo.attention.kv_spill import KVSpill
from tests.attention.test_kv_spill import DeferredCopies

__all__ = ["RecordingCopies", "StaleCopies", "copies_through", "tagged_passes"]


class _Passes:
    """Which streaming pass of the K/V cache is running now (None: none)."""

    current: object | None = None

    @classmethod
    def tag(cls, method):
        def tagged(self, *args, **kwargs):
            inner, tag = method(self, *args, **kwargs), object()
            while True:
                cls.current = tag
                try:
                    item = next(inner)
                except StopIteration:
                    return
                finally:
                    cls.current = None
                yield item

        return tagged


@contextmanager
def tagged_passes() -> Iterator[None]:
    """While open, copies issued by a streaming pass of any ``KVCache`` carry that pass's tag."""
    originals = KVCache.prefix_blocks, KVCache.read_spans
    KVCache.prefix_blocks, KVCache.read_spans = (_Passes.tag(method) for method in originals)
    try:
        yield
    finally:
        KVCache.prefix_blocks, KVCache.read_spans = originals


class RecordingCopies(DeferredCopies):
    """Deferred copies that log each host -> device copy (with its pass) and each wait (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int, object | None]] = []

    def h2d(self, pairs):
        ticket = super().h2d(pairs)
        self.log.append(("issue", ticket.done, _Passes.current))
        return ticket

    def wait(self, ticket):
        self.log.append(("wait", ticket.done, None))
        super().wait(ticket)

    def double_buffered(self) -> int:
        """Check that every streamed chunk's successor in its pass was issued before the chunk was waited for;
        returns how many chunks had a successor (AssertionError naming the first that did not)."""
        issued = {ticket: (at, tag) for at, (kind, ticket, tag) in enumerate(self.log) if kind == "issue"}
        waited = {ticket: at for at, (kind, ticket, _) in enumerate(self.log) if kind == "wait"}
        checked = 0
        for ticket, (_, tag) in issued.items():
            following = [t for t, (_, other) in issued.items() if other is tag and t > ticket]
            if following and tag is not None:
                successor = min(following)
                assert issued[successor][0] < waited[ticket], (
                    f"copy {successor} (the next chunk of the same pass) was issued only after copy {ticket} was"
                    f" waited for: no double buffering. Log: {self.log}"
                )
                checked += 1
        return checked


class StaleCopies(DeferredCopies):
    """Each host -> device copy reads the host chunk of the copy before it (when the shapes agree)."""

    def __init__(self) -> None:
        super().__init__()
        self._previous = None

    def h2d(self, pairs):
        sources = [host for _, host in pairs]
        if self._previous is not None and [s.shape for s in self._previous] == [s.shape for s in sources]:
            pairs = [(device, stale) for (device, _), stale in zip(pairs, self._previous, strict=True)]
        self._previous = sources
        return super().h2d(pairs)


@contextmanager
def copies_through(copies: DeferredCopies) -> Iterator[None]:
    """While open, every K/V spill copies through ``copies`` (whatever builds the spill, whenever)."""
    original = KVSpill.engine

    def engine(spill: KVSpill, device):
        spill.copies = copies
        return copies

    KVSpill.engine = engine
    try:
        yield
    finally:
        KVSpill.engine = original
