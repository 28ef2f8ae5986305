"""The planner counts masked attention: packed documents of a mean length (``--document-length``)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_sppo.documents import Documents
from lightning_sppo.model import GPTConfig
from lightning_sppo.partition import flops, masked_flops, split_sequence
from lightning_sppo.planner import BUILTIN_PROFILES
from lightning_sppo.planner.cli import EXIT_USAGE, main
from lightning_sppo.planner.flops import attention_flops, attention_pairs
from lightning_sppo.planner.plan import PlanRequest
from lightning_sppo.planner.solver import solve


def test_pairs_inside_documents():
    assert attention_pairs(100, 300) == 100 * (300 + 50)  # one document: causal
    assert attention_pairs(100, 300, document_length=400) == attention_pairs(100, 300)  # the document holds it all
    # Documents of 10 from 0: tokens 300..399 are ten whole documents of 10 * 10 / 2 pairs (continuous count).
    assert attention_pairs(100, 300, document_length=10) == 10 * 50
    config = GPTConfig.from_name("gpt-7b")
    long, packed = attention_flops(config, 8192, 2**20 - 8192), attention_flops(config, 8192, 2**20 - 8192, 8192)
    assert packed < long / 100  # the last 8K of a 1M document against a whole 8K document


def test_regular_documents_cut_like_real_ones_of_that_length():
    """The planner's document_length partition is the real partition of a batch of such documents."""
    config = GPTConfig.from_name("tiny")
    document_ids = torch.arange(4096).div(256, rounding_mode="floor")[None]  # 16 documents of 256
    real = masked_flops(4096, 8, 128, config=config, documents=Documents.from_ids(document_ids))
    assert real == masked_flops(4096, 8, 128, config=config, document_length=256)
    assert real == split_sequence(4096, 8, "flops", granularity=128, config=config, document_length=256)
    assert len(set(real)) == 1  # every subsequence holds the same documents: equal lengths
    # One document as long as the sequence: early subsequences long, as the causal (Seq1F1B-style) count has them.
    whole = masked_flops(4096, 8, 128, config=config, document_length=4096)
    assert whole == sorted(whole, reverse=True) and whole[0] > 2 * whole[-1]
    assert abs(whole[0] - flops(4096, 8, 128, config=config)[0]) <= 1024


@pytest.mark.slow
def test_packed_short_documents_plan_far_cheaper_than_one_long_document():
    base = dict(config=GPTConfig.from_name("gpt-1b"), seq_len=2**18, nodes=1, profile=BUILTIN_PROFILES["h100"])
    one = solve(PlanRequest(**base))
    packed = solve(PlanRequest(**base, document_length=8192))
    assert packed.document_length == 8192 and one.document_length is None
    assert packed.step_time_s < one.step_time_s / 2, (packed.step_time_s, one.step_time_s)


def test_cli_flag(capsys):
    argv = ["--model", "gpt-1b", "--seq-len", "128K", "--gpu", "h100", "--json", "--document-length", "8K"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["document_length"] == 8192
    assert main(argv[:-1] + ["0"]) == EXIT_USAGE
    assert "--document-length" in capsys.readouterr().err


def test_bad_document_length_names_the_flag():
    with pytest.raises(ValueError, match="--document-length must be a positive number"):
        PlanRequest(
            config=GPTConfig.from_name("gpt-1b"), seq_len=4096, nodes=1, profile=BUILTIN_PROFILES["h100"],
            document_length=0,
        )  # fmt: skip
