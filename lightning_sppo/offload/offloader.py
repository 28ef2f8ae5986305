"""The activation offloader: ``SubsequenceHooks`` that move a share alpha_i of each subsequence's saved
activations to host memory after its forward and bring them back just before its backward.

Timeline for one micro-batch on a GPU (C: compute stream, X: copy stream)::

    C:  F0 | F1 wait(D2H 0) free 0 | F2 wait(D2H 1) free 1 | ... | B2 | wait(H2D 1) B1 | wait(H2D 0) B0
    X:       D2H 0                   D2H 1                          H2D 1          H2D 0

The copy of i runs while the next compute action runs (i+1's forward here; in a 1F1B pipeline schedule
it may be another micro-batch's backward); the compute stream waits for it (by event) only at the end of
that action, and only then is i's device memory released. In backward, i-1 is fetched while i's backward
runs. The last subsequence's backward follows its forward at once: whatever of it was sent keeps its
device copy (no round trip), dropped after its backward once the D2H is done. Keys are (micro-batch,
subsequence), so several micro-batches can be in flight. On CPU the copies happen at once
(``SyncCopies``) and the bookkeeping is the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace

import torch

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.offload.policy import OFFLOAD_POLICIES, AdaptivePartition, OffloadCosts, adaptive_alpha
from lightning_sppo.offload.pool import DEFAULT_SLAB_BYTES, HostPool
from lightning_sppo.offload.streams import CopyEngine, CopyTicket, CudaCopies, Mark, SyncCopies
from lightning_sppo.offload.units import SavedUnit, SubsequenceSaves, unpack
from lightning_sppo.runtime.hooks import SubsequenceKey

__all__ = ["DEFAULT_MIN_BYTES", "OffloadStats", "Offloader", "SubsequenceStats", "build_offloader"]

DEFAULT_MIN_BYTES = 2**18
"""256 KiB: ~10 us at ~25 GB/s, the order of a copy's fixed cost; smaller units stay on the device."""


@dataclass(frozen=True)
class SubsequenceStats:
    """What one subsequence saved and sent to the host."""

    key: SubsequenceKey
    level2_bytes: int
    """A_i: bytes of the units that may be offloaded (not weights, not under ``min_bytes``)."""
    offloaded_bytes: int
    alpha: float
    largest_unit_bytes: int
    small_bytes: int
    """Saved bytes under ``min_bytes``: they stay on the device."""


@dataclass(frozen=True)
class OffloadStats:
    """One step of the offloader, as the callback reports it."""

    step: int
    policy: str
    subsequences: tuple[SubsequenceStats, ...]
    offloaded_bytes: int
    prefetched_bytes: int
    peak_saved_bytes: int
    """Peak level-2 bytes on the device (bookkeeping of saved activations, not the allocator's peak)."""
    host_pool_bytes: int
    measured: bool
    """This step measured costs for the adaptive policy (it offloaded fully)."""
    wait_s: float | None = None
    """Time the compute stream waited for copies (GPU only)."""

    @property
    def alphas(self) -> tuple[float, ...]:
        return tuple(s.alpha for s in self.subsequences)

    @property
    def level2_bytes(self) -> int:
        return sum(s.level2_bytes for s in self.subsequences)

    @staticmethod
    def metric_names(prefix: str = "offload/", timed: bool = False) -> list[str]:
        """The names ``as_metrics`` gives (``wait_s`` only where copies are timed: on CUDA)."""
        names = ["offloaded_bytes", "prefetched_bytes", "peak_saved_bytes", "level2_bytes", "host_pool_bytes"]
        return [prefix + name for name in names + (["wait_s"] if timed else [])]

    def as_metrics(self, prefix: str = "offload/") -> dict[str, float]:
        """Flat numbers for a logger."""
        metrics = {
            "offloaded_bytes": self.offloaded_bytes,
            "prefetched_bytes": self.prefetched_bytes,
            "peak_saved_bytes": self.peak_saved_bytes,
            "level2_bytes": self.level2_bytes,
            "host_pool_bytes": self.host_pool_bytes,
        }
        if self.wait_s is not None:
            metrics["wait_s"] = self.wait_s
        return {prefix + name: float(value) for name, value in metrics.items()}


