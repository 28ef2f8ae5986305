"""The "sppo" Fabric strategy on one CPU device."""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_sppo
from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.offload import OffloadCallback
from lightning_sppo.parallel import ParallelDims
from lightning_sppo.strategy.checkpoint import CheckpointMismatchError
from tests.conftest import make_batch, max_relative_error, parity_config, plain_loss_and_grads


def test_importing_registers_sppo_for_fabric():
    assert "sppo" in STRATEGY_REGISTRY.available_strategies()
    assert isinstance(Fabric(strategy="sppo", accelerator="cpu", devices=1).strategy, SPPOStrategy)
    assert lightning_sppo.SPPOStrategy is SPPOStrategy


@pytest.mark.parametrize("partition", ["length", "flops"])
def test_fabric_step_equals_plain_model(partition):
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 45)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)

    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=5, partition=partition), accelerator="cpu", devices=1)
    fabric.launch()
    fabric_model = fabric.setup(model)
    loss = fabric.strategy.forward_backward(fabric_model, ids, targets)

    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert max_relative_error(ref_grads, model)[0] < 1e-5


def test_optimizer_step_after_forward_backward_matches_plain_sgd():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, 45)
    _, ref_grads = plain_loss_and_grads(model, ids, targets)
    expected = {n: p.detach() - 0.1 * ref_grads[n] for n, p in model.named_parameters()}

    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=3), accelerator="cpu", devices=1)
    fabric.launch()
    fabric_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.strategy.forward_backward(fabric_model, ids, targets)
    optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-7)


def test_bf16_mixed_precision_runs_and_is_close():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, 45)
    ref_loss, _ = plain_loss_and_grads(model, ids, targets)
    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=3), accelerator="cpu", devices=1, precision="bf16-mixed")
    fabric.launch()
    loss = fabric.strategy.forward_backward(fabric.setup(model), ids, targets)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 2e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_bf16_kv_gradients_on_one_device():
    """kv_grad_dtype="bf16" reaches the engine's caches; gradients stay close to the plain model's."""
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, 45)
    _, ref_grads = plain_loss_and_grads(model, ids, targets)
    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=5, kv_grad_dtype="bf16"), accelerator="cpu", devices=1)
    fabric.launch()
    fabric.strategy.forward_backward(fabric.setup(model), ids, targets)
    caches = fabric.strategy.engine._pool.caches()
    assert caches and {cache.grad_buffers()[0].dtype for cache in caches} == {torch.bfloat16}
    errors = [(p.grad - ref_grads[n]).norm() / ref_grads[n].norm() for n, p in model.named_parameters()]
    assert 1e-5 < max(errors) < 2e-2  # bf16 sums ran (not fp32-exact), and stayed close


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(partition="equal"), ValueError, "Unknown partition='equal'"),
        (dict(offload="some"), ValueError, "Unknown offload='some'"),
        (dict(attention="xformers"), ValueError, "Unknown attention='xformers'"),
        (dict(kv_grad_dtype="fp16"), ValueError, r"Unknown kv_grad_dtype='fp16'; choose one of \['fp32', 'bf16'\]"),
        (dict(num_subsequences=0), ValueError, "num_subsequences=0"),
        (dict(num_subsequences="many"), ValueError, "num_subsequences='many'"),
        (dict(loss_chunk_tokens=0), ValueError, "loss_chunk_tokens=0"),
        (dict(granularity=0), ValueError, "granularity=0"),
        (dict(fsdp_sync="sometimes"), ValueError, r"Unknown fsdp_sync='sometimes'; choose one of \['step', 'reduce'"),
        (dict(pipeline_parallel=0), ValueError, "pipeline_parallel must be a positive integer"),
        (dict(sequence_parallel=None, pipeline_parallel=0), ValueError, "pipeline_parallel=0"),
        (dict(planner_profile="tpu-v9"), ValueError, "planner_profile='tpu-v9' is neither a built-in profile"),
    ],
)
def test_bad_settings_name_the_setting(kwargs, error, match):
    with pytest.raises(error, match=match):
        SPPOStrategy(**kwargs)


def test_num_subsequences_larger_than_sequence_is_reported():
    config = parity_config()
    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=50), accelerator="cpu", devices=1)
    fabric.launch()
    model = fabric.setup(GPT(config))
    ids, targets = make_batch(config, 1, 45)
    with pytest.raises(ValueError, match="num_subsequences=50"):
        fabric.strategy.forward_backward(model, ids, targets)


