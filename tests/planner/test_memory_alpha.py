"""Model state, level 1 and the offload decision of one stage."""

from __future__ import annotations

from itertools import pairwise

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.planner import CostModel, StageSpec, precision_bytes
from lightning_sppo.planner.alpha import plan_offload
from lightning_sppo.planner.memory import (
    StageParameters,
    level1_bytes,
    level2_bytes,
    model_state_bytes,
    stage_parameter_counts,
)

P = 8 * 10**6
"""A stage of eight blocks of P / 8 parameters each and no embedding or head (a middle stage)."""


@pytest.mark.parametrize(
    ("precision", "shards", "sync", "expected"),
    [
        ("fp32", 1, "step", (4, 4, 8)),  # parameters are master and working copy; no FSDP shard
        ("bf16-mixed", 1, "step", (4 + 2, 4, 8)),  # plus autocast's bf16 copies
        # FSDP2 mixed precision: fp32 master shards + bf16 gathered weights; fp32 unsharded gradients, plus
        # in flight a block's bf16 gradients (2 / 8)
        ("bf16-mixed", 8, "step", (0.5 + 2, 4 + 0.25, 1)),
        # gradients reduce-scattered every backward: sharded, plus one block's fp32 reduce-scatter input (4 / 8)
        ("bf16-mixed", 8, "reduce", (0.5 + 2, 0.5 + 0.75, 1)),
        ("bf16-mixed", 8, "regather", (0.5 + 2 * 2 / 8, 0.5 + 0.75, 1)),  # two blocks gathered at a time
        ("fp32", 8, "step", (0.5 + 4, 4, 1)),  # fp32 gradients accumulate in place
    ],
)
def test_model_state_bytes_per_parameter(precision, shards, sync, expected):
    params = StageParameters(total=P, root=0, block=P // 8, cast=P)
    dtypes = precision_bytes(precision, sharded=shards > 1)
    assert model_state_bytes(params, dtypes, shards, sync) == tuple(round(x * P) for x in expected)


def test_stage_parameter_counts_split_root_and_blocks():
    config = GPTConfig.from_name("tiny")
    first = stage_parameter_counts(config, StageSpec(0, 1, first=True, last=False))
    assert first.root == config.vocab_size * config.n_embd and first.total == first.root + first.block


def test_level1_is_the_whole_sequence_head_sharded():
    config = GPTConfig.from_name("gpt-7b")
    stage = StageSpec(0, 8, first=True, last=False)
    kv, grad = level1_bytes(config, precision_bytes("bf16-mixed"), stage, 2**20, sp=8)
    assert kv == 8 * 2 * (32 // 8) * 128 * 2**20 * 2  # K and V, bf16
    assert grad == 2 * kv  # fp32 dK/dV
    _, lossy = level1_bytes(config, precision_bytes("bf16-mixed", kv_grad_dtype="bf16"), stage, 2**20, sp=8)
    assert lossy == kv  # kv_grad_dtype="bf16": dK/dV in bf16, like K/V


def test_kv_grad_dtype_changes_only_the_accumulators():
    for precision in ("bf16-mixed", "fp32"):
        for sharded in (False, True):
            exact, lossy = (precision_bytes(precision, sharded, kv_grad_dtype=d) for d in ("fp32", "bf16"))
            assert (exact.accumulation, lossy.accumulation) == (4, 2)
            assert (exact.kv_grad_dtype, lossy.kv_grad_dtype) == ("fp32", "bf16")
            assert lossy.__class__(**(lossy.__dict__ | {"accumulation": 4})) == exact
    with pytest.raises(ValueError, match=r"--kv-grad-dtype='fp16'"):
        precision_bytes("fp32", kv_grad_dtype="fp16")


def _stage_plan(policy: str, a100, d2h_gbps: float | None = None):
    config = GPTConfig.from_name("gpt-7b")
    profile = a100 if d2h_gbps is None else type(a100)(**(a100.to_dict() | {"d2h_gbps": d2h_gbps}))
    costs = CostModel(config, precision_bytes("bf16-mixed"), profile)
    stage = StageSpec(1, 8, first=False, last=False)
    lengths = [32768, 24576, 16384, 16384, 8192, 8192, 8192, 4096]
    level2 = level2_bytes(config, costs.dtypes, stage, lengths, sp=8)
    forward = [0.2] * len(lengths)
    return level2, plan_offload(policy, level2, forward, [2 * t for t in forward], costs)


def test_adaptive_alpha_follows_the_paper(a100):
    level2, plan = _stage_plan("adaptive", a100, d2h_gbps=10.0)
    alpha = plan.alpha
    assert all(0.0 <= a <= 1.0 for a in alpha) and alpha[-1] == 0.0
    assert all(x >= y for x, y in pairwise(alpha))  # non-increasing
    threshold = 10e9 * 0.2  # M_threshold = BW_D2H * T_balanced_comp
    assert alpha[0] * level2[0] == pytest.approx(threshold, rel=1e-9)
    assert plan.forward_wait == (0.0,) * len(level2)  # every copy hides behind the next forward
    assert plan.host_bytes == pytest.approx(sum(a * b for a, b in zip(alpha, level2, strict=True)), abs=len(level2))


def test_offloading_lowers_the_device_peak(a100):
    level2, none = _stage_plan("none", a100)
    _, adaptive = _stage_plan("adaptive", a100)
    _, full = _stage_plan("full", a100)
    assert none.device_peak == sum(level2) and none.host_bytes == 0
    assert full.device_peak <= adaptive.device_peak < none.device_peak
    assert full.device_peak == max(a + b for a, b in pairwise(level2))  # i-1 still copying while i runs