@dataclass(eq=False)
class _KeyState:
    """One subsequence between its forward and the end of its backward."""

    key: SubsequenceKey
    saves: SubsequenceSaves
    level2_bytes: int = 0
    alpha: float = 0.0
    sent: list[SavedUnit] = field(default_factory=list)
    d2h: CopyTicket | None = None
    """The D2H of ``sent``, until the compute stream has waited for it."""
    h2d: CopyTicket | None = None
    """The H2D of ``sent``, until the compute stream has waited for it."""
    released: bool = False
    """The device copies of ``sent`` are gone."""
    fetched: bool = False
    """The H2D of ``sent`` has been issued."""
    resident_bytes: int = 0
    forward_start: Mark = None

    @property
    def offloaded_bytes(self) -> int:
        return sum(unit.nbytes for unit in self.sent)


@dataclass(eq=False)
class _Step:
    index: int
    spans: list[tuple[int, int]]
    measuring: bool
    resident: int = 0
    peak: int = 0
    offloaded: int = 0
    prefetched: int = 0
    subsequences: list[SubsequenceStats] = field(default_factory=list)
    waits: list[tuple[Mark, Mark]] = field(default_factory=list)
    forward_marks: dict[SubsequenceKey, tuple[Mark, Mark]] = field(default_factory=dict)
    copies: list[tuple[CopyTicket, int]] = field(default_factory=list)


