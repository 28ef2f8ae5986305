"""Each kernel backend alone against dense fp64 attention: forward, log-sum-exp and backward."""

import math

import pytest
import torch

from lightning_sppo.attention import ReferenceKernel, SDPAKernel, select_kernel
from tests.attention.dense import dense_attention_fp64

KERNELS = [ReferenceKernel(), ReferenceKernel(block_q=3), SDPAKernel()]


def _inputs(B, H, G, sq, sk, D=16, dtype=torch.float32):
    q = torch.randn(B, H, sq, D, dtype=dtype)
    k = torch.randn(B, G, sk, D, dtype=dtype)
    v = torch.randn(B, G, sk, D, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k.name}")
@pytest.mark.parametrize(("causal", "sq", "sk"), [(True, 13, 13), (False, 7, 19), (False, 19, 5)])
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_kernel_matches_dense_fp64(kernel, causal, sq, sk, groups):
    q, k, v = _inputs(2, 4, groups, sq, sk)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = kernel.forward(q, k, v, causal, scale)

    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref = dense_attention_fp64(qr, kr, vr, causal)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)

    scores = q.double() @ k.double().repeat_interleave(4 // groups, 1).transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)

    dq, dk, dv = kernel.backward(dout.to(q.dtype), q, k, v, out, lse, causal, scale)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k.name}")
def test_kernel_in_bf16_is_close(kernel):
    q, k, v = _inputs(1, 4, 2, 16, 16, dtype=torch.bfloat16)
    out, lse = kernel.forward(q, k, v, True, 0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = dense_attention_fp64(q, k, v, True)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_select_kernel_names_the_setting():
    with pytest.raises(ValueError, match="attention='triton'"):
        select_kernel("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="flash_attn"):
        select_kernel("flash_attn", torch.device("cpu"))
    assert select_kernel("auto", torch.device("cpu")).name == "sdpa"
