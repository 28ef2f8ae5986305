"""FLOP counts and times: the causal count, the split over SP, and where communication is charged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.parallel.stages import split_stage
from lightning_sppo.partition import flops as flops_partition
from lightning_sppo.partition import spans
from lightning_sppo.planner import CostModel, StageSpec, precision_bytes, stage_specs
from lightning_sppo.planner.flops import attention_flops, block_matmul_params, sequence_model_flops
from lightning_sppo.planner.memory import stage_parameters
from lightning_sppo.planner.solver import FIXED_SHARE, shortest_tokens


def test_causal_attention_is_counted_once_whatever_the_cut():
    """Sum over subsequences of 4 n (c + n/2) H Dh equals the whole sequence's 4 S^2/2 H Dh."""
    config = GPTConfig.from_name("gpt-7b")
    lengths = flops_partition(2**20, 37, 128, config=config)
    total = sum(attention_flops(config, n, c) for c, n in spans(lengths))
    assert total == pytest.approx(attention_flops(config, 2**20, 0), rel=1e-12)
    assert attention_flops(config, 2**20, 0) == pytest.approx(2 * 2**40 * 4096)


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa", "tiny-gelu"])
def test_block_matmul_params_are_the_linear_weights(name):
    config = GPTConfig.from_name(name)
    block = GPT(config).blocks["0"]
    weights = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    assert block_matmul_params(config) == weights


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa", "tiny-gelu"])
@pytest.mark.parametrize("pp", [1, 2])
def test_stage_parameters_match_split_stage(name, pp):
    config = GPTConfig.from_name(name)
    for spec in stage_specs(config, pp):
        stage = split_stage(GPT(config), spec.index, [s.layers for s in stage_specs(config, pp)])
        assert stage_parameters(config, spec) == sum(p.numel() for p in stage.parameters())


def test_model_flops_is_three_forwards(a100):
    config = GPTConfig.from_name("gpt-7b")
    forward = 32 * (2 * 2**19 * block_matmul_params(config) + attention_flops(config, 2**19, 0))
    forward += 2 * 2**19 * 32000 * 4096
    assert sequence_model_flops(config, [2**18, 2**18]) == pytest.approx(3 * forward, rel=1e-12)


def test_times_split_over_sp_and_charge_communication(a100):
    config = GPTConfig.from_name("gpt-7b")
    costs = CostModel(config, precision_bytes("bf16-mixed"), _legacy(a100))
    middle = StageSpec(1, 8, first=False, last=False)
    one = costs.forward(middle, 8192, 2**19, 1, sp_cross=False, send_cross=False)
    eight = costs.forward(middle, 8192, 2**19, 8, sp_cross=False, send_cross=False)
    overhead = 8 * costs.layer_fixed_s
    assert (one.compute - overhead) == pytest.approx(8 * (eight.compute - overhead))
    assert one.all_to_all == 0 and eight.all_to_all > 0
    across = costs.forward(middle, 8192, 2**19, 8, sp_cross=False, send_cross=True)
    assert across.p2p == pytest.approx(eight.p2p * a100.intra_node_gbps / a100.inter_node_gbps)
    last = StageSpec(3, 8, first=False, last=True)
    assert costs.forward(last, 8192, 0, 8, sp_cross=False, send_cross=None).p2p == 0
    backward = costs.backward(middle, 8192, 2**19, 8, sp_cross=False, send_cross=False)
    assert 2 < (backward.compute - 2 * overhead) / (eight.compute - overhead) < 2.5
    kernels = CostModel(config, precision_bytes("bf16-mixed"), a100)  # 1024 tokens and 4 heads per rank run slower
    split = kernels.forward(middle, 8192, 2**19, 8, sp_cross=False, send_cross=False).compute
    whole = kernels.forward(middle, 8192, 2**19, 1, sp_cross=False, send_cross=False).compute
    assert whole / 8 < split < whole / 4


def test_fsdp_sync_only_with_shards(a100):
    costs = CostModel(GPTConfig.from_name("gpt-7b"), precision_bytes("bf16-mixed", sharded=True), a100)
    assert costs.fsdp_gather(10**9, 1, False) == costs.fsdp_reduce(10**9, 1, False) == 0
    assert costs.fsdp_gather(10**9, 8, True) > costs.fsdp_gather(10**9, 8, False) > 0
    # bf16 gathers (2 bytes per parameter) and fp32 reduce-scatters (4), each moving 7/8 of the whole.
    assert costs.fsdp_gather(10**9, 8, False) == pytest.approx(2e9 * 7 / 8 / (a100.intra_node_gbps * 1e9))
    assert costs.fsdp_reduce(10**9, 8, False) == pytest.approx(2 * costs.fsdp_gather(10**9, 8, False))


