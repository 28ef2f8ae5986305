"""The chunks a shared unit's prefix travels in, and the owner's reads of them (the exchanges run in
tests/distributed: parity, NCCL-order replay and the helpers' bytes)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_sppo.attention.kv_cache import KVCache
from lightning_sppo.attention.kv_spill import KVSpill
from lightning_sppo.parallel.prefix_stream import owner_blocks, owner_grad_blocks, stream_ranges


@given(first=st.integers(0, 60), length=st.integers(0, 60), device=st.integers(0, 80), chunk=st.integers(1, 20))
def test_ranges_tile_the_prefix_in_chunks_that_never_straddle_the_device_part(first, length, device, chunk):
    end = first + length
    ranges = stream_ranges(first, end, (device, chunk))
    assert [a for a, _ in ranges[1:]] == [b for _, b in ranges[:-1]]  # contiguous
    assert (ranges[0][0], ranges[-1][1]) == (first, end) if length else ranges == []
    assert all(0 < b - a <= chunk for a, b in ranges)
    assert not any(a < device < b for a, b in ranges)  # each range wholly on the device or wholly on host
    assert stream_ranges(first, end, None) == ([(first, end)] if length else [])  # no spill: one piece


def _cache(seq_len: int = 20, device_tokens: int = 7, chunk: int = 4) -> tuple[KVCache, torch.Tensor]:
    cache = KVCache(seq_len, spill=KVSpill(device_tokens, chunk))
    kv = torch.arange(seq_len, dtype=torch.float32).view(1, 1, seq_len, 1).expand(1, 2, seq_len, 3).contiguous()
    # Two subsequences, the last one token: later queries add dK/dV to the tokens before it (KVCache.grad_buffers)
    cache.write(0, kv[:, :, :-1], kv[:, :, :-1])
    cache.write(seq_len - 1, kv[:, :, -1:], kv[:, :, -1:])
    return cache, kv


def test_the_owner_reads_each_chunk_as_the_members_expect_it():
    """Forward: one block per range, in order, with the cache's K/V (device part in views, host chunks copied in)."""
    cache, kv = _cache()
    ranges = stream_ranges(2, 19, (7, 4))
    blocks = list(owner_blocks(cache, ranges))
    assert [(b.start, b.start + b.k.shape[2]) for b in blocks] == ranges
    for block in blocks:
        assert torch.equal(block.k, kv[:, :, block.start : block.start + block.k.shape[2]])


def test_the_owners_chunk_gradients_are_written_back():
    """Backward: what is added into each block's dK/dV is in the cache afterwards, on the device and on host."""
    cache, _ = _cache()
    ranges = stream_ranges(2, 19, (7, 4))
    for block in owner_grad_blocks(cache, ranges):
        block.dk.add_(block.start + 1)
    dk, _ = cache.read_grads(0, 20)
    expected = [0, 0] + [a + 1 for a, b in ranges for _ in range(a, b)] + [0]
    assert dk[0, 0, :, 0].tolist() == expected


def test_chunks_other_than_the_caches_are_refused():
    """Members must expect the chunks the owner's cache streams; a mismatch names the function that cuts them."""
    cache, _ = _cache()
    wrong = [(7, 12), (12, 19)]  # the cache streams its host part 4 tokens at a time
    with pytest.raises(RuntimeError, match="stream_ranges no longer matches"):
        list(owner_blocks(cache, wrong))
