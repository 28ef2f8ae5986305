"""The subsequence engine against the plain full-sequence model on one process (fp32, CPU)."""

from contextlib import nullcontext

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import make_batch, max_relative_error, parity_config, plain_loss_and_grads

S = 45  # a multiple of none of N > 1 below


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("partition", ["length", "flops"])
@pytest.mark.parametrize("num_subsequences", [1, 2, 3, 5, 8])
def test_forward_backward_equals_plain_model(num_subsequences, partition, batch_size, gqa):
    config = parity_config(gqa)
    model = GPT(config)
    ids, targets = make_batch(config, batch_size, S)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)

    engine = SubsequenceEngine(num_subsequences, partition)
    loss = engine.forward_backward(model, ids, targets)

    assert len(engine.plan(ids, config).lengths) == num_subsequences
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    err, where = max_relative_error(ref_grads, model)
    assert err < 1e-5, f"{where}: {err}"


def test_flops_partition_in_the_grid_is_uneven():
    """Guards the grid above: with S=45 the flops policy really cuts differently from length."""
    ids = torch.zeros(1, S, dtype=torch.long)
    lengths = list(SubsequenceEngine(5, "flops").plan(ids, parity_config()).lengths)
    assert lengths != list(SubsequenceEngine(5, "length").plan(ids, parity_config()).lengths)
    assert lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("name", ["tiny-gelu", "tiny-gqa"])
@pytest.mark.parametrize("attention", ["reference", "sdpa"])
def test_other_architectures_and_kernels(name, attention):
    config = GPTConfig.from_name(name)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 37)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    loss = SubsequenceEngine(4, "length", attention=attention).forward_backward(model, ids, targets)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert max_relative_error(ref_grads, model)[0] < 1e-5


@settings(max_examples=15, deadline=None)
@given(
    seq_len=st.integers(2, 70),
    num_subsequences=st.integers(1, 9),
    partition=st.sampled_from(["length", "flops"]),
    batch_size=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 4]),
    granularity=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**16),
)
def test_random_configurations_equal_plain_model(
    seq_len, num_subsequences, partition, batch_size, groups, granularity, seed
):
    if num_subsequences > -(-seq_len // granularity):
        return
    torch.manual_seed(seed)
    config = parity_config(n_query_groups=groups)
    model = GPT(config)
    ids, targets = make_batch(config, batch_size, seq_len, seed=seed)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    engine = SubsequenceEngine(num_subsequences, partition, granularity=granularity)
    loss = engine.forward_backward(model, ids, targets)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert max_relative_error(ref_grads, model)[0] < 1e-5


def test_negative_control_backward_in_forward_order_fails_parity():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    _, ref_grads = plain_loss_and_grads(model, ids, targets)

    engine = SubsequenceEngine(3, "length", strict_order=False)
    state = engine.begin(model, ids, targets)
    for i in range(3):
        engine.forward(state, i)
    for i in range(3):  # wrong order
        engine.backward(state, i)
    engine.end(state)
    err, _ = max_relative_error(ref_grads, model)
    assert err > 1e-3  # the parity check above would catch it


def test_strict_engine_refuses_forward_order_backward():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, S)
    engine = SubsequenceEngine(3, "length")
    state = engine.begin(model, ids, targets)
    for i in range(3):
        engine.forward(state, i)
    with pytest.raises(RuntimeError, match="out of order"):
        engine.backward(state, 0)
    engine.end(state)


def test_gradients_accumulate_like_loss_backward():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, S)
    _, ref_grads = plain_loss_and_grads(model, ids, targets)
    engine = SubsequenceEngine(3)
    engine.forward_backward(model, ids, targets)
    engine.forward_backward(model, ids, targets)  # caches are reused and reset between steps
    doubled = {name: 2 * g for name, g in ref_grads.items()}
    assert max_relative_error(doubled, model)[0] < 1e-5


def test_model_runs_plain_attention_after_a_step():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, S)
    before = model(ids)
    SubsequenceEngine(3).forward_backward(model, ids, targets)
    torch.testing.assert_close(model(ids), before)


def test_loss_goes_down_on_a_repeating_corpus():
    config = GPTConfig.from_name("tiny")
    model = GPT(config)
    pattern = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. "))
    data = pattern.repeat(4)[None, :129]
    ids, targets = data[:, :-1], data[:, 1:]
    engine = SubsequenceEngine(4, "flops")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        losses.append(engine.forward_backward(model, ids, targets).item())
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    ("ids_shape", "targets_shape", "match"),
    [((2, 10), (2, 9), "targets must have the shape"), ((10,), (10,), r"\[batch, seq_len\]")],
)
def test_bad_batch_names_the_problem(ids_shape, targets_shape, match):
    model = GPT(GPTConfig.from_name("tiny"))
    with pytest.raises(ValueError, match=match):
        SubsequenceEngine(2).forward_backward(model, torch.zeros(ids_shape, dtype=torch.long),
                                              torch.zeros(targets_shape, dtype=torch.long))  # fmt: skip


def test_float_targets_are_refused():
    model = GPT(GPTConfig.from_name("tiny"))
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="targets must hold integer token ids"):
        SubsequenceEngine(2).forward_backward(model, ids, ids.float())


def test_errors_for_bad_num_subsequences_and_long_sequences():
    model = GPT(GPTConfig.from_name("tiny", block_size=16))
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="num_subsequences=9"):
        SubsequenceEngine(9).forward_backward(model, ids, ids)
    with pytest.raises(ValueError, match="num_subsequences=0"):
        SubsequenceEngine(0)
    long = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size=16"):
        SubsequenceEngine(2).forward_backward(model, long, long)


def test_autocast_weight_copies_are_shared_by_all_subsequences():
    """One autocast context spans all forwards, so each weight has one bf16 copy, not one per subsequence."""
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, S)
    qkv_shape = model.blocks["0"].attn.qkv.weight.shape
    bf16_weight_copies: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and t.shape in (qkv_shape, qkv_shape[::-1]):  # matmul saves weight.T
            bf16_weight_copies.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        SubsequenceEngine(4).forward_backward(
            model, ids, targets, forward_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16)
        )
    assert len(bf16_weight_copies) == config.n_layer  # one per layer's qkv weight


def test_hooks_see_every_subsequence_in_order():
    calls: list[tuple] = []

    class Recorder:
        def begin_step(self, spans):
            calls.append(("begin", len(spans)))

        def forward_context(self, key):
            calls.append(("ctx", key))
            return nullcontext()

        def after_forward(self, key):
            calls.append(("F", key))

        def before_backward(self, key):
            calls.append(("pre-B", key))

        def after_backward(self, key):
            calls.append(("B", key))

        def end_step(self):
            calls.append(("end",))

    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, S)
    SubsequenceEngine(3, hooks=Recorder()).forward_backward(model, ids, targets)
    forward = [c for i in range(3) for c in (("ctx", (0, i)), ("F", (0, i)))]
    backward = [c for i in (2, 1, 0) for c in (("pre-B", (0, i)), ("B", (0, i)))]
    assert calls == [("begin", 3), *forward, *backward, ("end",)]


def test_a_refused_batch_leaves_the_model_plain():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, 8)
    engine = SubsequenceEngine(3)
    engine.forward_backward(model, ids, targets)
    with pytest.raises(ValueError, match="num_subsequences=3"):
        engine.forward_backward(model, ids[:, :2], targets[:, :2])
    for _ in range(2):  # no cache left bound: the plain forward works, again and again
        model(ids)
