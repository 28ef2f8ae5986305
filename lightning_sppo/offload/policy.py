"""How much of each subsequence goes to host memory (alpha), and the offload-aware "adaptive" partition.

SPPO section 5.2. Subsequence i saves A_i level-2 bytes for backward; a share alpha_i of them is copied to
host memory while subsequence i+1 computes. On one stage the saved bytes on the device evolve as

    M_i = M_{i-1} + A_i - alpha_{i-1} A_{i-1}        (M_{-1} = 0)

(the offloaded part of i-1 is freed once its copy is done, at the end of i's forward), so the device
holds at most max_i (M_{i-1} + A_i). The paper picks alpha_i A_i = M_threshold with
M_threshold / BW_D2H = T_balanced_comp: each offload is as large as the next subsequence's compute can hide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Literal, get_args

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.partition import flops as flops_partition

__all__ = [
    "OFFLOAD_POLICIES",
    "AdaptivePartition",
    "OffloadCosts",
    "OffloadPolicy",
    "adaptive_alpha",
    "adaptive_partition",
    "alphas",
    "memory_dynamics",
    "peak_saved_bytes",
]

OffloadPolicy = Literal["none", "full", "adaptive"]
OFFLOAD_POLICIES: tuple[str, ...] = get_args(OffloadPolicy)


@dataclass(frozen=True, kw_only=True)
class OffloadCosts:
    """What the alpha rule and the adaptive partition need: measured in the first steps, or a planner's prediction."""

    d2h_bytes_per_s: float
    """Device-to-host copy bandwidth BW_D2H (0 when nothing was copied while measuring)."""
    forward_s: tuple[float, ...]
    """Forward time of each subsequence; a single value is the paper's balanced time T_balanced_comp for all."""
    spans: tuple[tuple[int, int], ...] | None = None
    """(offset, length) of the partition these costs belong to; ``None``: any partition they fit."""
    level2_bytes: tuple[int, ...] | None = None
    """Level-2 bytes A_i of each subsequence of ``spans`` (the adaptive partition needs them)."""

    def __post_init__(self) -> None:
        if not self.d2h_bytes_per_s >= 0 or math.isinf(self.d2h_bytes_per_s):
            raise ValueError(f"OffloadCosts.d2h_bytes_per_s must be finite and >= 0, got {self.d2h_bytes_per_s}.")
        if not self.forward_s or any(not t > 0 for t in self.forward_s):
            raise ValueError(f"OffloadCosts.forward_s must be positive times in seconds, got {self.forward_s}.")
        for name in ("spans", "level2_bytes"):
            value = getattr(self, name)
            if value is not None and len(self.forward_s) not in (1, len(value)):
                raise ValueError(
                    f"OffloadCosts.{name} has {len(value)} entries but forward_s has {len(self.forward_s)};"
                    " give one forward time per subsequence (or one for all)."
                )

    def applies_to(self, spans: Sequence[tuple[int, int]]) -> bool:
        """Whether these costs describe a step cut into ``spans``."""
        if self.spans is not None:
            return tuple(map(tuple, spans)) == self.spans
        return len(self.forward_s) in (1, len(spans))

    def balanced(self) -> OffloadCosts:
        """These costs for any partition into as many subsequences: the mean forward time as every subsequence's
        (the partition balances compute), no spans or level-2 bytes of a particular cut."""
        mean = sum(self.forward_s) / len(self.forward_s)
        return replace(self, forward_s=(mean,) if self.spans is None else (mean,) * len(self.spans), spans=None,
                       level2_bytes=None)  # fmt: skip

    def threshold_bytes(self, index: int) -> float:
        """M_threshold for subsequence ``index``: the bytes BW_D2H moves while the next subsequence computes."""
        following = self.forward_s[0] if len(self.forward_s) == 1 else self.forward_s[index + 1]
        return self.d2h_bytes_per_s * following


