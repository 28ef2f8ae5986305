"""Model FLOPs per token under both attention conventions, against the formulas written out."""

from __future__ import annotations

import pytest
import torch

from lightning_sppo import GPTConfig
from lightning_sppo.callbacks import peak_flops_per_second, training_flops_per_token


def _written_out(config: GPTConfig, seq_len: int, attention_factor: int) -> float:
    """6 x the matmul weights a token meets (blocks and head, not the embedding) + factor x L S H Dh."""
    d, dh = config.n_embd, config.head_size
    block = (
        d * (config.n_head + 2 * config.n_query_groups) * dh + config.n_head * dh * d + 3 * d * config.intermediate_size
    )
    weights = config.n_layer * block + config.vocab_size * d
    return 6 * weights + attention_factor * config.n_layer * seq_len * config.n_head * dh


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa", "gpt-7b"])
@pytest.mark.parametrize("seq_len", [128, 2**20])
def test_both_conventions_match_the_formulas(name, seq_len):
    config = GPTConfig.from_name(name)
    assert training_flops_per_token(config, seq_len) == pytest.approx(_written_out(config, seq_len, 6), rel=1e-12)
    full = training_flops_per_token(config, seq_len, "full")
    assert full == pytest.approx(_written_out(config, seq_len, 12), rel=1e-12)


def test_full_attention_reads_1_95x_at_a_million_tokens():
    config = GPTConfig.from_name("gpt-7b")
    ratio = training_flops_per_token(config, 2**20, "full") / training_flops_per_token(config, 2**20, "causal")
    assert ratio == pytest.approx(1.954, abs=1e-3)
    short = training_flops_per_token(config, 2048, "full") / training_flops_per_token(config, 2048, "causal")
    assert 1 < short < 1.05  # at short sequences the matmuls dominate and the conventions agree


def test_unknown_convention_names_the_setting():
    with pytest.raises(ValueError, match=r"attention must be one of \['causal', 'full'\], got attention='half'"):
        training_flops_per_token(GPTConfig.from_name("tiny"), 128, "half")


def test_no_peak_on_cpu():
    assert peak_flops_per_second(torch.device("cpu")) is None
