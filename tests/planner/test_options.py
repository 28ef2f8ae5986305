"""Recompute, K/V spilled to host and model state on host, as the planner charges them (``planner.options``).

Each charge is checked against its definition: what full and selective recompute keep per token, the exact share
of level 1 a spill moves to host, the 16 bytes per parameter model state on host moves there; and the solver's
use of them: cheapest first, pinned when the request pins them, every printed plan within both limits.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.planner import BUILTIN_PROFILES, CostModel, Layout, PlanRequest, precision_bytes, solve
from lightning_sppo.planner.activations import (
    layer_saved_bytes_per_token,
    recompute_transient_bytes_per_token,
    stage_saved_bytes_per_token,
)
from lightning_sppo.planner.evaluate import Limits, evaluate
from lightning_sppo.planner.layout import StageSpec, placement, stage_specs
from lightning_sppo.planner.memory import (
    host_state_bytes,
    kv_spill_bytes,
    level1_bytes,
    model_state_bytes,
    stage_parameter_counts,
)
from lightning_sppo.planner.options import MODEL_STATE_ORDER, RECOMPUTE_ORDER
from lightning_sppo.planner.profile import host_share_per_gpu, resolve_profile
from lightning_sppo.planner.solver import cost_model
from tests.planner.conftest import UNLIMITED, small_gpu

LLAMA = GPTConfig.from_name("llama-3.1-8b")
STAGE = StageSpec(0, 4, first=False, last=False)


def test_setting_names_match_the_strategy():
    from lightning_sppo.recompute import RECOMPUTE_MODES
    from lightning_sppo.strategy.config import MODEL_STATE_PLACES

    assert RECOMPUTE_ORDER == RECOMPUTE_MODES and MODEL_STATE_ORDER == MODEL_STATE_PLACES


@pytest.mark.parametrize("sharded", [False, True])
def test_full_recompute_keeps_the_block_input_only(sharded):
    dtypes = precision_bytes("bf16-mixed", sharded)
    d, h, dh = LLAMA.n_embd, LLAMA.n_head, LLAMA.head_size
    assert layer_saved_bytes_per_token(LLAMA, dtypes, 2, "full") == dtypes.residual * d
    selective = layer_saved_bytes_per_token(LLAMA, dtypes, 2, "selective")
    assert selective == dtypes.residual * d + dtypes.compute * h * dh + 4 * h  # + attention output and fp32 LSE
    none = layer_saved_bytes_per_token(LLAMA, dtypes, 2)
    assert none > 7 * selective  # an 8B block keeps ~180-200 KB per token without recompute
    # Per stage: the layers' kept bytes plus the fp32 cos/sin tables, shared by every recomputed block.
    per_stage = stage_saved_bytes_per_token(LLAMA, dtypes, 4, last=False, sp=2, recompute="full")
    assert per_stage == 4 * dtypes.residual * d + 2 * 4 * LLAMA.rope_n_elem


def test_recompute_transient_is_one_layer_of_what_is_recomputed():
    dtypes = precision_bytes("bf16-mixed", True)
    none = layer_saved_bytes_per_token(LLAMA, dtypes, 1)
    kept_attention = dtypes.compute * LLAMA.n_head * LLAMA.head_size + 4 * LLAMA.n_head
    assert recompute_transient_bytes_per_token(LLAMA, dtypes, 1, "none") == 0
    assert recompute_transient_bytes_per_token(LLAMA, dtypes, 1, "full") == none
    assert recompute_transient_bytes_per_token(LLAMA, dtypes, 1, "selective") == none - kept_attention


@pytest.mark.parametrize("device_tokens", [0, 1000, 65536, 131071])
def test_spill_moves_exactly_the_tokens_past_r_to_host(device_tokens):
    dtypes, seq_len, chunk = precision_bytes("bf16-mixed", True), 131072, 16384
    kv, grad = level1_bytes(LLAMA, dtypes, STAGE, seq_len, 2)
    whole = kv + grad
    on_device_kv, on_device_grad, in_flight, host = kv_spill_bytes(
        LLAMA, dtypes, STAGE, seq_len, 2, 1, device_tokens, chunk
    )
    assert on_device_kv + on_device_grad + host == whole
    assert host * seq_len == whole * (seq_len - device_tokens)  # (S - R) / S of level 1, to the byte
    assert on_device_kv * seq_len == kv * device_tokens
    kv_token, grad_token = kv // (STAGE.layers * seq_len), grad // (STAGE.layers * seq_len)
    chunk_tokens = min(chunk, seq_len - device_tokens)  # two chunks of K/V and three of dK/dV (memory.py)
    assert in_flight == chunk_tokens * (2 * kv_token + 3 * grad_token)
    assert kv_spill_bytes(LLAMA, dtypes, STAGE, seq_len, 2, 1, None, chunk) == (kv, grad, 0, 0)


@pytest.mark.parametrize("sync", ["step", "reduce", "regather"])
def test_model_state_on_host_moves_16_bytes_per_parameter(sync):
    stage = StageSpec(0, 32, first=True, last=True)
    params = stage_parameter_counts(LLAMA, stage)
    dtypes = precision_bytes("bf16-mixed", True)
    assert host_state_bytes(params, 8) == 16 * params.total // 8
    weights, grads, optimizer = model_state_bytes(params, dtypes, 8, sync, host=True)
    on_device = model_state_bytes(params, dtypes, 8, sync)
    assert optimizer == 0 and weights == on_device[0] - dtypes.master * params.total // 8  # no master shard
    assert grads <= on_device[1]


def test_an_evaluation_with_model_state_on_host_keeps_it_there():
    config = GPTConfig.from_name("tiny-gqa")
    layout = Layout(1, 1, 1)
    costs = CostModel(config, precision_bytes("fp32", True), UNLIMITED, model_state="host")
    stages = stage_specs(config, 1)
    limits = Limits(UNLIMITED.hbm_bytes, UNLIMITED.host_bytes_per_gpu)
    e = evaluate(costs, layout, placement(layout, 8), stages, [256, 256], limits, sync="regather")
    params = stage_parameter_counts(config, stages[0]).total
    assert e.model_state == "host" and e.stages[0].memory.host_state == 16 * params
    assert e.stages[0].memory.optimizer == 0 and e.peak_host_bytes == 16 * params
    assert e.optimizer_s == pytest.approx(28 * params / UNLIMITED.host_optimizer_bytes_per_s)


def test_spill_copies_are_exposed_only_beyond_the_attention():
    costs = CostModel(LLAMA, precision_bytes("bf16-mixed", True), BUILTIN_PROFILES["h100"])
    stage = StageSpec(0, 32, first=True, last=True)
    # A long prefix: far more attention than copy, nothing exposed.
    assert costs.spill_seconds(stage, 16384, 1 << 20, 8, 0) == (0.0, 0.0)
    # All on the device: nothing to copy.
    assert costs.spill_seconds(stage, 16384, 1 << 20, 8, 2 << 20) == (0.0, 0.0)
    slow = replace(costs, profile=replace(costs.profile, h2d_gbps=0.01, d2h_gbps=0.01))
    forward, backward = slow.spill_seconds(stage, 1024, 1 << 20, 8, 0)
    assert forward > 0 and backward > forward


def test_recompute_costs_its_forward_again():
    h100 = BUILTIN_PROFILES["h100"]
    dtypes = precision_bytes("bf16-mixed", True)
    passes = {
        mode: CostModel(LLAMA, dtypes, h100, recompute=mode).backward(
            STAGE, 16384, 65536, 2, sp_cross=False, send_cross=None
        )
        for mode in RECOMPUTE_ORDER
    }
    forward = CostModel(LLAMA, dtypes, h100).forward(STAGE, 16384, 65536, 2, sp_cross=False, send_cross=None)
    # Device-bound here: full recompute adds about the forward's device work (its GEMMs, attention and bytes; the
    # census counts the recomputed pass's bytes and ops as the code runs them, not as a copy of the forward's).
    assert passes["full"].device > passes["full"].host
    assert passes["full"].compute == pytest.approx(passes["none"].compute + forward.compute, rel=0.03)
    assert passes["none"].compute < passes["selective"].compute < passes["full"].compute
    assert passes["selective"].all_to_all == passes["full"].all_to_all == 2 * passes["none"].all_to_all


def _request(**overrides) -> PlanRequest:
    base = dict(config=LLAMA, seq_len=65536, nodes=1, profile=BUILTIN_PROFILES["h100"], sp=8, pp=1,
                schedule=("seq1f1b",))  # fmt: skip
    return PlanRequest(**(base | overrides))


def test_cheapest_first_and_pins():
    """What fits without recompute, spill or host model state gets none; a pinned choice is the one planned."""
    plan = solve(_request())
    assert (plan.recompute, plan.kv_device_tokens, plan.model_state) == ("none", None, "device")
    pinned = solve(_request(recompute=("full",), model_state=("host",), kv_device_tokens=16384))
    assert (pinned.recompute, pinned.kv_device_tokens, pinned.model_state) == ("full", 16384, "host")
    assert pinned.memory.host_kv > 0 and pinned.memory.host_state > 0


@pytest.mark.parametrize(("seq_len", "most"), [(65536, 0.15), (262144, 0.06)])
def test_selective_recompute_costs_at_most_15_percent(seq_len, most):
    """The issue's bound, by the planner's step-time model, where both fit (8 x H100): 13.6% at 64K, 4.8% at 256K
    (the recomputed matmuls are a fixed share of the step, attention's share grows with the length)."""
    config = replace(LLAMA, block_size=max(LLAMA.block_size, seq_len))
    none = solve(_request(config=config, seq_len=seq_len, recompute=("none",)))
    same = dict(fsdp_sync=(none.fsdp_sync,), offload=(none.offload,))
    selective = solve(_request(config=config, seq_len=seq_len, recompute=("selective",), **same))
    full = solve(_request(config=config, seq_len=seq_len, recompute=("full",), **same))
    overhead = selective.step_time_s / none.step_time_s - 1
    assert 0 < overhead <= most, overhead
    assert full.step_time_s > selective.step_time_s


def test_what_does_not_fit_plainly_is_planned_with_recompute_spill_or_host_state():
    """llama-3.1-8b on one H100: model state alone is over the device (the issue's first row)."""
    request = _request(seq_len=32768, sp=None, profile=resolve_profile("h100", 1))
    plan = solve(request)
    assert plan.model_state == "host"
    _assert_fits(plan)
    with pytest.raises(ValueError, match="too few GPUs"):
        solve(replace(request, model_state=("device",)))


def _assert_fits(plan) -> None:
    assert plan.peak_gpu_bytes <= plan.gpu_bytes
    memory = plan.memory
    assert memory.resident_bytes + memory.transient + memory.allocator_slack + memory.reserved == plan.peak_gpu_bytes
    assert plan.peak_host_bytes <= plan.host_limit_bytes
    assert plan.memory.host_bytes <= plan.host_limit_bytes


def test_host_memory_is_per_node_and_shared_by_its_gpus():
    one, eight = resolve_profile("h100", 1), resolve_profile("h100", 8)
    assert one.host_bytes_per_gpu == host_share_per_gpu(2 * 2**40, 1) == 2 * 2**40 * 7 // 8
    assert eight.host_bytes_per_gpu == one.host_bytes_per_gpu // 8
    assert resolve_profile("h100", 8, 2**40).host_bytes_per_gpu == eight.host_bytes_per_gpu // 2


def test_cost_model_shards_a_single_gpu_with_model_state_on_host():
    request = _request(sp=1, profile=resolve_profile("h100", 1))
    assert not cost_model(request, Layout(1, 1, 1)).dtypes.sharded
    assert cost_model(request, Layout(1, 1, 1), model_state="host").dtypes.sharded


def test_a_small_gpu_spills_the_k_v_it_cannot_hold():
    config = GPTConfig.from_name("tiny-gqa")
    request = PlanRequest(config=replace(config, block_size=1 << 22), seq_len=1 << 22, nodes=1,
                          profile=replace(small_gpu(1.0, 64.0), gpus_per_node=1), recompute=("none",),
                          model_state=("device",))  # fmt: skip
    plan = solve(request)
    assert plan.kv_device_tokens is not None and 0 <= plan.kv_device_tokens < plan.seq_len
    assert plan.memory.host_kv > 0
    _assert_fits(plan)
    with pytest.raises(ValueError):
        solve(replace(request, kv_device_tokens=None))


def test_the_run_plans_its_own_recompute_spill_and_model_state():
    """``strategy/autoplan.py`` pins the run's settings: the planner plans what the run holds, it does not choose."""
    from lightning_sppo.strategy.autoplan import _request as run_request
    from lightning_sppo.strategy.config import SPPOConfig

    settings = SPPOConfig(recompute="full", kv_device_tokens=8192, kv_chunk_tokens=4096, model_state="host")
    profile = BUILTIN_PROFILES["h100"]
    request = run_request(settings, LLAMA, 65536, 8, 8, "bf16-mixed", profile)
    assert (request.recompute, request.kv_device_tokens, request.kv_chunk_tokens, request.model_state) == (
        ("full",),
        8192,
        4096,
        ("host",),
    )
    default = run_request(SPPOConfig(), LLAMA, 65536, 8, 8, "bf16-mixed", profile)
    assert (default.recompute, default.kv_device_tokens, default.model_state) == (("none",), None, ("device",))