def adaptive_alpha(
    index: int, num_subsequences: int, level2_bytes: int, previous_alpha: float, costs: OffloadCosts
) -> float:
    """alpha_i = min(1, M_threshold / A_i, alpha_{i-1}); the last subsequence keeps everything (alpha = 0).

    The last one's backward follows its forward at once, so no compute could hide its copy. Taking the
    minimum with alpha_{i-1} keeps alpha non-increasing, as the paper requires.
    """
    if index == num_subsequences - 1:
        return 0.0
    threshold = costs.threshold_bytes(index)
    alpha = 1.0 if level2_bytes <= threshold else threshold / level2_bytes
    return min(alpha, previous_alpha)


def alphas(policy: OffloadPolicy, level2_bytes: Sequence[int], costs: OffloadCosts | None = None) -> list[float]:
    """alpha_i of every subsequence of one micro-batch under ``policy`` (``costs`` needed for "adaptive")."""
    n = len(level2_bytes)
    if policy == "none":
        return [0.0] * n
    if policy == "full":
        return [1.0] * n
    if policy != "adaptive":
        raise ValueError(f"Unknown offload={policy!r}; choose one of {list(OFFLOAD_POLICIES)}.")
    if costs is None:
        raise ValueError("offload='adaptive' needs costs (measured or given) to choose alpha.")
    out: list[float] = []
    for i, a in enumerate(level2_bytes):
        out.append(adaptive_alpha(i, n, a, out[-1] if out else 1.0, costs))
    return out


def memory_dynamics(level2_bytes: Sequence[int], offloaded_bytes: Sequence[int]) -> list[int]:
    """M_i = M_{i-1} + A_i - alpha_{i-1} A_{i-1}: saved bytes on the device once subsequence i's forward is done."""
    m, out = 0, []
    for i, a in enumerate(level2_bytes):
        m += a - (offloaded_bytes[i - 1] if i else 0)
        out.append(m)
    return out


def peak_saved_bytes(level2_bytes: Sequence[int], offloaded_bytes: Sequence[int]) -> int:
    """max_i (M_{i-1} + A_i): while i computes, the part of i-1 being copied out is still on the device.

    Backward reaches the same values in mirror image (prefetching i-1 while i's activations are back),
    so this is the peak of the whole step.
    """
    before = [0, *memory_dynamics(level2_bytes, offloaded_bytes)][:-1]  # M_{i-1}
    return max((m + a for m, a in zip(before, level2_bytes, strict=True)), default=0)


# -- the adaptive partition --------------------------------------------------------------------