class Offloader:
    """Sequence-aware activation offloading (SPPO section 5) as ``SubsequenceHooks`` for ``SubsequenceEngine``.

    Level 1, the K/V cache and its gradient buffers, never passes through here (the attention function does
    not save K/V). Level 2 is everything else autograd saves inside ``forward_context``, except what the
    graph does not own (``units.kept_on_device``: weights, their views and autocast copies, other leaves
    that require grad) and units under ``min_bytes``. Of subsequence i's level-2 bytes A_i, whole units in
    the order they were saved, up to alpha_i A_i bytes, go to host memory (a unit is the span of one storage
    that the saved tensors view; none is split).

    Args:
        policy: ``"none"`` (alpha = 0, bookkeeping only), ``"full"`` (alpha = 1) or ``"adaptive"``
            (``policy.adaptive_alpha``).
        device: the compute device; on ``cuda`` copies run on a side stream into pinned memory.
        min_bytes: saved storages smaller than this stay on the device.
        costs: for ``"adaptive"``: given costs (e.g. the planner's). Without them, or when a step is cut
            differently from what they describe, the step offloads fully and measures the costs itself;
            ``measure_steps`` such steps in a row (the first warms up) give the costs used from then on.
            A partition that changes every step (packed documents under the "flops" partition: each batch is
            cut by its own documents) is never measured twice; after ``measure_steps`` measured steps that
            each cut the sequence differently into as many subsequences, the costs become ``balanced()``
            (the mean forward time for every subsequence, which such compute-balanced cuts share) and apply
            to every later cut with that many subsequences.
        measure_steps: steps measured for each new partition.
        slab_bytes: size of the host pool's slabs.
        copies, pool: replace the copy engine or the host pool (tests).
    """

    def __init__(
        self,
        policy: str,
        device: torch.device | str,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        costs: OffloadCosts | None = None,
        measure_steps: int = 2,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        copies: CopyEngine | None = None,
        pool: HostPool | None = None,
    ) -> None:
        if policy not in OFFLOAD_POLICIES:
            raise ValueError(f"Unknown offload={policy!r}; choose one of {list(OFFLOAD_POLICIES)}.")
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got min_bytes={min_bytes}.")
        if measure_steps < 1:
            raise ValueError(f"measure_steps must be >= 1, got measure_steps={measure_steps}.")
        self.policy = policy
        self.device = _with_index(torch.device(device))
        cuda = self.device.type == "cuda"  # CPU runs never touch a CUDA API
        self.copies: CopyEngine = copies or (CudaCopies(self.device) if cuda else SyncCopies(self.device))
        self.pool = pool or HostPool(pin_memory=cuda, slab_bytes=slab_bytes, setting=f"offload={policy!r}")
        self.min_bytes = min_bytes
        self.costs = costs
        self.measure_steps = measure_steps
        self._costs_given = costs is not None
        self._measured_steps = 0
        self._keys: dict[SubsequenceKey, _KeyState] = {}
        self._step: _Step | None = None
        self._steps = 0
        self._last_stats: OffloadStats | None = None
        self._pending_waits: list[tuple[Mark, Mark]] | None = None
        self._partitions: dict[tuple, list[int]] = {}
        self._recuts = 0  # measured steps in a row, each cut differently into as many subsequences

    # -- SubsequenceHooks ---------------------------------------------------------------------------

    def begin_step(self, spans: list[tuple[int, int]]) -> None:
        self._discard_all(self._step)  # a step that ended without end_step leaves nothing behind
        self._step = _Step(self._steps, list(spans), self._should_measure(spans))
        self._steps += 1

    def forward_context(self, key: SubsequenceKey) -> AbstractContextManager:
        step = self._require_step("forward_context")
        if key in self._keys:
            raise RuntimeError(f"Subsequence {key} ran forward twice in one step; each key runs forward once.")
        state = self._keys[key] = _KeyState(key, SubsequenceSaves(self.device))
        return self._capture(state, step)

    def after_forward(self, key: SubsequenceKey) -> None:
        step, state = self._require_step("after_forward"), self._state(key, "after_forward")
        if step.measuring:
            step.forward_marks[key] = (state.forward_start, self.copies.mark())
        units = [u for u in state.saves.units() if u.nbytes >= max(self.min_bytes, 1)]
        state.level2_bytes = sum(u.nbytes for u in units)
        state.alpha = self._alpha(step, key, state.level2_bytes)
        state.sent = _first_fit(units, state.alpha * state.level2_bytes)
        self._send(step, state)
        state.resident_bytes = state.level2_bytes
        step.resident += state.level2_bytes
        step.peak = max(step.peak, step.resident)  # i's activations and i-1's outgoing copy, together
        step.offloaded += state.offloaded_bytes
        small = sum(u.nbytes for u in state.saves.units()) - state.level2_bytes
        largest = max((u.nbytes for u in units), default=0)
        step.subsequences.append(
            SubsequenceStats(key, state.level2_bytes, state.offloaded_bytes, state.alpha, largest, small)
        )
        self._release_copied(step, keep=key)

    def before_backward(self, key: SubsequenceKey) -> None:
        step, state = self._require_step("before_backward"), self._state(key, "before_backward")
        if state.released and not state.fetched:  # not prefetched (no later backward ran before this one)
            self._fetch(step, state)
        previous = self._keys.get((key[0], key[1] - 1))
        if previous is not None and previous.released and not previous.fetched:
            self._fetch(step, previous)  # overlaps with this backward
        if state.h2d is not None:
            self._wait(step, state.h2d)  # this backward's inputs are back before it reads them
            state.h2d = None
        step.peak = max(step.peak, step.resident)

    def after_backward(self, key: SubsequenceKey) -> None:
        step = self._require_step("after_backward")
        state = self._keys.pop(key, None)
        if state is None:
            raise RuntimeError(f"Offloader.after_backward({key}) without the forward of {key} in this step.")
        self._discard(step, state)
        self._release_copied(step, keep=None)  # copies that overlapped with this backward (pipeline schedules)

    def end_step(self) -> None:
        step = self._step
        if step is None:
            return
        self._discard_all(step)
        if step.measuring:
            self._measure(step)
        self._pending_waits = step.waits if self.device.type == "cuda" else None
        self._last_stats = OffloadStats(
            step=step.index,
            policy=self.policy,
            subsequences=tuple(sorted(step.subsequences, key=lambda s: s.key)),
            offloaded_bytes=step.offloaded,
            prefetched_bytes=step.prefetched,
            peak_saved_bytes=step.peak,
            host_pool_bytes=self.pool.capacity_bytes,
            measured=step.measuring,
        )
        # Safe on GPU too: the next step's D2H into these slices queues behind this step's H2D on the same stream.
        self.pool.reset()
        self._step = None

    # -- public helpers -----------------------------------------------------------------------------

    def release_copies(self) -> None:
        """Free the device copies of every offload issued so far (the compute stream first waits for each copy).

        For a caller whose units are far apart (the "sppo" schedule's shared units): after the next action of any
        kind, rather than at this offloader's next unit, whose forward or backward may come much later.
        """
        if self._step is not None:
            self._release_copied(self._step, keep=None)

    @property
    def last_offloaded_bytes(self) -> int:
        """Bytes the last finished step sent to the host (0 before any step); unlike ``last_stats``, never waits
        for the device, so a metrics callback can read it on any step without a host sync."""
        return self._last_stats.offloaded_bytes if self._last_stats is not None else 0

    @property
    def last_stats(self) -> OffloadStats | None:
        """Stats of the last finished step; on GPU, reading them first waits for that step's copy-wait marks."""
        if self._last_stats is not None and self._pending_waits is not None:
            waited = sum(self.copies.elapsed(before, after) for before, after in self._pending_waits)
            self._last_stats = replace(self._last_stats, wait_s=waited)
            self._pending_waits = None
        return self._last_stats

    def partition(
        self, seq_len: int, num_subsequences: int, granularity: int = 1, config: GPTConfig | None = None
    ) -> list[int]:
        """The "adaptive" partition for this offloader's costs; register it with ``register_partition_policy``.

        The first lengths chosen from measured costs are kept for that shape, so a new measurement (of the new
        partition) does not move the boundaries again.
        """
        shape = (seq_len, num_subsequences, granularity)
        if shape in self._partitions:
            return list(self._partitions[shape])
        settled = self._costs_given or self._measured_steps >= self.measure_steps
        costs = self.costs if settled else None  # the flops partition while the first steps measure
        lengths = AdaptivePartition(costs)(seq_len, num_subsequences, granularity, config)
        if costs is not None and costs.spans is not None and costs.level2_bytes is not None:
            self._partitions[shape] = lengths
        return lengths

    def partition_settled(self, seq_len: int, num_subsequences: int, granularity: int = 1) -> bool:
        """Whether ``partition`` returns the same lengths for this shape from now on.

        True once lengths chosen from measured (or given) costs are kept for the shape, and always for the
        "none" and "full" policies, which never measure and so never change their costs. The strategy stops
        sharing a rank's choice with the others once it is settled.
        """
        shape = (seq_len, num_subsequences, granularity)
        return shape in self._partitions or self.policy != "adaptive"

    def reserve(self, nbytes: int) -> None:
        """Allocate ``nbytes`` of host pool before the run (checks host memory; avoids allocating in a step)."""
        self.pool.reserve(nbytes)

    def release(self) -> None:
        """Drop every per-step state and free the host pool (teardown)."""
        if self._step is not None:
            self.end_step()
        self.copies.synchronize()
        self.pool.release()

    # -- internals ----------------------------------------------------------------------------------

    @contextmanager
    def _capture(self, state: _KeyState, step: _Step) -> Iterator[None]:
        if step.measuring:
            state.forward_start = self.copies.mark()
        with torch.autograd.graph.saved_tensors_hooks(state.saves.pack, unpack):
            yield

    def _should_measure(self, spans: list[tuple[int, int]]) -> bool:
        if self.policy != "adaptive":
            return False
        if self.costs is not None and self.costs.applies_to(spans):
            self._recuts = 0
            return not self._costs_given and self._measured_steps < self.measure_steps
        if self._recut(spans):
            self._recuts += 1
            if self._recuts >= self.measure_steps:  # cut anew every step: keep balanced costs, stop measuring
                self.costs, self._recuts = self.costs.balanced(), 0
                self._measured_steps = self.measure_steps
                return False
        else:
            self._recuts = 0
        self._measured_steps, self._costs_given = 0, False  # a new partition: measure it afresh
        return True

    def _recut(self, spans: list[tuple[int, int]]) -> bool:
        """The step's spans cut the sequence the last measured costs describe into as many subsequences."""
        costs = self.costs
        if costs is None or costs.spans is None or len(costs.spans) != len(spans):
            return False
        return sum(n for _, n in costs.spans) == sum(n for _, n in spans)

    def _alpha(self, step: _Step, key: SubsequenceKey, level2_bytes: int) -> float:
        n, index = len(step.spans), key[1]
        if self.policy == "none":
            return 0.0
        if self.policy == "full":
            return 1.0
        if step.measuring or self.costs is None:
            return 1.0 if index < n - 1 else 0.0  # measure the copies; the last one could not hide anyway
        previous = self._keys.get((key[0], index - 1))
        return adaptive_alpha(index, n, level2_bytes, previous.alpha if previous else 1.0, self.costs)

    def _send(self, step: _Step, state: _KeyState) -> None:
        """Start the D2H of ``state.sent`` into host slices (on a side stream on GPU)."""
        if not state.sent:
            return
        for unit in state.sent:
            unit.check_versions()  # the copy happens now, not at save time: the data must be unchanged
            unit.host = self.pool.take(unit.numel, unit.dtype)
        state.d2h = self.copies.d2h([(unit.host, unit.device_span()) for unit in state.sent])
        step.copies.append((state.d2h, state.offloaded_bytes))

    def _release_copied(self, step: _Step, keep: SubsequenceKey | None) -> None:
        """At the end of a compute action, free the device copies of every offload (but ``keep``'s) issued before it.

        The compute stream waits for each copy at this point, after the work the copy overlapped with, and
        only then are the device buffers dropped: later compute-stream allocations may reuse them safely.
        """
        for key, state in self._keys.items():
            if key != keep and state.d2h is not None:
                self._wait(step, state.d2h)
                state.d2h = None
                for unit in state.sent:
                    unit.drop_device()
                state.released = True
                state.resident_bytes -= state.offloaded_bytes
                step.resident -= state.offloaded_bytes

    def _fetch(self, step: _Step, state: _KeyState) -> None:
        """Bring ``state``'s offloaded units back (H2D on the copy stream; waited for in its before_backward)."""
        for unit in state.sent:
            unit.restored = self.copies.empty(unit.numel, unit.dtype)  # same alignment as the original span
        state.h2d = self.copies.h2d([(u.restored, u.host) for u in state.sent])
        state.fetched = True
        state.resident_bytes += state.offloaded_bytes
        step.resident += state.offloaded_bytes
        step.prefetched += state.offloaded_bytes

    def _wait(self, step: _Step, ticket: CopyTicket) -> None:
        marks = self.copies.wait(ticket)
        if marks is not None:
            step.waits.append(marks)

    def _discard(self, step: _Step, state: _KeyState) -> None:
        """Forget one subsequence, after making sure no copy still touches its device buffers."""
        for ticket in (state.d2h, state.h2d):  # e.g. the last subsequence's D2H, read while its backward ran
            if ticket is not None:
                self._wait(step, ticket)
        state.saves.clear()
        step.resident -= state.resident_bytes

    def _discard_all(self, step: _Step | None) -> None:
        for state in self._keys.values():
            if step is not None:
                self._discard(step, state)
            else:
                state.saves.clear()
        self._keys.clear()

    def _measure(self, step: _Step) -> None:
        """Turn a measured step into costs: D2H bandwidth, forward time and level-2 bytes per subsequence."""
        copied = sum(nbytes for _, nbytes in step.copies)
        seconds = sum(self.copies.elapsed(t.start, t.done) for t, _ in step.copies)
        n = len(step.spans)
        forward, level2 = [[] for _ in range(n)], [[] for _ in range(n)]
        for key, (start, end) in step.forward_marks.items():
            forward[key[1]].append(self.copies.elapsed(start, end))
        for sub in step.subsequences:
            level2[sub.key[1]].append(sub.level2_bytes)
        if any(not times for times in forward):
            return  # a partial step (an exception): keep measuring
        self.costs = OffloadCosts(
            d2h_bytes_per_s=copied / seconds if copied and seconds > 0 else 0.0,
            forward_s=tuple(max(sum(t) / len(t), 1e-9) for t in forward),
            spans=tuple(map(tuple, step.spans)),
            level2_bytes=tuple(round(sum(b) / len(b)) for b in level2),
        )
        self._measured_steps += 1

    def _require_step(self, hook: str) -> _Step:
        if self._step is None:
            raise RuntimeError(f"Offloader.{hook} called outside a step: the runtime calls begin_step first.")
        return self._step

    def _state(self, key: SubsequenceKey, hook: str) -> _KeyState:
        state = self._keys.get(key)
        if state is None:
            raise RuntimeError(f"Offloader.{hook}({key}) without the forward of {key} in this step.")
        return state


def build_offloader(offload: str, device: torch.device | str, **options) -> Offloader | None:
    """The hooks for ``SubsequenceEngine(hooks=...)``: ``None`` for ``offload="none"``, else an ``Offloader``.

    ``options`` are ``Offloader``'s keyword arguments (``min_bytes``, ``costs``, ``measure_steps``, ...).
    """
    if offload not in OFFLOAD_POLICIES:
        raise ValueError(f"Unknown offload={offload!r}; choose one of {list(OFFLOAD_POLICIES)}.")
    if offload == "none":
        return None
    return Offloader(offload, device, **options)


def _first_fit(units: list[SavedUnit], budget: float) -> list[SavedUnit]:
    """Whole units in save order, skipping any that would overshoot: within one unit of ``budget``, never above."""
    chosen, total = [], 0
    for unit in units:
        if total + unit.nbytes <= budget:
            chosen.append(unit)
            total += unit.nbytes
    return chosen


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so saved tensors' devices compare equal to it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
