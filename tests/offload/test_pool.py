"""The host buffer pool: flat over many steps, empty after release, and clear errors about host memory."""

from __future__ import annotations

import pytest
import torch

from lightning_sppo import GPT
from lightning_sppo.offload import HostMemoryError, HostPool, Offloader, check_host_memory
from lightning_sppo.offload import pool as pool_module
from lightning_sppo.runtime import SubsequenceEngine
from tests.conftest import make_batch, parity_config


@pytest.mark.parametrize("policy", ["full", "adaptive"])
def test_host_pool_is_flat_over_50_steps_and_empty_after_release(policy):
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, 45)
    offloader = Offloader(policy, "cpu", min_bytes=0, slab_bytes=4096)  # small slabs: several of them
    engine = SubsequenceEngine(5, "flops", hooks=offloader)
    capacity, slabs = [], []
    for _ in range(50):
        model.zero_grad(set_to_none=True)
        engine.forward_backward(model, ids, targets)
        capacity.append(offloader.pool.capacity_bytes)
        slabs.append(offloader.pool.num_slabs)
        assert offloader.pool.used_bytes == 0  # every slice handed back at the end of the step
    assert capacity[0] > 0 and slabs[0] > 1
    assert set(capacity) == {capacity[0]} and set(slabs) == {slabs[0]}  # no growth after the first step
    assert offloader.last_stats.host_pool_bytes == capacity[0]
    offloader.release()
    assert offloader.pool.capacity_bytes == 0 and offloader.pool.num_slabs == 0


def test_slices_are_aligned_distinct_and_reused_in_the_same_order():
    pool = HostPool(slab_bytes=4096)
    first = [pool.take(n, torch.float32) for n in (10, 300, 2000, 7)]
    assert [t.numel() for t in first] == [10, 300, 2000, 7]
    assert all(t.data_ptr() % 64 == 0 for t in first)  # slices start on 512-byte offsets of 64-aligned slabs
    assert len({t.data_ptr() for t in first}) == 4
    pool.reset()
    again = [pool.take(n, torch.float32) for n in (10, 300, 2000, 7)]
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]
    # The 8000-byte request got a slab of its own (a power of two); the cursor only moves forward, so the last
    # request went to a third slab. The same requests next step land in the same places: no growth.
    assert pool.capacity_bytes == 4096 + 8192 + 4096


def test_not_enough_host_memory_names_offload_and_the_bytes(monkeypatch):
    monkeypatch.setattr(pool_module, "available_host_bytes", lambda: 1000)
    with pytest.raises(HostMemoryError, match=r"offload needs 5000 more bytes .* only 1000 bytes .*available"):
        check_host_memory(5000)
    offloader = Offloader("full", "cpu", min_bytes=0)
    with pytest.raises(HostMemoryError, match=r"offload='full' needs \d+ more bytes"):
        offloader.reserve(2**30)

    config = parity_config()
    ids, targets = make_batch(config, 1, 45)
    engine = SubsequenceEngine(3, hooks=offloader)
    with pytest.raises(HostMemoryError, match="offload='full'"):
        engine.forward_backward(GPT(config), ids, targets)
    assert offloader.pool.capacity_bytes == 0


def test_an_allocator_failure_is_reported_as_host_memory(monkeypatch):
    def failing_empty(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(pool_module.torch, "empty", failing_empty)
    with pytest.raises(HostMemoryError, match="offload='full' could not allocate .* can't allocate memory"):
        HostPool(setting="offload='full'").take(10, torch.float32)


def test_reserve_before_the_run_then_no_growth():
    pool = HostPool(slab_bytes=4096)
    pool.reserve(10_000)
    assert pool.capacity_bytes >= 10_000
    reserved = pool.capacity_bytes
    for _ in range(3):
        [pool.take(1000, torch.float32) for _ in range(2)]
        pool.reset()
    assert pool.capacity_bytes == reserved
