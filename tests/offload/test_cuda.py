"""The CUDA path: side-stream copies into pinned memory, events instead of synchronizes (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from lightning_sppo import GPT
from lightning_sppo.offload import build_offloader
from lightning_sppo.offload.streams import CudaCopies
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import make_batch, parity_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def grads_after_step(model, ids, targets, hooks, steps=1):
    engine = SubsequenceEngine(5, "flops", hooks=hooks)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        engine.forward_backward(model, ids, targets)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["full", "adaptive"])
def test_cuda_offload_is_bit_identical_and_uses_a_side_stream(policy):
    config = parity_config(gqa=True)
    model = GPT(config).cuda()
    ids, targets = (t.cuda() for t in make_batch(config, 2, 45))
    reference = grads_after_step(model, ids, targets, None)
    offloader = build_offloader(policy, "cuda", min_bytes=0)
    assert isinstance(offloader.copies, CudaCopies) and offloader.pool.pin_memory
    grads = grads_after_step(model, ids, targets, offloader, steps=3)
    for name, grad in grads.items():
        assert torch.equal(grad, reference[name]), name
    stats = offloader.last_stats
    assert stats.offloaded_bytes > 0 and stats.wait_s is not None and stats.wait_s >= 0
    capacity = offloader.pool.capacity_bytes
    grads_after_step(model, ids, targets, offloader, steps=2)
    assert offloader.pool.capacity_bytes == capacity
    offloader.release()
    assert offloader.pool.capacity_bytes == 0
