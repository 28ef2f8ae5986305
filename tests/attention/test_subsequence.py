"""Subsequence attention over the K/V cache, whole sequences at a time, against dense fp64 attention."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo.attention import KVCache, ReferenceKernel, SDPAKernel, merge_partials, subsequence_attention
from lightning_sppo.partition import spans as to_spans
from tests.attention.dense import dense_attention_fp64


def _run(q, k, v, lengths, kernel, backward_order="reverse", strict=True, seed=1, cache=None):
    """Attention of every subsequence over the cache; backward in the given order. Returns out, grads."""
    cache = KVCache(q.shape[2], strict=strict) if cache is None else cache
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    gen = torch.Generator().manual_seed(seed)
    douts = torch.randn(q.shape, generator=gen, dtype=q.dtype)
    outs = []
    for off, n in to_spans(lengths):
        rows = slice(off, off + n)
        # Fresh leaves per subsequence: graphs must not connect except through the cache.
        outs.append(subsequence_attention(leaves[0][:, :, rows], leaves[1][:, :, rows], leaves[2][:, :, rows],
                                          cache, off, kernel))  # fmt: skip
    order = range(len(outs))
    for i in reversed(order) if backward_order == "reverse" else order:
        off, n = to_spans(lengths)[i]
        outs[i].backward(douts[:, :, off : off + n])
    return torch.cat([o.detach() for o in outs], dim=2), [x.grad for x in leaves], douts


def _reference(q, k, v, douts):
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = dense_attention_fp64(*leaves)
    out.backward(douts.double())
    return out.detach(), [x.grad for x in leaves]


def _rel(a, b):
    """Relative error, absolute where the reference is below 1 (one-token sequences have dK = 0)."""
    return ((a.double() - b).norm() / b.norm().clamp(min=1.0)).item()


@pytest.mark.parametrize("kernel", [ReferenceKernel(), SDPAKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("lengths", [[23], [12, 11], [5, 9, 1, 8], [1] * 23])
@pytest.mark.parametrize("groups", [4, 1])
def test_subsequences_reproduce_full_attention(kernel, lengths, groups):
    q, k, v = torch.randn(2, 4, 23, 8), torch.randn(2, groups, 23, 8), torch.randn(2, groups, 23, 8)
    out, grads, douts = _run(q, k, v, lengths, kernel)
    ref_out, ref_grads = _reference(q, k, v, douts)
    assert _rel(out, ref_out) < 1e-5
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) < 1e-5


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    groups=st.sampled_from([1, 2, 4]),
    batch=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_random_partitions_reproduce_full_attention(lengths, groups, batch, seed):
    torch.manual_seed(seed)
    S = sum(lengths)
    q, k, v = torch.randn(batch, 4, S, 8), torch.randn(batch, groups, S, 8), torch.randn(batch, groups, S, 8)
    out, grads, douts = _run(q, k, v, lengths, SDPAKernel(), seed=seed)
    ref_out, ref_grads = _reference(q, k, v, douts)
    assert _rel(out, ref_out) < 1e-5
    assert max(_rel(g, r) for g, r in zip(grads, ref_grads, strict=True)) < 1e-5


def test_negative_control_forward_order_backward_gives_wrong_gradients():
    """Without the reverse order, dK/dV of early subsequences miss later contributions."""
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 4, 20, 8), torch.randn(1, 4, 20, 8)
    _, grads, douts = _run(q, k, v, [5, 5, 5, 5], SDPAKernel(), backward_order="forward", strict=False)
    _, ref_grads = _reference(q, k, v, douts)
    assert _rel(grads[0], ref_grads[0]) < 1e-5  # dq only depends on the forward: still right
    assert _rel(grads[1], ref_grads[1]) > 1e-2 and _rel(grads[2], ref_grads[2]) > 1e-2


def test_strict_cache_rejects_wrong_backward_order():
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8)
    with pytest.raises(RuntimeError, match="out of order"):
        _run(q, k, v, [5, 5], SDPAKernel(), backward_order="forward")


def test_strict_cache_rejects_gaps_in_forward():
    cache = KVCache(10)
    with pytest.raises(RuntimeError, match="offset 0 next, got offset=5"):
        subsequence_attention(*(torch.randn(1, 2, 5, 8) for _ in range(3)), cache, 5, SDPAKernel())


def test_merge_partials_equals_attention_over_the_union():
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 14, 8), torch.randn(1, 2, 14, 8)
    kernel = ReferenceKernel()
    out_a, lse_a = kernel.forward(q, k[:, :, :9], v[:, :, :9], False, 0.3)
    out_b, lse_b = kernel.forward(q, k[:, :, 9:], v[:, :, 9:], False, 0.3)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    want, want_lse = kernel.forward(q, k, v, False, 0.3)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_bf16_partials_merge_in_fp32():
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.bfloat16) for _ in range(3))
    out, grads, douts = _run(q, k, v, [16] * 4, SDPAKernel())
    ref_out, _ = _reference(q, k, v, douts)
    assert _rel(out, ref_out) < 1e-2


def test_bf16_kv_gradients_are_opt_in_smaller_and_lose_accuracy_with_n():
    """kv_grad_dtype="bf16": 2/3 of the level-1 bytes; dK/dV error grows with N where fp32's does not."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 512, 32, dtype=torch.bfloat16) for _ in range(3))
    errors, nbytes = {}, {}
    for name, grad_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        cache = KVCache(q.shape[2], grad_dtype=grad_dtype)
        _, grads, douts = _run(q, k, v, [4] * 128, SDPAKernel(), cache=cache)
        _, ref_grads = _reference(q, k, v, douts)
        errors[name] = [_rel(g, r) for g, r in zip(grads, ref_grads, strict=True)]
        nbytes[name] = cache.peak_nbytes()
        assert cache.grad_buffers()[0].dtype == (grad_dtype or torch.float32)
    per_token = 4 * 32  # G x Dh elements
    kv = 2 * 2 * 512 * per_token  # bf16 K, V of the whole sequence
    grads = 508 * per_token  # dK/dV of [0, o_last): the last subsequence's tokens never receive any
    assert nbytes["fp32"] == kv + 2 * 4 * grads and nbytes["bf16"] == kv + 2 * 2 * grads
    assert errors["bf16"][0] == errors["fp32"][0]  # dq never touches the buffers
    assert errors["fp32"][1] < 5e-3 and errors["fp32"][2] < 5e-3  # bf16 inputs' rounding only
    assert errors["bf16"][1] > 1.5 * errors["fp32"][1] and errors["bf16"][2] > 1.5 * errors["fp32"][2]
    assert max(errors["bf16"]) < 3e-2  # lossy, not broken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_partials_leaves_its_inputs_alone(dtype):
    """The merge works in one fp32 buffer in place; that buffer must never be a caller's tensor."""
    out_a, out_b = (torch.randn(1, 2, 5, 8, dtype=dtype) for _ in range(2))
    lse_a, lse_b = torch.randn(1, 2, 5), torch.randn(1, 2, 5)
    copies = [t.clone() for t in (out_a, lse_a, out_b, lse_b)]
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert all(torch.equal(t, c) for t, c in zip((out_a, lse_a, out_b, lse_b), copies, strict=True))
    w_a, w_b = torch.exp(lse_a - lse)[..., None], torch.exp(lse_b - lse)[..., None]
    torch.testing.assert_close(out, (w_a * out_a.float() + w_b * out_b.float()).to(dtype))
