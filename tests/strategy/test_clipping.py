"""Global-norm clipping on one process: the same norm and scaling as torch's, and ranks without gradients."""

import pytest
import torch

from lightning_sppo.strategy.clipping import clip_grad_norm_


def _parameters(sizes: list[int], seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf")])
def test_norm_and_scaling_match_torch_with_an_empty_shard(norm_type):
    """An FSDP rank can hold an empty shard of a small parameter: it has no max, yet must not break the norm."""
    ours, reference = _parameters([5, 0, 7]), _parameters([5, 7])  # torch's own inf-norm rejects the empty one
    norm = clip_grad_norm_(ours, max_norm=0.5, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm=0.5, norm_type=norm_type)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    assert expected.item() > 0.5  # the gradients really were scaled
    for a, b in zip([ours[0], ours[2]], reference, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=0)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_a_rank_without_gradients_reduces_on_its_parameters_device(norm_type):
    """Under NCCL every rank's contribution to the all-reduce must live on its GPU, gradients or not: the
    meta device stands in for it here (a CPU zero would be the bug)."""
    params = [torch.nn.Parameter(torch.empty(3, device="meta"))]
    norm = clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type, error_if_nonfinite=False)
    assert norm.device.type == "meta"


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_fp64_gradients_are_clipped_by_their_fp64_norm(norm_type):
    """A model trained in fp64 (Fabric's precision="64-true") has fp64 gradients: the norm is theirs, in fp64 (it was
    a RuntimeError from the fp32 norm of fp64 tensors)."""
    ours, reference = _parameters([5, 7]), _parameters([5, 7])
    for p in (*ours, *reference):
        p.data, p.grad = p.data.double(), p.grad.double()
    norm = clip_grad_norm_(ours, max_norm=0.5, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm=0.5, norm_type=norm_type)
    assert norm.dtype == torch.float64 and norm.item() == pytest.approx(expected.item(), rel=1e-12)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)