def test_works_without_launch_and_checkpoints_have_plain_gpt_keys(tmp_path):
    config = parity_config()
    fabric = Fabric(strategy="sppo", accelerator="cpu", devices=1)  # no fabric.launch(): one device
    model = GPT(config)
    plain_keys = set(GPT(config).state_dict())
    fabric_model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    ids, targets = make_batch(config, 1, 45)
    fabric.strategy.forward_backward(fabric_model, ids, targets)
    optimizer.step()
    fabric.save(tmp_path / "ckpt.pt", {"model": fabric_model, "optimizer": optimizer, "step": 1})
    assert set(torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]) == plain_keys

    restored = GPT(config)
    fabric2 = Fabric(strategy="sppo", accelerator="cpu", devices=1)
    restored_model, restored_opt = fabric2.setup(restored, torch.optim.AdamW(restored.parameters()))
    remainder = fabric2.load(tmp_path / "ckpt.pt", {"model": restored_model, "optimizer": restored_opt})
    assert remainder == {"step": 1, "model_config": config.to_dict()}  # the architecture, as on several devices
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)

    other = GPT(parity_config(gqa=True))  # another architecture: one line naming the field, not torch's list
    other_model = fabric2.setup(other)
    with pytest.raises(CheckpointMismatchError, match=r"n_query_groups=4 \(this one has n_query_groups=2\)") as error:
        fabric2.load(tmp_path / "ckpt.pt", {"model": other_model})
    assert "\n" not in str(error.value)


def test_clip_gradients_on_one_device_matches_torch():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, 45)
    _, ref_grads = plain_loss_and_grads(model, ids, targets)
    ref_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm()
    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=3), accelerator="cpu", devices=1)
    fabric_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.strategy.forward_backward(fabric_model, ids, targets)
    norm = fabric.clip_gradients(fabric_model, optimizer, max_norm=0.1)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    clipped = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    torch.testing.assert_close(clipped, torch.tensor(0.1), rtol=1e-4, atol=0)


@pytest.mark.parametrize("offload", ["full", "adaptive"])
def test_offload_through_the_strategy_gives_bit_identical_gradients(offload):
    config = parity_config(gqa=True)
    ids, targets = make_batch(config, 2, 45)
    grads = {}
    for policy in ("none", offload):
        torch.manual_seed(0)
        model = GPT(config)
        # min_bytes=0: the tiny model's tensors are all under the default size threshold.
        strategy = SPPOStrategy(num_subsequences=5, offload=OffloadCallback(policy, min_bytes=0))
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
        fabric.strategy.forward_backward(fabric.setup(model), ids, targets)
        grads[policy] = {n: p.grad.clone() for n, p in model.named_parameters()}
        if policy != "none":
            stats = fabric.strategy.core.hooks.last_stats
            assert stats.offloaded_bytes > 0, stats
    for name, grad in grads["none"].items():
        assert torch.equal(grad, grads[offload][name]), name


@pytest.mark.parametrize(("recompute", "offload", "sp"), [("selective", "none", 1), ("full", "full", None)])
def test_layer_order_through_fabric_equals_plain_model(recompute, offload, sp):
    """sequence_parallel=None on one process: nothing to plan, the one device runs it (as the subsequence order)."""
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 45)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    strategy = SPPOStrategy(num_subsequences=4, order="layer", recompute=recompute, offload=offload,
                            sequence_parallel=sp)  # fmt: skip
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    loss = fabric.strategy.forward_backward(fabric.setup(model), ids, targets)
    assert fabric.strategy.core.dims == ParallelDims(1, 1, 1)
    assert type(fabric.strategy.engine).__name__ == "LayerMajorEngine"
    assert fabric.strategy.core.last_plan.lengths == (12, 11, 11, 11)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert max_relative_error(ref_grads, model)[0] < 1e-5
    assert not any("forward" in block.__dict__ for block in model.blocks.values())  # the engine recomputes itself


