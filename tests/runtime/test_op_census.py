"""The engine issues the plain model's work and what its subsequences need, no more (``benchmarks/op_census.py``).

Every ATen op of one bf16-autocast training step (CPU), engine against the plain model: at N = 1 the same matmuls and
attention ops and at most one copy of V per layer besides; at N > 1 the same matmul FLOPs and extra bytes within what
the later subsequences' K/V reads and dK/dV sums cost. The negative control injects an fp32 round trip into the
attention path, which the budget must catch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.op_census import (
    Census,
    check_n,
    check_n1,
    compare,
    engine_step,
    n1_budget,
    plain_step,
    record,
    steady,
)
from lightning_sppo import GPT, GPTConfig
from lightning_sppo.attention import aten_ops
from lightning_sppo.runtime import SubsequenceEngine

SEQ_LEN = 1024

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    """tiny-gqa (GQA: V is a view of the fused qkv projection), 1024 tokens, and the plain model's census."""
    config = GPTConfig.from_name("tiny-gqa")
    torch.manual_seed(0)
    model = GPT(config)
    ids, targets = torch.randint(config.vocab_size, (2, 1, SEQ_LEN))
    plain_model = copy.deepcopy(model)
    plain = record(steady(plain_step(plain_model, ids, targets), plain_model))
    return config, model, ids, targets, plain


def _engine_census(setup, n: int):
    config, model, ids, targets, plain = setup
    engine, engine_model = SubsequenceEngine(n, "length"), copy.deepcopy(model)
    result = compare(plain, record(steady(engine_step(engine_model, ids, targets, engine), engine_model)))
    return result, list(engine.plan(ids, config).lengths)


def test_census_counts_bytes_and_flops_of_a_matmul():
    a, b = torch.randn(3, 5), torch.randn(5, 7, dtype=torch.float64)
    with Census() as census:
        torch.mm(a, b.float())
    cast, mm = census.records
    assert (cast.op, cast.kind, cast.nbytes) == ("aten._to_copy", "other", 35 * 8 + 35 * 4)
    assert (mm.op, mm.kind, mm.flops, mm.nbytes) == ("aten.mm", "matmul", 2 * 3 * 5 * 7, (15 + 35 + 21) * 4)
    assert mm.where == "model"


def test_engine_at_n1_issues_the_plain_models_work(setup):
    config = setup[0]
    result, _ = _engine_census(setup, 1)
    assert check_n1(result, config, 1, SEQ_LEN) == []
    # What the contract allows, exactly: one V copy per layer, nothing else in the attention path.
    path = result["other (attention path)"]["extra"]
    assert [(r["op"], r["count"]) for r in path] == [("aten.copy_", config.n_layer)]
    assert sum(r["bytes"] for r in path) == config.n_layer * n1_budget(config, 1, SEQ_LEN)
    assert {r["op"] for r in result["other (model)"]["extra"]} <= {"aten.ne", "aten.sum", "aten._to_copy",
                                                                   "aten.clamp", "aten.div", "aten.add"}  # fmt: skip


def test_negative_control_an_fp32_round_trip_in_the_attention_path_is_caught(setup, monkeypatch):
    config = setup[0]
    forward = aten_ops.CpuFlashOp.forward

    def upcast(self, q, k, v, causal, scale):
        out, lse = forward(self, q, k, v, causal, scale)
        return out.float().to(out.dtype), lse  # values unchanged: only the byte budget can see it

    monkeypatch.setattr(aten_ops.CpuFlashOp, "forward", upcast)
    result, _ = _engine_census(setup, 1)
    problems = check_n1(result, config, 1, SEQ_LEN)
    assert len(problems) == 1 and problems[0].startswith("other (attention path)") and "_to_copy" in problems[0]


@pytest.mark.parametrize("n", [2, 5])
def test_more_subsequences_cost_their_kv_reads_and_dkdv_sums(setup, n):
    model = setup[1]
    n1, _ = _engine_census(setup, 1)
    result, lengths = _engine_census(setup, n)
    assert len(lengths) == n and len(set(lengths)) == (1 if SEQ_LEN % n == 0 else 2)
    assert check_n(result, n1, model, 1, lengths) == []
    grown = result["bytes"]["attention"]["engine"] - n1["bytes"]["attention"]["engine"]
    assert grown > 0  # the prefix calls read the cached K/V: the budget is not vacuous
