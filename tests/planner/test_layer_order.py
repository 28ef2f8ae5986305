"""The layer order in the planner: where it is planned (every layout of one stage), what its time is made of, what it
wins, and that its plan runs as planned."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.planner import BUILTIN_PROFILES, NoFeasiblePlan, PlanRequest, layer_order, resolve_profile, solve
from lightning_sppo.planner.flops import sequence_model_flops
from lightning_sppo.planner.layer_order import LayerOrderSetup, kv_peak_bytes, layer_order_memory
from lightning_sppo.planner.layer_plan import best_layer_order, layer_layouts, layer_order_refusal, layer_order_step
from lightning_sppo.planner.layer_time import GAP_TERMS
from lightning_sppo.planner.layout import Layout, StageSpec, candidate_layouts
from lightning_sppo.planner.longest import longest_sequence
from lightning_sppo.planner.memory import stage_parameter_counts
from lightning_sppo.planner.precision import precision_bytes
from lightning_sppo.planner.solver import cost_model, fits, granularity
from lightning_sppo.strategy.autoplan import plan_settings
from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.core import SPPOCore
from tests.conftest import make_batch
from tests.planner.conftest import small_gpu

H100 = replace(BUILTIN_PROFILES["h100"], gpus_per_node=1)
K = 1024


def _request(seq_len: int, profile=H100, model: str = "gpt-1b", **options) -> PlanRequest:
    config = GPTConfig.from_name(model)
    config = replace(config, block_size=max(config.block_size, seq_len))
    return PlanRequest(config=config, seq_len=seq_len, nodes=1, profile=profile, **options)


def _best(request: PlanRequest):
    return best_layer_order(
        request, lambda layout, r, state: cost_model(request, layout, r, state), lambda sp: granularity(request, sp)
    )


def _step(request: PlanRequest, layout: Layout, spans, recompute="selective", offload="none", state="device",
          device_tokens=None, chunk=16384, **where):  # fmt: skip
    costs = cost_model(request, layout, recompute, state)
    setup = LayerOrderSetup(recompute, offload, device_tokens, chunk, 1, layout, **where)
    return costs, setup, layer_order_step(costs, spans, setup)


def _spans(seq_len: int, n: int) -> list[tuple[int, int]]:
    return [(i * seq_len // n, seq_len // n) for i in range(n)]


# -- where it is planned ------------------------------------------------------------------------------------------


def test_one_gpu_with_little_host_memory_trains_longer_in_the_layer_order():
    """On the first GPU run's machine (125 GiB of host memory), gpt-1b at 768K fits only in the layer order: the
    subsequence order keeps every layer's K/V and dK/dV (on host beyond R) and the blocks' inputs."""
    profile = replace(H100, host_bytes_per_gpu=125 * 2**30)
    with pytest.raises(NoFeasiblePlan):
        solve(_request(768 * K, profile, order=("subsequence",), compare_ac=False))
    plan = solve(_request(768 * K, profile, compare_ac=False))
    assert plan.order == "layer" and plan.peak_gpu_bytes <= profile.hbm_bytes
    assert plan.peak_host_bytes <= profile.host_bytes_per_gpu
    assert plan.other_schedules == ["order=subsequence: no layout fits"]
    assert fits(_request(768 * K, profile)) and not fits(_request(768 * K, profile, order=("subsequence",)))


@pytest.mark.parametrize("gpus", [1, 8])
def test_the_faster_order_per_sequence_wins_and_the_other_is_reported(gpus):
    request = _request(128 * K, resolve_profile("h100", gpus), compare_ac=False)
    plan = solve(request)
    layered = _best(request)
    other = plan.other_schedules[-1]
    if plan.order == "layer":
        assert plan.step_time_s == layered.step_s and other.startswith("order=subsequence: best sp=")
    else:
        assert plan.seconds_per_sequence <= layered.per_sequence_s and other.startswith("order=layer: best sp=")


def test_the_layer_order_is_planned_on_every_layout_of_one_stage():
    """On 8 GPUs the layer order is searched at sp = 1, 2, 4, 8 (dp the rest); pinned --sp narrows it, and its plan
    says the layout, the FSDP sharding and the model state it was found with."""
    request = _request(256 * K, resolve_profile("h100", 8), model="llama-3.1-8b", order=("layer",), compare_ac=False)
    for sp in (1, 2, 4, 8):
        plan = solve(replace(request, sp=sp))
        assert (plan.order, plan.sp, plan.dp, plan.pp) == ("layer", sp, 8 // sp, 1)
        assert plan.fsdp_sync == "step" and plan.mfu_terms  # the setting order="layer" takes (FSDP per layer pass)
    best = solve(request)
    assert best.seconds_per_sequence == min(solve(replace(request, sp=sp)).seconds_per_sequence for sp in (1, 2, 4, 8))


def test_the_layer_order_is_refused_where_it_cannot_run():
    assert layer_order_refusal(_request(64 * K, resolve_profile("h100", 8))) is None  # many GPUs: one stage
    assert layer_order_refusal(_request(64 * K, resolve_profile("h100", 8), pp=2)).startswith("it runs the whole model")
    assert layer_order_refusal(_request(64 * K, recompute=("none",))).startswith("it recomputes")
    assert layer_order_refusal(_request(64 * K, kv_grad_dtype="bf16")).startswith("it sums one chunk's dK/dV")
    assert layer_order_refusal(_request(64 * K, order=("subsequence",))) == "not asked for (--order)"
    with pytest.raises(NoFeasiblePlan, match="--order layer cannot plan this request: it runs the whole model"):
        solve(_request(64 * K, resolve_profile("h100", 8), pp=2, order=("layer",)))


# -- what its time is made of --------------------------------------------------------------------------------------


def test_the_terms_of_the_distance_from_the_peak_add_up_to_the_step():
    """Each cause's seconds over the step is the MFU it costs: with the MFU they sum to 1 (the plan's MFU counts the
    same model FLOPs), and the step is the sum of its kinds of time."""
    request = _request(512 * K, resolve_profile("a100-80gb", 4), model="llama-3.1-8b", order=("layer",))
    plan = solve(replace(request, compare_ac=False))
    assert set(plan.mfu_terms) == set(GAP_TERMS)
    assert plan.mfu + sum(plan.mfu_terms.values()) / plan.step_time_s == pytest.approx(1.0, rel=1e-9)
    model_flops = sequence_model_flops(request.config, plan.partition)
    assert plan.mfu == pytest.approx(model_flops / (plan.step_time_s * plan.sp * 312e12), rel=1e-12)
    t = plan.time
    kinds = t.compute + t.all_to_all + t.offload_wait + t.sync + t.spill + t.optimizer
    assert kinds == pytest.approx(plan.step_time_s, rel=1e-12)
    assert min(plan.mfu_terms.values()) >= 0


def test_the_all_to_alls_are_the_runtimes_per_chunk_and_layer():
    """Forward: q, k, v in and the output back (2 H + 2 G head vectors per token); backward: the replay's q, k, v in
    and its output back, dout in, dq, dk, dv back (4 H + 4 G), under either recompute mode; with fewer K/V groups than
    ranks each group is repeated to the ranks first (G' = sp). Negative control: one SP rank sends nothing."""
    request = _request(256 * K, resolve_profile("h100", 8), model="llama-3.1-8b")
    spans = _spans(256 * K, 8)
    h = request.config.n_head
    for groups, sp in ((8, 4), (8, 8), (2, 8)):
        narrow = replace(request, config=replace(request.config, n_query_groups=groups))
        exchanged = max(groups, sp)
        for recompute in ("selective", "full"):
            costs, _, step = _step(narrow, Layout(sp, 1, 8 // sp), spans, recompute)
            per_chunk = sum(costs.all_to_all_seconds(s, sp, False, 6 * h + 6 * exchanged) for _, s in spans)
            assert step.time.all_to_all == pytest.approx(request.config.n_layer * per_chunk, rel=1e-12)
    assert _step(request, Layout(1, 1, 8), spans)[2].time.all_to_all == 0.0


def test_fewer_kv_groups_than_ranks_are_planned_in_the_layer_order_only():
    """Two K/V groups on eight GPUs: the subsequence order's Ulysses takes sp = 1 or 2, the layer order (whose runtime
    repeats the groups to the ranks) sp = 1, 2, 4 and 8; each rank then holds one group's K/V."""
    config = replace(GPTConfig.from_name("llama-3.1-8b"), n_query_groups=2, block_size=2**20)
    request = PlanRequest(config=config, seq_len=2**20, nodes=1, profile=resolve_profile("h100", 8))
    assert [layout.sp for layout in layer_layouts(request)] == [1, 2, 4, 8]
    assert {layout.sp for layout in candidate_layouts(config, 8, 8)} == {1, 2}
    dtypes = precision_bytes("bf16-mixed", sharded=True)
    spans = _spans(2**20, 8)
    assert kv_peak_bytes(config, dtypes, spans, None, 16384, 1, 8) == kv_peak_bytes(
        config, dtypes, spans, None, 16384, 1, 2
    )


def test_copies_that_cannot_hide_are_counted_and_hidden_ones_are_not():
    """A host-to-device link 1000x slower than PCIe: the checkpoints coming back outlast each layer's backward, and
    the step grows by what they take beyond the chunk-major kernels that run once the loop lets go of its first chunk
    (the layer below comes back chunk by chunk as they finish; counted as offload waits), while the copies to host,
    on a fast link, hide behind the forward; on the built-in link everything hides (negative control), and with
    nothing offloaded nothing is charged."""
    request = _request(256 * K, resolve_profile("h100", 8), model="llama-3.1-8b")
    spans = _spans(256 * K, 8)
    slow = replace(request, profile=replace(request.profile, h2d_gbps=0.05))
    _, _, hidden = _step(request, Layout(8, 1, 1), spans, "full", offload="full")
    costs, _, exposed = _step(slow, Layout(8, 1, 1), spans, "full", offload="full")
    _, _, kept = _step(slow, Layout(8, 1, 1), spans, "full", offload="none")
    assert hidden.time.offload_wait == 0.0 and kept.time.offload_wait == 0.0
    layers, local, chunk = request.config.n_layer, 256 * K // 8, 32 * K
    link = local * request.config.n_embd * 2 / 0.05e9  # one layer's bf16 inputs on one rank
    heads, kernel = request.config.n_head // 8, costs.attention_kernel
    diagonal = costs.attention_call(kernel, chunk, chunk, True, heads, backward=True)
    prefix = costs.attention_call(kernel, chunk, chunk, False, heads, backward=True)
    fetching = 7 * diagonal + 21 * prefix  # key chunks 1..7: their diagonals and the 6 + 5 + ... + 0 later readers
    assert exposed.time.offload_wait == pytest.approx((layers - 1) * (link - fetching), rel=1e-9)
    assert exposed.step_s == pytest.approx(kept.step_s + exposed.time.offload_wait, rel=1e-9)


def test_model_state_on_host_moves_16_bytes_a_parameter_off_the_device_and_steps_on_the_cpu():
    """FSDP2's CPU offload over dp x sp = 8 ranks: host holds 16 P / 8 bytes, the device what the layer in use
    gathers; the step adds the CPU AdamW (28 P / 8 bytes at the host's rate) where the device one was 28 P / 8 at HBM's
    elementwise rate."""
    request = _request(256 * K, resolve_profile("h100", 8), model="llama-3.1-8b")
    spans = _spans(256 * K, 8)
    _, _, device = _step(request, Layout(8, 1, 1), spans, state="device")
    _, _, host = _step(request, Layout(8, 1, 1), spans, state="host")
    params = stage_parameter_counts(request.config, StageSpec(0, request.config.n_layer, True, True)).total
    assert host.memory.host_state == 16 * params // 8 and device.memory.host_state == 0
    assert host.peak_gpu_bytes < device.peak_gpu_bytes - 10 * params // 8
    assert host.time.optimizer == pytest.approx(28 * params / 8 / request.profile.host_optimizer_bytes_per_s)
    assert device.time.optimizer == pytest.approx(28 * params / 8 / (request.profile.elementwise_gbps * 1e9))


def test_fsdp_traffic_that_cannot_hide_is_counted():
    """Collectives 10^5 times slower than NVLink outlast the layers they run beside; without FSDP (one rank, state on
    the device) there is none (negative control)."""
    request = _request(64 * K, resolve_profile("h100", 8), model="llama-3.1-8b")
    slow = replace(request, profile=replace(request.profile, intra_node_gbps=0.0036))
    spans = _spans(64 * K, 4)
    assert _step(request, Layout(8, 1, 1), spans)[2].time.sync < 1.0
    assert _step(slow, Layout(8, 1, 1), spans)[2].time.sync > 100.0
    one = _request(64 * K, model="llama-3.2-1b")
    assert _step(one, Layout(1, 1, 1), spans)[2].time.sync == 0.0


def test_more_memory_kept_costs_no_time_and_the_copies_are_charged_where_they_do_not_hide():
    """K/V on host (R=0) and checkpoints on host hold less on the device; a small model's short chunks cannot hide
    their copies, which the step time shows (negative control: on the device nothing is charged)."""
    request = _request(64 * K)
    spans = [(i * 2048, 2048) for i in range(32)]
    _, _, device = _step(request, Layout(1, 1, 1), spans, "selective", "none", device_tokens=None, chunk=16384)
    _, _, hosted = _step(request, Layout(1, 1, 1), spans, "selective", "full", device_tokens=0, chunk=2048)
    assert hosted.peak_gpu_bytes < device.peak_gpu_bytes and hosted.memory.host_bytes > 0
    assert device.time.offload_wait == device.time.spill == 0.0 and hosted.time.spill > 0
    assert hosted.step_s > device.step_s


# -- bytes per rank ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_a_ranks_kv_bytes_are_one_device_bytes_of_its_heads(sp):
    """Each of sp ranks holds G / sp K/V groups of every token (Ulysses): its K/V + dK/dV peak is the one-device peak
    (what ``LayerMajorEngine.meter`` measures, ``tests/runtime/test_layer_major.py``) of a model with G / sp groups,
    for any chunking and K/V placement. A multi-rank engine's meter, on every rank, is what this must equal."""
    config = GPTConfig.from_name("llama-3.1-8b")
    dtypes = precision_bytes("bf16-mixed", sharded=True)
    rank = replace(config, n_query_groups=config.n_query_groups // sp)
    for spans, R, chunk in (
        (_spans(64 * K, 8), None, 16384),
        (_spans(64 * K, 8), 20000, 4096),
        (_spans(96 * K, 3), 0, 8192),
    ):
        assert kv_peak_bytes(config, dtypes, spans, R, chunk, 1, sp) == kv_peak_bytes(rank, dtypes, spans, R, chunk)
        assert kv_peak_bytes(config, dtypes, spans, R, chunk, 1, sp) * sp == kv_peak_bytes(
            config, dtypes, spans, R, chunk
        )


def test_a_ranks_activations_shrink_with_sp_and_its_model_state_with_dp_x_sp():
    """The kept inputs, working set and K/V of a layer are split over sp; the model state over dp x sp."""
    request = _request(512 * K, resolve_profile("h100", 8), model="llama-3.1-8b")
    spans = _spans(512 * K, 8)
    memory = {}
    for layout in (Layout(1, 1, 8), Layout(2, 1, 4), Layout(8, 1, 1)):
        costs, setup, _ = _step(request, layout, spans, "full", "full")
        memory[layout.sp] = layer_order_memory(costs, spans, setup)
    assert memory[1].model_state_bytes == memory[2].model_state_bytes == memory[8].model_state_bytes
    assert memory[1].activations > 1.9 * memory[2].activations > 3.8 * memory[8].activations
    assert memory[1].host == 8 * memory[8].host


# -- the figures (issue 38, done-when), predicted with the shipped profiles --------------------------------


def test_llama_8b_at_4m_fits_on_eight_a100s():
    request = _request(4 * K * K, resolve_profile("a100-80gb", 8), model="llama-3.1-8b")
    assert fits(request)
    assert not fits(replace(request, order=("subsequence",)))  # negative control: the subsequence order cannot


@pytest.mark.slow
def test_llama_8b_longest_on_one_h100_node_is_past_6m():
    request = _request(K, resolve_profile("h100", 8), model="llama-3.1-8b", compare_ac=False)
    found = longest_sequence(request)
    assert found.seq_len >= 6 * K * K and found.plan.order == "layer"


@pytest.mark.slow
def test_llama_8b_at_2m_on_four_a100s_plans_past_50_percent_mfu():
    plan = solve(_request(2 * K * K, resolve_profile("a100-80gb", 4), model="llama-3.1-8b", compare_ac=False))
    assert plan.order == "layer" and plan.mfu >= 0.50
    assert plan.other_schedules[-1].startswith("order=subsequence: best sp=4")


@pytest.mark.slow
def test_llama_8b_at_1m_on_one_h100_with_host_state_plans_past_40_percent_mfu(monkeypatch):
    """Selective recompute fits because the device holds one layer's checkpoints (and a chunk in flight) in the
    backward; counting two layers' worth, as a whole-layer prefetch holds (the negative control), it does not fit
    and the plan falls back to full recompute, under 40%."""
    request = _request(K * K, resolve_profile("h100", 1), model="llama-3.1-8b", compare_ac=False,
                       order=("layer",), model_state=("host",))  # fmt: skip
    plan = solve(request)
    assert plan.order == "layer" and plan.recompute == "selective" and plan.mfu >= 0.40
    phases = layer_order.layer_order_phases

    def two_layers(config, dtypes, spans, setup):
        kept = (
            setup.batch
            * (spans[-1][0] + spans[-1][1])
            * layer_order.kept_bytes_per_token(config, dtypes, setup.recompute)
        )
        return {name: (resident + (kept if name != "forward" else 0), temporaries)
                for name, (resident, temporaries) in phases(config, dtypes, spans, setup).items()}  # fmt: skip

    monkeypatch.setattr(layer_order, "layer_order_phases", two_layers)
    fallback = solve(request)
    assert fallback.recompute == "full" and fallback.mfu < 0.40


# -- its plan runs ------------------------------------------------------------------------------------------


def test_a_planned_layer_order_runs_as_planned():
    """A layer-order plan (``--order layer``) of a tiny model: ``plan_settings`` give a strategy that runs the
    layer-major engine with the planned chunks."""
    config = GPTConfig.from_name("tiny-gqa", block_size=4096)
    request = PlanRequest(config=config, seq_len=2048, nodes=1, profile=replace(small_gpu(1.0), gpus_per_node=1),
                          order=("layer",), min_tokens_per_device=128, compare_ac=False)  # fmt: skip
    plan = solve(request)
    assert plan.order == "layer"
    settings = plan_settings(plan)
    assert settings["order"] == "layer" and settings["recompute"] in ("selective", "full")
    core = SPPOCore(SPPOConfig(**settings))
    core.set_world_size(1)
    model = core.prepare_model(GPT(config), torch.device("cpu"))
    ids, targets = make_batch(config, 1, 2048)
    core.forward_backward(model, ids, targets)
    assert type(core.engine).__name__ == "LayerMajorEngine" and list(core.last_plan.lengths) == plan.partition
