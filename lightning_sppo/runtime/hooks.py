"""Per-subsequence hooks the runtime calls around each action (the offloader is one implementation).

A subsequence is identified by ``(microbatch, subsequence)``; on one device without gradient
accumulation the micro-batch is always 0.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

__all__ = ["SubsequenceHooks", "SubsequenceKey"]

SubsequenceKey = tuple[int, int]
"""(micro-batch index, subsequence index)."""


class SubsequenceHooks(Protocol):
    """What the runtime tells an observer of one step, in the order it happens.

    For one key the calls come as ``forward_context`` (entered around the forward) → ``after_forward``
    → ``before_backward`` → ``after_backward``; keys of one micro-batch run forward in increasing and
    backward in decreasing subsequence order.
    """

    def begin_step(self, spans: list[tuple[int, int]]) -> None:
        """A new step; ``spans`` are the (offset, length) of the subsequences of every micro-batch."""

    def forward_context(self, key: SubsequenceKey) -> AbstractContextManager:
        """Entered around the forward of ``key`` (e.g. ``saved_tensors_hooks`` that capture its activations)."""

    def after_forward(self, key: SubsequenceKey) -> None:
        """The forward of ``key`` has been issued (e.g. start copying its activations to the host)."""

    def before_backward(self, key: SubsequenceKey) -> None:
        """The backward of ``key`` is about to run (e.g. make sure its activations are back)."""

    def after_backward(self, key: SubsequenceKey) -> None:
        """The backward of ``key`` has been issued (its saved activations are no longer needed)."""

    def end_step(self) -> None:
        """The step is over (also after an exception): release per-step state."""
