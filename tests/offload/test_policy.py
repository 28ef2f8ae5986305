"""The alpha rule and the adaptive partition, as pure functions."""

from __future__ import annotations

from itertools import accumulate

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_sppo.offload  # noqa: F401  (registers the "adaptive" partition)
from lightning_sppo import GPTConfig
from lightning_sppo.offload import AdaptivePartition, OffloadCosts, adaptive_partition, alphas
from lightning_sppo.offload.policy import _CostModel
from lightning_sppo.partition import PARTITION_POLICIES, flops, split_sequence
from lightning_sppo.partition import spans as to_spans
from tests.conftest import parity_config


def test_alpha_rule_by_hand():
    costs = OffloadCosts(d2h_bytes_per_s=2.0, forward_s=(50.0,))  # M_threshold = 100 bytes
    assert alphas("adaptive", [100, 200, 50, 80], costs) == [1.0, 0.5, 0.5, 0.0]  # min with alpha_{i-1}; last keeps
    assert alphas("full", [100, 200], costs) == [1.0, 1.0]
    assert alphas("none", [100, 200]) == [0.0, 0.0]
    per_subsequence = OffloadCosts(d2h_bytes_per_s=1.0, forward_s=(9.0, 30.0, 60.0))  # copy of i hides in T_{i+1}
    assert alphas("adaptive", [60, 60, 60], per_subsequence) == [0.5, 0.5, 0.0]
    with pytest.raises(ValueError, match="needs costs"):
        alphas("adaptive", [1, 2])


@settings(max_examples=40, deadline=None)
@given(
    level2=st.lists(st.integers(0, 10**6), min_size=1, max_size=12),
    threshold=st.floats(1.0, 2e6),
)
def test_alpha_is_non_increasing_in_unit_interval_and_hideable(level2, threshold):
    result = alphas("adaptive", level2, OffloadCosts(d2h_bytes_per_s=1.0, forward_s=(threshold,)))
    assert result == sorted(result, reverse=True) and all(0.0 <= a <= 1.0 for a in result)
    assert result[-1] == 0.0
    assert all(a * b <= threshold * (1 + 1e-12) for a, b in zip(result, level2, strict=True))


def measured_costs(config: GPTConfig, seq_len: int, n: int, bytes_per_token: float, d2h: float, tflops: float):
    """Costs as if measured on the flops partition: forward time = FLOPs / rate, A_i proportional to s_i."""
    lengths = flops(seq_len, n, config=config)
    params = config.num_parameters() - config.vocab_size * config.n_embd
    counter = _CostModel(params, config.n_layer * config.n_embd, seconds_per_flop=0.0, copy_s_per_token=0.0)
    spans = tuple(to_spans(lengths))
    return OffloadCosts(
        d2h_bytes_per_s=d2h,
        forward_s=tuple(counter.flops(s, o) / (tflops * 1e12) for o, s in spans),
        spans=spans,
        level2_bytes=tuple(round(bytes_per_token * s) for s in lengths),
    )


GPT_1B = GPTConfig.from_name("gpt-1b")


def test_without_costs_adaptive_is_the_flops_partition():
    config = parity_config()
    assert PARTITION_POLICIES["adaptive"] is adaptive_partition
    assert split_sequence(45, 5, "adaptive", config=config) == flops(45, 5, config=config)
    given = OffloadCosts(d2h_bytes_per_s=1.0, forward_s=(1.0,))  # no spans or bytes: nothing to fit
    assert AdaptivePartition(given)(45, 5, 1, config) == flops(45, 5, config=config)


def test_cheap_copies_keep_the_flops_partition():
    costs = measured_costs(GPT_1B, 2**17, 16, bytes_per_token=5e5, d2h=1e13, tflops=400)
    assert AdaptivePartition(costs)(2**17, 16, 128, GPT_1B) == flops(2**17, 16, 128, config=GPT_1B)


def periods(model: _CostModel, lengths: list[int]) -> list[float]:
    """Each subsequence's time with full offload: its forward, or the previous copy if that takes longer."""
    prefix = [0, *accumulate(lengths)]
    compute = [model.seconds_per_flop * model.flops(s, prefix[i]) for i, s in enumerate(lengths)]
    return [max(compute[i], model.copy_s_per_token * lengths[i - 1] if i else 0.0) for i in range(len(lengths))]


@pytest.mark.parametrize("d2h", [5e9, 2e10, 5e10])
def test_slow_copies_get_shorter_early_subsequences_and_a_shorter_period(d2h):
    seq_len, n = 2**17, 16
    costs = measured_costs(GPT_1B, seq_len, n, bytes_per_token=5e5, d2h=d2h, tflops=400)
    model = _CostModel.fit(costs, GPT_1B)
    balanced = flops(seq_len, n, config=GPT_1B)
    assert not model.hides_every_copy(balanced)  # the premise: the flops partition cannot hide its first copies
    lengths = AdaptivePartition(costs)(seq_len, n, 1, GPT_1B)
    assert sum(lengths) == seq_len and min(lengths) > 0
    assert lengths[0] < balanced[0]
    period = max(periods(model, lengths))
    assert period < max(periods(model, balanced))  # a shorter step than flops with full offload
    for s in lengths[:-1]:  # every full copy fits in the period (up to rounding to whole tokens)
        assert model.copy_s_per_token * s <= period * 1.001


@settings(max_examples=40, deadline=None)
@given(
    seq_len=st.integers(1, 5000),
    n=st.integers(1, 12),
    granularity=st.sampled_from([1, 4, 16, 128]),
    d2h=st.floats(1e8, 1e13),
)
def test_adaptive_lengths_are_valid(seq_len, n, granularity, d2h):
    if n > -(-seq_len // granularity):
        return
    config = parity_config()
    costs = measured_costs(config, 4096, 4, bytes_per_token=2e4, d2h=d2h, tflops=1)
    lengths = AdaptivePartition(costs)(seq_len, n, granularity, config)
    assert len(lengths) == n and sum(lengths) == seq_len and min(lengths) >= 1
    assert all(boundary % granularity == 0 for boundary in list(accumulate(lengths))[:-1])
