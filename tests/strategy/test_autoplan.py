"""``num_subsequences="auto"`` and unset sizes ask the planner about the run (``strategy/autoplan.py``)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from lightning.fabric import Fabric

from lightning_sppo import GPT, GPTConfig, SPPOStrategy
from lightning_sppo.partition import auto_num_subsequences
from lightning_sppo.planner import BUILTIN_PROFILES, PlanRequest, load_profile, solve
from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.core import SPPOCore
from tests.conftest import make_batch, max_relative_error, parity_config, plain_loss_and_grads

SEQ_LEN = 8192
CONFIG = GPTConfig.from_name("tiny-gqa", block_size=SEQ_LEN)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def planner_log(caplog, monkeypatch):
    """The planner's rank-zero log lines (Lightning's own logger does not propagate by default)."""
    monkeypatch.setattr(logging.getLogger("lightning.fabric"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


def _profile(tmp_path, hbm_mib: int) -> str:
    """A one-GPU profile whose memory makes N = 1 too big for the tiny model at 8K tokens (see the test)."""
    path = tmp_path / "small.json"
    profile = replace(BUILTIN_PROFILES["a100-80gb"], name="small", hbm_bytes=hbm_mib * 2**20, reserved_bytes=0,
                      allocator_slack_bytes=0)  # fmt: skip
    replace(profile, gpus_per_node=1).save(path)
    return str(path)


def _expected(profile: str, partition: tuple[str, ...] = ("flops", "length")):
    """What the solver says for the same run: one device, fp32 (Fabric's default), offload none, sync step."""
    request = PlanRequest(
        config=CONFIG, seq_len=SEQ_LEN, nodes=1, profile=load_profile(profile), precision="fp32", sp=1, pp=1,
        offload=("none",), fsdp_sync=("step",), partition=partition,
        recompute=("none",), kv_device_tokens=None, model_state=("device",),  # the run's defaults, as it plans them
    )  # fmt: skip
    return solve(request)


@pytest.mark.slow
def test_auto_takes_the_solvers_n_and_partition(tmp_path, planner_log):
    profile = _profile(tmp_path, 115)
    plan = _expected(profile)
    assert plan.num_subsequences > 1  # memory forces a cut, and not the ~4K-token fallback's
    assert plan.num_subsequences != auto_num_subsequences(SEQ_LEN)

    model = GPT(CONFIG)
    ids, targets = make_batch(CONFIG, 1, SEQ_LEN)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    fabric = Fabric(strategy=SPPOStrategy(planner_profile=profile), accelerator="cpu", devices=1)
    loss = fabric.strategy.forward_backward(fabric.setup(model), ids, targets)

    assert list(fabric.strategy.core.last_plan.lengths) == plan.partition
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert max_relative_error(ref_grads, model)[0] < 1e-5
    assert f"num_subsequences={plan.num_subsequences} ({plan.partition_policy} partition" in planner_log.text


@pytest.mark.slow
def test_an_explicit_partition_is_kept(tmp_path):
    """The solver picks "length" here when free to; told "flops", it finds the N that fits with it."""
    profile = _profile(tmp_path, 118)
    assert _expected(profile).partition_policy == "length"
    plan = _expected(profile, partition=("flops",))
    assert plan.num_subsequences > 1
    fabric = Fabric(strategy=SPPOStrategy(planner_profile=profile, partition="flops"), accelerator="cpu", devices=1)
    ids, targets = make_batch(CONFIG, 1, SEQ_LEN)
    fabric.strategy.forward_backward(fabric.setup(GPT(CONFIG)), ids, targets)
    assert plan.partition_policy == "flops" and list(fabric.strategy.core.last_plan.lengths) == plan.partition


def test_a_run_that_does_not_fit_names_the_settings(tmp_path):
    fabric = Fabric(strategy=SPPOStrategy(planner_profile=_profile(tmp_path, 64)), accelerator="cpu", devices=1)
    model = fabric.setup(GPT(CONFIG))
    ids, targets = make_batch(CONFIG, 1, SEQ_LEN)
    with pytest.raises(ValueError, match=r"num_subsequences='auto'.*over the 64.0 MiB of planner_profile=") as error:
        fabric.strategy.forward_backward(model, ids, targets)
    assert "offload=none" in str(error.value) and "Set the sizes and num_subsequences explicitly" in str(error.value)


@pytest.mark.slow
def test_runs_the_planner_cannot_model_fall_back_to_4k_subsequences(planner_log):
    fabric = Fabric(strategy=SPPOStrategy(layers_per_stage=[CONFIG.n_layer]), accelerator="cpu", devices=1)
    model = fabric.setup(GPT(CONFIG))
    ids, targets = make_batch(CONFIG, 2, SEQ_LEN)
    fabric.strategy.forward_backward(model, ids, targets)
    assert fabric.strategy.core.last_plan.lengths == (4096, 4096)
    assert "the planner balances the stages itself, and layers_per_stage is set" in planner_log.text


def test_unset_sizes_take_the_solvers_layout(planner_log):
    """Eight processes (one node of eight): the core asks the solver for (pp, sp) at the model's block_size."""
    config = GPTConfig.from_name("small", block_size=2**15)
    core = SPPOCore(SPPOConfig(pipeline_parallel=None, sequence_parallel=None, offload="full"))
    assert core.set_world_size(8, local_processes=8) is None  # decided when the model is set up
    core.set_precision("bf16-mixed")
    with torch.device("meta"):
        model = GPT(config)
    pp, sp = core.planner.layout(model, torch.device("cpu"), 8)

    profile = replace(BUILTIN_PROFILES["a100-80gb"], gpus_per_node=8)
    request = PlanRequest(config=config, seq_len=2**15, nodes=1, profile=profile, offload=("full",),
                          fsdp_sync=("step",), schedule=("seq1f1b",), order=("subsequence",))  # fmt: skip
    plan = solve(request)
    assert (pp, sp) == (plan.pp, plan.sp)
    assert f"pipeline_parallel={pp}, sequence_parallel={sp}" in planner_log.text


def test_a_given_size_constrains_the_other():
    config = GPTConfig.from_name("small", block_size=2**15)
    core = SPPOCore(SPPOConfig(pipeline_parallel=2, sequence_parallel=None))
    core.set_world_size(8, local_processes=8)
    core.set_precision("32-true")
    with torch.device("meta"):
        pp, sp = core.planner.layout(GPT(config), torch.device("cpu"), 8)
    assert pp == 2 and 8 % (pp * sp) == 0


def test_the_sppo_schedule_is_planned_with_its_streams(planner_log):
    """schedule="sppo" is planned as such (no fallback): the solver's answer under --schedule=sppo (and the run's
    kv_grad_dtype)."""
    config = GPTConfig.from_name("small", block_size=2**15)
    settings = SPPOConfig(
        pipeline_parallel=2, sequence_parallel=None, schedule="sppo", offload="full", kv_grad_dtype="bf16"
    )
    core = SPPOCore(settings)
    core.set_world_size(8, local_processes=8)
    core.set_precision("bf16-mixed")
    with torch.device("meta"):
        pp, sp = core.planner.layout(GPT(config), torch.device("cpu"), 8)
    profile = replace(BUILTIN_PROFILES["a100-80gb"], gpus_per_node=8)
    request = PlanRequest(config=config, seq_len=2**15, nodes=1, profile=profile, pp=2, offload=("full",),
                          fsdp_sync=("step",), schedule=("sppo",), kv_grad_dtype="bf16")  # fmt: skip
    plan = solve(request)
    assert plan.schedule == "sppo" and plan.memory.stream_bytes > 0 and (pp, sp) == (plan.pp, plan.sp)
    assert "schedule=sppo, bf16 dK/dV" in planner_log.text and "cannot" not in planner_log.text


def test_the_gpipe_schedule_falls_back(planner_log):
    core = SPPOCore(SPPOConfig(pipeline_parallel=2, sequence_parallel=None, schedule="gpipe"))
    core.set_world_size(8, local_processes=8)
    core.set_precision("bf16-mixed")
    with torch.device("meta"):
        assert core.planner.layout(GPT(GPTConfig.from_name("small")), torch.device("cpu"), 8) == (2, 1)
    assert "the planner models schedule in ['seq1f1b', 'sppo'], not schedule='gpipe'" in planner_log.text


def test_unset_sizes_are_refused_when_the_given_one_does_not_divide_the_world():
    core = SPPOCore(SPPOConfig(pipeline_parallel=3, sequence_parallel=None))
    with pytest.raises(ValueError, match=r"pipeline_parallel \* sequence_parallel = 3 \* 1 must divide"):
        core.set_world_size(8, local_processes=8)


def test_bf16_mixed_turns_on_fsdp_mixed_precision():
    core = SPPOCore(SPPOConfig(fsdp_sync="regather"))
    assert core.fsdp.param_dtype is None and core.fsdp.sync == "regather"
    core.set_precision("bf16-mixed")
    assert core.fsdp.param_dtype == torch.bfloat16 and core.fsdp.sync == "regather"
    core.set_precision("16-mixed")  # fp16 autocast with a grad scaler: FSDP keeps the parameters' dtype
    assert core.fsdp.param_dtype is None


def test_on_a_cpu_the_planner_says_which_gpu_it_predicts_for():
    """Issue 39: the line read "(profile: the a100-80gb default (no CUDA device))"; it says what the prediction is."""
    from lightning_sppo.strategy.autoplan import device_profile

    profile, source = device_profile(torch.device("cpu"), None, 1)
    assert profile.name == "a100-80gb"
    assert source == "a100-80gb, as if this CPU run were on that GPU; planner_profile picks another"
    assert device_profile(torch.device("cpu"), "h100", 1)[1] == "planner_profile='h100'"


@pytest.mark.slow
def test_a_first_evaluation_under_inference_mode_plans_a_model_the_census_table_lacks():
    """Lightning's sanity check evaluates before the first training step, under inference_mode. With
    num_subsequences="auto" (the default) that evaluation makes the first plan, and for a model whose structure the
    census table lacks (partial rotary here) the planner counts it by running a tiny model's forward and backward:
    it did so under the caller's inference_mode and failed ("element 0 of tensors does not require grad")."""
    from lightning_sppo.planner.census import census, structure_of
    from lightning_sppo.planner.census_table import TABLE

    config = GPTConfig.from_name("tiny-gqa", block_size=256, rotary_percentage=0.5)
    assert not any(key.endswith(",".join(map(str, structure_of(config)))) for key in TABLE)  # counted at run time
    census.cache_clear()
    model = GPT(config)
    ids, targets = make_batch(config, 2, 96)
    ref_loss, _ = plain_loss_and_grads(model, ids, targets)
    fabric = Fabric(strategy=SPPOStrategy(), accelerator="cpu", devices=1)
    with torch.inference_mode():
        total, count = fabric.strategy.evaluate(fabric.setup(model), ids, targets)
    assert fabric.strategy.core.planner.decisions[-1].get("fallback") is None  # the solver's N, not the fallback's
    assert abs(total.item() / count.item() - ref_loss.item()) / ref_loss.item() < 1e-5


# -- the layer order's layout ---------------------------------------------------------------------------------


def _layer_core(world: int, profile: str | None = None) -> SPPOCore:
    settings = SPPOConfig(order="layer", recompute="selective", sequence_parallel=None, planner_profile=profile)
    core = SPPOCore(settings)
    assert core.set_world_size(world, local_processes=world) is None  # decided when the model is set up
    core.set_precision("32-true")
    return core


def _layer_request(config: GPTConfig, world: int, profile) -> PlanRequest:
    return PlanRequest(config=config, seq_len=config.block_size, nodes=1, profile=replace(profile, gpus_per_node=world),
                       precision="fp32", pp=1, offload=("none",), fsdp_sync=("step",), schedule=("seq1f1b",),
                       recompute=("selective",), order=("layer",))  # fmt: skip


@pytest.mark.parametrize(("hbm_mib", "sp"), [(None, 1), (30, 2)], ids=["roomy", "tight"])
def test_the_layer_order_takes_the_planners_sp_and_dp(tmp_path, planner_log, hbm_mib, sp):
    """order="layer" with sequence_parallel=None: the solver's layer-order layout (pp=1, its sp and so dp) for the
    model's block_size on two processes. Roomy (the default profile): both ranks take whole sequences (dp=2); on a
    GPU too small for that (30 MiB) the sequence is split (sp=2), as the solver says."""
    config = replace(parity_config(gqa=True, n_layer=2), block_size=16384)
    path = None if hbm_mib is None else _profile(tmp_path, hbm_mib)
    core = _layer_core(2, path)
    pp, got = core.planner.layout(GPT(config), torch.device("cpu"), 2)
    profile = BUILTIN_PROFILES["a100-80gb"] if path is None else load_profile(path)
    plan = solve(_layer_request(config, 2, profile))
    assert (pp, got) == (1, plan.sp) and plan.order == "layer" and got == sp
    assert (
        f"pipeline_parallel=1, sequence_parallel={sp} (data parallel {2 // sp}) for order='layer'" in planner_log.text
    )
