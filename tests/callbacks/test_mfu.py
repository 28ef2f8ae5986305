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


@pytest.mark.parametrize("attention", ["causal", "full"])
def test_packed_documents_count_attention_inside_each_document(attention):
    """One document per row is the sequence's count; documents of lengths n_d count the matmuls of every token but
    attention only over sum n_d^2 / 2 (causal) or sum n_d^2 (full) pairs, as the written-out formula says."""
    from lightning_sppo.callbacks.mfu import batch_training_flops

    config = GPTConfig.from_name("tiny-gqa")
    ids = torch.zeros(2, 96, dtype=torch.long)
    one_each = batch_training_flops(config, ids, torch.zeros(2, 96, dtype=torch.long), attention)
    assert one_each == pytest.approx(2 * 96 * training_flops_per_token(config, 96, attention), rel=1e-12)
    documents = torch.tensor([[0] * 32 + [1] * 64, [0] * 96])  # row 0: two documents; row 1: one
    factor = 6 if attention == "causal" else 12  # attention per token of an S-token sequence: factor L S H Dh
    matmul = 2 * 96 * _written_out(config, 96, 0)
    per_pair = factor * 2 * config.n_layer * config.n_head * config.head_size  # factor L S H Dh = per_pair S^2 / 2
    square = 32**2 + 64**2 + 96**2
    expected = matmul + per_pair * square / 2
    assert batch_training_flops(config, ids, documents, attention) == pytest.approx(expected, rel=1e-12)
    assert batch_training_flops(config, ids, documents, attention) < one_each