@dataclass(frozen=True)
class _CostModel:
    """Forward time kappa * FLOPs(s, C) (Seq1F1B's count) and copy time c * s of a subsequence of s tokens."""

    num_params: float
    """P: the weights a token multiplies with."""
    ld: float
    """L * d."""
    seconds_per_flop: float
    copy_s_per_token: float

    @classmethod
    def fit(cls, costs: OffloadCosts | None, config: GPTConfig | None) -> _CostModel | None:
        if config is None or costs is None or costs.spans is None or costs.level2_bytes is None:
            return None
        if costs.d2h_bytes_per_s <= 0:
            return None
        model = cls(config.num_matmul_parameters(), config.n_layer * config.n_embd, 0, 0)
        work = sum(model.flops(length, offset) for offset, length in costs.spans)
        seconds = sum(costs.forward_s) if len(costs.forward_s) > 1 else costs.forward_s[0] * len(costs.spans)
        tokens = sum(length for _, length in costs.spans)
        per_token = sum(costs.level2_bytes) / tokens / costs.d2h_bytes_per_s
        return cls(model.num_params, model.ld, seconds / work, per_token)

    def flops(self, length: float, prefix: float) -> float:
        """2 s P + 2 L d s (C + s): FLOPs of s tokens after C earlier ones (as ``partition.flops``)."""
        return 2.0 * length * self.num_params + 2.0 * self.ld * length * (prefix + length)

    def length_for(self, seconds: float, prefix: float) -> float:
        """The s whose forward after ``prefix`` tokens takes ``seconds``: stable root of 2Ld s^2 + b s = T/kappa."""
        a, b = 2.0 * self.ld, 2.0 * self.num_params + 2.0 * self.ld * prefix
        work = seconds / self.seconds_per_flop
        return 2.0 * work / (b + math.sqrt(b * b + 4.0 * a * work))

    def hides_every_copy(self, lengths: Sequence[int]) -> bool:
        """Whether each full offload (all but the last) fits in the next subsequence's forward."""
        prefix = list(accumulate(lengths))
        return all(
            self.copy_s_per_token * lengths[i] <= self.seconds_per_flop * self.flops(lengths[i + 1], prefix[i])
            for i in range(len(lengths) - 1)
        )

    def balanced_lengths(self, seq_len: int, n: int) -> list[float]:
        """Real lengths for the smallest period E in which every forward runs and every full copy fits.

        s_i = min(the length whose forward takes E, the tokens E copies) for all but the last, which is
        never offloaded; the total grows with E, so E is found by bisection.
        """

        def lengths(period: float) -> list[float]:
            out, prefix = [], 0.0
            for i in range(n):
                x = self.length_for(period, prefix)
                if i < n - 1:
                    x = min(x, period / self.copy_s_per_token)
                out.append(x)
                prefix += x
            return out

        lo, hi = 0.0, self.seconds_per_flop * self.flops(seq_len, 0.0)  # at hi, the first forward alone takes seq_len
        hi = max(hi, self.copy_s_per_token * seq_len)  # ... and so does the first copy
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if sum(lengths(mid)) < seq_len else (lo, mid)
        result = lengths(hi)
        return [x * seq_len / sum(result) for x in result]


@dataclass(frozen=True)
class AdaptivePartition:
    """SPPO's offload-aware partition as a partition policy: ``(seq_len, n, granularity, config) -> lengths``.

    Compute stays balanced while each subsequence's full offload fits in one period: every subsequence
    takes at most E = max(its forward, the previous subsequence's copy), with E as small as ``seq_len``
    allows. Where the equal-FLOPs (``flops``) partition already hides every copy behind the next forward it
    is returned unchanged; where copies are slower, the long early subsequences are cut to what one period
    can copy (s_i <= BW_D2H E / bytes per token) and the later ones take the rest. Whatever still does not
    hide is left to alpha. Without costs that give the copy bandwidth, the level-2 bytes and the forward
    times of a measured partition (or without ``config``), this is the ``flops`` partition: no measurements
    yet. Boundaries are rounded to ``granularity``.
    """

    costs: OffloadCosts | None = None

    def __call__(
        self, seq_len: int, num_subsequences: int, granularity: int = 1, config: GPTConfig | None = None
    ) -> list[int]:
        balanced = flops_partition(seq_len, num_subsequences, granularity, config=config)  # also checks the inputs
        model = _CostModel.fit(self.costs, config)
        if model is None or num_subsequences == 1 or model.hides_every_copy(balanced):
            return balanced
        return _round_to_granules(model.balanced_lengths(seq_len, num_subsequences), seq_len, granularity)


adaptive_partition = AdaptivePartition()
"""The policy registered as ``"adaptive"`` on import: no costs, so the flops partition until costs are given."""


def _round_to_granules(ideal: Sequence[float], seq_len: int, granularity: int) -> list[int]:
    """Boundaries rounded to the nearest granule, each subsequence at least one granule; the last absorbs the rest."""
    units, n = -(-seq_len // granularity), len(ideal)
    bounds, prev = [], 0
    for i, cumulative in enumerate(accumulate(x * units / seq_len for x in ideal)):
        bound = units if i == n - 1 else min(max(round(cumulative), prev + 1), units - (n - 1 - i))
        bounds.append(bound)
        prev = bound
    lengths = [(b - a) * granularity for a, b in zip([0, *bounds], bounds, strict=False)]
    lengths[-1] -= sum(lengths) - seq_len
    return lengths
