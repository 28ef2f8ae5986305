import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_sppo import GPTConfig
from lightning_sppo.partition import (
    auto_num_subsequences,
    flops,
    length,
    register_partition_policy,
    spans,
    split_sequence,
)


def _segment_flops(lengths, P, L, d):
    prefix, out = 0, []
    for n in lengths:
        prefix += n
        out.append(2 * n * P + 2 * L * n * prefix * d)
    return out


def _check_basic(lengths, S, N, g):
    assert len(lengths) == N and sum(lengths) == S and min(lengths) >= 1
    assert all(off % g == 0 for off, _ in spans(lengths))  # every boundary on a granule
    assert all(n % g == 0 for n in lengths[:-1])


@given(S=st.integers(1, 100_000), N=st.integers(1, 64), g=st.sampled_from([1, 2, 8, 128]))
def test_length_partition_properties(S, N, g):
    if N > -(-S // g):
        with pytest.raises(ValueError, match="num_subsequences"):
            length(S, N, g)
        return
    lengths = length(S, N, g)
    _check_basic(lengths, S, N, g)
    assert max(lengths[:-1] or lengths) - min(lengths[:-1] or lengths) <= g  # equal up to one granule


@given(
    S=st.integers(1, 2_000_000),
    N=st.integers(1, 32),
    g=st.sampled_from([1, 4, 256]),
    P=st.integers(1_000, 10**10),
    L=st.integers(1, 96),
    d=st.sampled_from([64, 1024, 8192]),
)
def test_flops_partition_properties(S, N, g, P, L, d):
    if N > -(-S // g):
        return
    lengths = flops(S, N, g, num_params=P, n_layer=L, n_embd=d)
    _check_basic(lengths, S, N, g)
    assert all(a >= b for a, b in zip(lengths, lengths[1:], strict=False)), lengths  # non-increasing


def test_flops_partition_balances_flops_better_than_equal_lengths():
    P, L, d = 6_500_000_000, 32, 4096
    S, N = 1 << 20, 8
    balanced = _segment_flops(flops(S, N, 1024, num_params=P, n_layer=L, n_embd=d), P, L, d)
    equal = _segment_flops(length(S, N, 1024), P, L, d)
    assert max(balanced) / min(balanced) < 1.05  # equal up to granule rounding
    assert max(equal) / min(equal) > 3  # the attention term makes late segments expensive


def test_flops_partition_is_equal_lengths_when_attention_is_negligible():
    assert flops(1000, 4, num_params=10**12, n_layer=1, n_embd=1) == [250, 250, 250, 250]


def test_split_sequence_errors_name_the_setting():
    config = GPTConfig.from_name("tiny")
    with pytest.raises(ValueError, match="num_subsequences=11.*at most 10"):
        split_sequence(10, 11)
    with pytest.raises(ValueError, match="num_subsequences=0"):
        split_sequence(10, 0)
    with pytest.raises(ValueError, match="Unknown partition='lenght'"):
        split_sequence(10, 2, "lenght")
    # Without measured costs the adaptive policy (filled by lightning_sppo.offload) is the flops partition.
    assert split_sequence(45, 3, "adaptive", config=config) == flops(45, 3, config=config)
    with pytest.raises(ValueError, match="GPTConfig"):
        split_sequence(10, 2, "flops")


def test_adaptive_hook_can_be_filled(monkeypatch):
    from lightning_sppo import partition

    monkeypatch.setitem(partition.PARTITION_POLICIES, "adaptive", partition.PARTITION_POLICIES["adaptive"])
    register_partition_policy("adaptive", lambda S, N, g, config: [S - N + 1] + [1] * (N - 1))
    assert split_sequence(10, 3, "adaptive") == [8, 1, 1]
    register_partition_policy("adaptive", lambda S, N, g, config: [S])
    with pytest.raises(RuntimeError, match="invalid lengths"):
        split_sequence(10, 3, "adaptive")


def test_flops_from_config_equals_explicit_sizes():
    config = GPTConfig.from_name("gpt-7b")
    P = config.num_parameters() - config.vocab_size * config.n_embd
    explicit = flops(1 << 20, 8, 1024, num_params=P, n_layer=32, n_embd=4096)
    assert flops(1 << 20, 8, 1024, config=config) == explicit
    assert split_sequence(1 << 20, 8, "flops", granularity=1024, config=config) == explicit


def test_auto_num_subsequences():
    assert auto_num_subsequences(100) == 1
    assert auto_num_subsequences(1 << 20) == 256
    assert auto_num_subsequences(1 << 20, tokens_per_subsequence=16384) == 64