def test_fsdp_sync_modes_put_communication_in_the_passes(a100):
    """ "step" gathers in the first forward and reduces in the last backward (subsequence 0's), "reduce" reduces
    in every backward, "regather" also gathers in every pass."""
    costs = CostModel(GPTConfig.from_name("gpt-7b"), precision_bytes("bf16-mixed", sharded=True), a100)
    g, r = costs.fsdp_gather(10**9, 8, False), costs.fsdp_reduce(10**9, 8, False)
    expected = {  # (forward, backward) of a later subsequence, then of subsequence 0
        "step": [(0, 0), (g, r)],
        "reduce": [(0, r), (g, r)],
        "regather": [(g, g + r), (g, g + r)],
    }
    for sync, passes in expected.items():
        for first, (forward, backward) in zip((False, True), passes, strict=True):
            comm = [costs.fsdp_pass_comm(10**9, 8, False, sync, backward=b, first=first) for b in (False, True)]
            assert comm == [pytest.approx(forward), pytest.approx(backward)], (sync, first)


def test_per_subsequence_sync_is_charged_in_the_step_time(a100):
    """The same layout is slower with "regather" than with "step" (communication it cannot hide)."""
    from lightning_sppo.planner import PlanRequest, solve

    times = {}
    for sync in ("step", "regather"):
        request = PlanRequest(config=GPTConfig.from_name("gpt-1b"), seq_len=2**15, nodes=1, profile=a100,
                              sp=4, pp=1, fsdp_sync=(sync,), offload=("none",), partition=("length",))  # fmt: skip
        plan = solve(request)
        assert plan.fsdp_sync == sync
        times[sync] = (plan.num_subsequences, plan.step_time_s, plan.time.sync)
    assert times["regather"][0] == times["step"][0]  # same N: the difference is the FSDP traffic
    assert times["regather"][1] > times["step"][1] and times["regather"][2] > times["step"][2]


@pytest.mark.parametrize(
    "switches", [dict(tie_embeddings=True), dict(attn_bias=True), dict(norm_qk=True)], ids=lambda s: next(iter(s))
)
@pytest.mark.parametrize("pp", [1, 2])
def test_stage_parameters_count_bias_qk_norm_and_tied_copies(switches, pp):
    """A tied head is one parameter with the embedding on a single stage, a copy of its own on the last one."""
    config = GPTConfig.from_name("tiny-gqa", **switches)
    for spec in stage_specs(config, pp):
        stage = split_stage(GPT(config), spec.index, [s.layers for s in stage_specs(config, pp)])
        assert stage_parameters(config, spec) == sum(p.numel() for p in stage.parameters())


def _legacy(profile):
    """A profile without the kernel terms: FLOPs at ``mfu``, ``layer_overhead_s`` and the weights' read per pass."""
    return replace(
        profile, gemm_tile=0.0, elementwise_gbps=0.0, kernel_s=0.0, host_op_s=0.0, sms=0, layer_overhead_s=1e-4
    )


def test_without_kernel_terms_a_pass_pays_the_read_of_its_weights_from_hbm(a100):
    """The legacy fixed cost of a layer pass: the overhead plus the block's bf16 weights read once, whatever its length;
    the search's shortest subsequence is where that reaches FIXED_SHARE of the matmuls (negative control: no HBM rate)."""
    config = GPTConfig.from_name("gpt-65b")
    legacy = _legacy(a100)
    costs = CostModel(config, precision_bytes("bf16-mixed"), legacy)
    read = 2 * block_matmul_params(config) / (a100.hbm_gbps * 1e9)
    assert costs.layer_fixed_s == pytest.approx(legacy.layer_overhead_s + read)
    middle = StageSpec(1, 5, first=False, last=False)
    short = costs.forward(middle, 512, 0, 1, sp_cross=False, send_cross=False).compute
    blind = CostModel(config, precision_bytes("bf16-mixed"), replace(legacy, hbm_gbps=0.0))
    assert short - blind.forward(middle, 512, 0, 1, sp_cross=False, send_cross=False).compute == pytest.approx(5 * read)
    tokens = shortest_tokens(costs)
    matmul = 2 * tokens * block_matmul_params(config) / legacy.flops_per_s
    assert costs.layer_fixed_s == pytest.approx(FIXED_SHARE * matmul, rel=0.01)
    assert 256 < tokens < 1024
    assert shortest_tokens(blind) < tokens


def test_a_pass_is_the_longer_of_its_device_and_host_work(a100):
    """Short passes are bound by the host's ops (census x host_op_s), long ones by the device; the fixed cost per
    pass is what the census counts (ops, weight-gradient bytes), not the legacy overhead."""
    config = GPTConfig.from_name("gpt-1b")
    costs = CostModel(config, precision_bytes("bf16-mixed"), a100)
    short, long = costs.layer_forward(256, 0), costs.layer_forward(16384, 0)
    assert short[1] > short[0] and long[0] > long[1]  # (device, host)
    assert (
        short[1] == pytest.approx(long[1]) == pytest.approx(costs.census.engine["none"]["forward"].ops * a100.host_op_s)
    )
    slow_host = CostModel(config, precision_bytes("bf16-mixed"), replace(a100, host_op_s=2 * a100.host_op_s))
    middle = StageSpec(1, 4, first=False, last=False)
    times = [c.forward(middle, 256, 0, 1, sp_cross=False, send_cross=False).compute for c in (costs, slow_host)]
    assert times[1] == pytest.approx(2 * times[0], rel=0.01)  # host-bound: twice the host cost, twice the time
    assert costs.layer_fixed_s > a100.layer_overhead_s == 0.0