def test_layer_order_auto_cuts_chunks_of_at_most_16k_tokens():
    from lightning_sppo.step_plan import LAYER_CHUNK_TOKENS

    config = parity_config()
    fabric = Fabric(strategy=SPPOStrategy(order="layer", recompute="selective"), accelerator="cpu", devices=1)
    fabric.launch()
    model = fabric.setup(GPT(config))
    ids, targets = make_batch(config, 1, 45)
    fabric.strategy.forward_backward(model, ids, targets)
    assert fabric.strategy.core.last_plan.lengths == (45,)
    assert LAYER_CHUNK_TOKENS == 16384


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(order="column"), r"Unknown order='column'; choose one of \['subsequence', 'layer'\]"),
        (dict(order="layer"), "order='layer' recomputes each layer in its backward: set recompute="),
        (dict(order="layer", recompute="full", offload="adaptive"), "set offload='none' or 'full'"),
        (dict(order="layer", recompute="full", pipeline_parallel=2), "set pipeline_parallel=1"),
        (dict(order="layer", recompute="full", pipeline_parallel=None), r"got pipeline_parallel=None"),
        (dict(order="layer", recompute="full", kv_grad_dtype="bf16"), "kv_grad_dtype='bf16'"),
        (dict(order="layer", recompute="full", schedule="sppo"), "schedule does not apply, got schedule='sppo'"),
        (dict(order="layer", recompute="full", num_microbatches=2), "got num_microbatches=2; remove it"),
        (dict(order="layer", recompute="full", fsdp_sync="regather"), "got fsdp_sync='regather'"),
    ],
)
def test_layer_order_settings_it_cannot_run_name_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SPPOStrategy(**kwargs)


def test_layer_order_with_model_state_on_host_equals_plain_model():
    """One process, its model state in host memory: FSDP2 over a group of one with CPU offload, driven per layer."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from lightning_sppo.parallel.fsdp import fsdp_modules

    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 45)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    strategy = SPPOStrategy(num_subsequences=3, order="layer", recompute="full", model_state="host")
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    try:
        stage = fabric.setup(model)
        loss = fabric.strategy.forward_backward(stage, ids, targets)
        policies = [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in fsdp_modules(stage.module)]
        assert len(policies) == config.n_layer + 1 and all(isinstance(p, CPUOffloadPolicy) for p in policies)
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
        for name, param in stage.module.named_parameters():
            assert (param.grad.to_local() - ref_grads[name]).norm() / ref_grads[name].norm() < 1e-5, name
    finally:
        fabric.strategy.teardown()


@pytest.mark.parametrize("order", ["subsequence", "layer"])
def test_layers_per_stage_is_checked_on_one_device_too(order):
    """One device is one stage: a layers_per_stage that does not sum to n_layer is refused as on several."""
    fabric = Fabric(
        strategy=SPPOStrategy(num_subsequences=2, order=order, recompute="full", layers_per_stage=[3]),
        accelerator="cpu",
        devices=1,
    )
    fabric.launch()
    with pytest.raises(ValueError, match=r"layers_per_stage=\[3\] must list 1 positive layer counts"):
        fabric.setup(GPT(parity_config()))


ORDERS = {
    "subsequence": dict(num_subsequences=3, partition="flops"),
    "layer": dict(num_subsequences=3, order="layer", recompute="selective"),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_int32_token_ids_and_targets_train_and_evaluate_as_int64_ones(order):
    """A token file of 32-bit ids gives int32 batches: the batch check accepts int32 targets, and the loss raised
    "expected target dtype to be Long" on them; now they give the plain model's loss and gradients."""
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 45)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    fabric = Fabric(strategy=SPPOStrategy(**ORDERS[order]), accelerator="cpu", devices=1)
    stage = fabric.setup(model)
    total, count = fabric.strategy.evaluate(stage, ids.int(), targets.int())
    loss = fabric.strategy.forward_backward(stage, ids.int(), targets.int())
    assert abs(total.item() / count.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert max_relative_error(ref_grads, model)[0] < 1e-5


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("call", ["forward_backward", "evaluate"])
def test_a_batch_without_rows_or_not_a_tensor_is_refused_in_one_line(order, call):
    """An empty batch failed inside autograd ("element 0 of tensors does not require grad"), a list of ids with
    "'list' object has no attribute 'to'"."""
    from lightning_sppo.errors import SPPOConfigError

    config = parity_config()
    fabric = Fabric(strategy=SPPOStrategy(**ORDERS[order]), accelerator="cpu", devices=1)
    stage = fabric.setup(GPT(config))
    ids, targets = make_batch(config, 1, 12)
    run = getattr(fabric.strategy, call)
    with pytest.raises(SPPOConfigError, match=r"The batch holds no sequence \(input_ids of shape \(0, 12\)\)"):
        run(stage, ids[:0], targets[:0])
    with pytest.raises(TypeError, match=r"input_ids must be an integer tensor \[batch, seq_len\], got list"):
        run(stage, ids.tolist(), targets)
