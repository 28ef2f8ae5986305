"""How a sequence is cut into subsequences.

Policies return lengths s_0..s_{N-1} that are positive, sum to S and keep every boundary on a multiple
of ``granularity`` (the kernel block or the SP size); only the last length absorbs ``S % granularity``.

* ``length``: equal lengths (earlier ones take the remainder).
* ``flops`` (Seq1F1B, Eq. 4): equal FLOPs per segment with FLOPs(S_i) = 2 n_i P + 2 L n_i (sum_{j<=i} n_j) d,
  so early segments are long and late ones short; lengths are non-increasing.
* ``adaptive`` (SPPO): balances compute while keeping each offload hideable; a hook that the offload
  policy fills through ``register_partition_policy``.

Packed documents (``split_sequence(..., documents=...)``): a token attends only to the keys of its own document,
so the attention work of position t is proportional to the keys it attends, t - starts[t] + 1, and late
subsequences are no longer dearer than early ones. ``flops`` and ``adaptive`` then balance the masked count as
the kernels compute it (``planner.flops``: 2 P per token and row, 4 L H Dh per (query, key) pair, summed over
the batch's rows), which depends on where the documents start: the lengths are decided per batch
(``masked_flops``). "adaptive" takes the same lengths: its copy-hiding refinement fits costs measured on one
partition, which per-batch lengths never repeat (alpha still adapts each subsequence's offload). ``length``
ignores the documents.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import accumulate

import torch

from lightning_sppo.documents import Documents
from lightning_sppo.model.config import GPTConfig

__all__ = [
    "DOCUMENT_AWARE_POLICIES",
    "PARTITION_POLICIES",
    "adaptive",
    "auto_num_subsequences",
    "flops",
    "length",
    "masked_flops",
    "register_partition_policy",
    "split_sequence",
    "spans",
]

PartitionPolicy = Callable[[int, int, int, "GPTConfig | None"], list[int]]
"""(seq_len, num_subsequences, granularity, config) -> lengths."""

DEFAULT_TOKENS_PER_SUBSEQUENCE = 4096
"""Target subsequence length for ``num_subsequences="auto"`` until the planner chooses it (paper: 2K-16K)."""


def length(seq_len: int, num_subsequences: int, granularity: int = 1) -> list[int]:
    """Equal lengths; the first ``units % N`` subsequences are one granule longer."""
    units = _check(seq_len, num_subsequences, granularity)
    base, extra = divmod(units, num_subsequences)
    return _to_tokens([base + (i < extra) for i in range(num_subsequences)], seq_len, granularity)


def flops(
    seq_len: int,
    num_subsequences: int,
    granularity: int = 1,
    *,
    config: GPTConfig | None = None,
    num_params: int | None = None,
    n_layer: int | None = None,
    n_embd: int | None = None,
) -> list[int]:
    """Equal FLOPs per subsequence (Seq1F1B); lengths are non-increasing.

    The sizes come from ``config`` (P = the weights a token multiplies with: all but the embedding
    lookup), or explicitly from ``num_params``, ``n_layer`` and ``n_embd``.
    """
    if config is not None:
        num_params = config.num_matmul_parameters()
        n_layer, n_embd = config.n_layer, config.n_embd
    if num_params is None or n_layer is None or n_embd is None:
        raise ValueError(
            "partition='flops' needs the model's sizes: pass config=GPTConfig(...) or num_params, n_layer and n_embd."
        )
    units = _check(seq_len, num_subsequences, granularity)
    ideal = _equal_flops_lengths(float(seq_len), num_subsequences, num_params, n_layer * n_embd)
    scale = units / seq_len  # tokens -> granules
    return _to_tokens(_round_non_increasing([x * scale for x in ideal], units), seq_len, granularity)


def masked_flops(
    seq_len: int,
    num_subsequences: int,
    granularity: int = 1,
    *,
    config: GPTConfig,
    documents: Documents | None = None,
    document_length: int | None = None,
) -> list[int]:
    """Equal FLOPs per subsequence for packed ``documents`` (module docstring): boundaries on the granules where
    the cumulative masked count is nearest to each i / N of the total; lengths follow the documents, not a rule.

    ``document_length`` instead of ``documents`` (the planner): documents of that many tokens back to back."""
    units = _check(seq_len, num_subsequences, granularity)
    ends = torch.clamp(torch.arange(units + 1) * granularity, max=seq_len)  # [units + 1], granule boundaries
    pair = 4.0 * config.n_layer * config.n_head * config.head_size  # FLOPs of one (query, key) pair, all layers
    matmul = 2.0 * config.num_matmul_parameters()  # FLOPs of one token and row
    if (documents is None) == (document_length is None):
        raise ValueError("masked_flops takes either documents (a batch) or document_length (the planner).")
    if documents is not None:
        rows, tokens = documents.shape
        if tokens != seq_len:
            raise ValueError(f"documents cover {tokens} tokens but the sequence has seq_len={seq_len}.")
        per_token = rows * matmul + pair * documents.key_counts()  # [S]
        at = torch.cat([torch.zeros(1, dtype=torch.float64), per_token.cumsum(0)])[ends]  # [units + 1]
    else:  # tokens [0, T) of documents of length L from 0 attend q L (L + 1) / 2 + r (r + 1) / 2 keys in all
        whole, rest = ends.div(document_length, rounding_mode="floor"), ends.remainder(document_length)
        keys = whole * document_length * (document_length + 1) / 2 + rest * (rest + 1) / 2
        at = matmul * ends.to(torch.float64) + pair * keys.to(torch.float64)
    total, bounds, prev = float(at[-1]), [], 0
    for i in range(1, num_subsequences):
        target = total * i / num_subsequences
        unit = int(torch.searchsorted(at, torch.tensor([target], dtype=torch.float64)))
        if unit > 0 and target - float(at[unit - 1]) < float(at[min(unit, units)]) - target:
            unit -= 1  # the nearer of the two granule boundaries around the target
        unit = min(max(unit, prev + 1), units - (num_subsequences - i))
        bounds.append(unit)
        prev = unit
    counts = [b - a for a, b in zip([0, *bounds], [*bounds, units], strict=True)]
    return _to_tokens(counts, seq_len, granularity)


def _equal_flops_lengths(seq_len: float, n: int, num_params: int, ld: int) -> list[float]:
    """Real lengths n_i with 2 n_i P + 2 L d n_i (C_{i-1} + n_i) equal for all i, summing to seq_len.

    Each n_i solves a quadratic given the per-segment budget T; the total length grows with T, so T
    is found by bisection.
    """

    def lengths(budget: float) -> list[float]:
        out, prefix = [], 0.0
        for _ in range(n):
            a, b = 2.0 * ld, 2.0 * num_params + 2.0 * ld * prefix
            x = 2.0 * budget / (b + math.sqrt(b * b + 4.0 * a * budget))  # stable root of a x^2 + b x = T
            out.append(x)
            prefix += x
        return out

    lo, hi = 0.0, 2.0 * seq_len * num_params + 2.0 * ld * seq_len * seq_len  # hi: one segment takes it all
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sum(lengths(mid)) < seq_len else (lo, mid)
    result = lengths(hi)
    total = sum(result)
    return [x * seq_len / total for x in result]


def _round_non_increasing(ideal: list[float], units: int) -> list[int]:
    """Integer granules, each >= 1, summing to ``units``, non-increasing when ``ideal`` is.

    Boundaries are rounded to the nearest granule (so near-equal ideals give equal counts); where
    rounding left a segment shorter than its successor, a granule moves forward.
    """
    n, counts, prev, cumulative = len(ideal), [], 0, 0.0
    for i, x in enumerate(ideal):
        cumulative += x
        bound = min(max(round(cumulative), prev + 1), units - (n - 1 - i))
        counts.append(bound - prev)
        prev = bound
    reordered = True
    while reordered:
        reordered = False
        for i in range(n - 1):
            if counts[i] < counts[i + 1]:
                counts[i], counts[i + 1] = counts[i] + 1, counts[i + 1] - 1
                reordered = True
    return counts


def _check(seq_len: int, num_subsequences: int, granularity: int) -> int:
    if not isinstance(num_subsequences, int) or num_subsequences < 1:
        raise ValueError(f"num_subsequences must be a positive integer, got num_subsequences={num_subsequences!r}.")
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got granularity={granularity}.")
    if seq_len < 1:
        raise ValueError(f"The sequence is empty (length {seq_len}); nothing to partition.")
    units = -(-seq_len // granularity)
    if num_subsequences > units:
        raise ValueError(
            f"num_subsequences={num_subsequences} is larger than the sequence allows: {seq_len} tokens in"
            f" granules of {granularity} give at most {units} subsequences. Use num_subsequences<={units}."
        )
    return units


def _to_tokens(counts: list[int], seq_len: int, granularity: int) -> list[int]:
    lengths = [c * granularity for c in counts]
    lengths[-1] -= sum(lengths) - seq_len  # the last one absorbs seq_len % granularity
    return lengths


def _unavailable_adaptive(seq_len: int, n: int, granularity: int, config: GPTConfig | None) -> list[int]:
    raise NotImplementedError(
        "partition='adaptive' is filled by the offload policy when lightning_sppo.offload is imported;"
        " import it, or use partition='length' or partition='flops'."
    )


DOCUMENT_AWARE_POLICIES = ("flops", "adaptive")
"""Policies that follow the documents of a batch (``masked_flops``); the others ignore them."""

PARTITION_POLICIES: dict[str, PartitionPolicy] = {
    "length": lambda seq_len, n, granularity, config: length(seq_len, n, granularity),
    "flops": lambda seq_len, n, granularity, config: flops(seq_len, n, granularity, config=config),
    "adaptive": _unavailable_adaptive,
}


def adaptive(
    seq_len: int, num_subsequences: int, granularity: int = 1, *, config: GPTConfig | None = None
) -> list[int]:
    """SPPO's offload-aware partition: the policy registered under ``"adaptive"`` (the offload module's)."""
    return split_sequence(seq_len, num_subsequences, "adaptive", granularity=granularity, config=config)


def register_partition_policy(name: str, policy: PartitionPolicy) -> None:
    """Install (or replace) a partition policy; the offload module registers ``adaptive`` here."""
    PARTITION_POLICIES[name] = policy


def split_sequence(
    seq_len: int,
    num_subsequences: int,
    policy: str = "length",
    *,
    granularity: int = 1,
    config: GPTConfig | None = None,
    documents: Documents | None = None,
    document_length: int | None = None,
) -> list[int]:
    """Lengths of the ``num_subsequences`` subsequences of a sequence of ``seq_len`` tokens.

    ``documents``: the batch's packed documents (or, for the planner, ``document_length``: documents of that many
    tokens); "flops" and "adaptive" then balance the masked FLOPs (``masked_flops``, which needs ``config``)."""
    if policy not in PARTITION_POLICIES:
        raise ValueError(f"Unknown partition={policy!r}; choose one of {sorted(PARTITION_POLICIES)}.")
    masked = documents is not None or document_length is not None
    if masked and policy in DOCUMENT_AWARE_POLICIES:
        if config is None:
            raise ValueError(f"partition={policy!r} with documents needs the model's config=GPTConfig(...).")
        lengths = masked_flops(
            seq_len, num_subsequences, granularity, config=config, documents=documents, document_length=document_length
        )
    else:
        lengths = PARTITION_POLICIES[policy](seq_len, num_subsequences, granularity, config)
    if len(lengths) != num_subsequences or sum(lengths) != seq_len or min(lengths) < 1:
        raise RuntimeError(f"partition={policy!r} returned invalid lengths {lengths} for S={seq_len}.")
    return lengths


def spans(lengths: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each subsequence."""
    offsets = [0, *accumulate(lengths)][:-1]
    return list(zip(offsets, lengths, strict=True))


def auto_num_subsequences(
    seq_len: int, granularity: int = 1, tokens_per_subsequence: int = DEFAULT_TOKENS_PER_SUBSEQUENCE
) -> int:
    """N for ``num_subsequences="auto"``: subsequences of about ``tokens_per_subsequence`` tokens."""
    units = -(-seq_len // granularity)
    return max(1, min(units, -(-seq_len // tokens_per_subsequence)))
