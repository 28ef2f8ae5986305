"""The layer order's device bytes against what a real step holds, on CPU, one device (``LayerMajorEngine``).

A tiny GPT runs one step (after a first one that makes the engine's buffers) under a dispatch mode that counts every
storage an op creates while it lives: the peak of those bytes is what the device would hold beyond the model state
(parameters and gradients exist before the step) and the host pools (the checkpoints' and the spilled K/V's, host
memory on a GPU). The planner's ``layer_order_memory`` predicts it as K/V at their peak plus the phase with the most
resident bytes and temporaries (forward, replay, chunk-major; ``planner.layer_order``). The engine's own meter
(``LayerMajorEngine.meter``) gives the K/V + dK/dV part exactly.

On several ranks the same holds per rank with sp > 1 (``layer_order_memory`` of ``LayerOrderSetup(layout=...)``):
``kv_peak_bytes(..., sp)`` is each rank's meter, and each rank's counted peak its phases (what a multi-rank
``LayerMajorEngine`` test compares, once the runtime runs on several ranks).
"""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.partition import spans as to_spans
from lightning_sppo.planner import BUILTIN_PROFILES, CostModel, layer_order, precision_bytes
from lightning_sppo.planner.layer_order import LayerOrderSetup, layer_order_memory
from lightning_sppo.planner.layout import Layout
from lightning_sppo.runtime import LayerMajorEngine
from tests.conftest import make_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see tests/conftest.py

NARROW = dict(n_embd=64, n_head=4, n_query_groups=2, intermediate_size=128)
WIDE = dict(n_embd=128, n_head=8, n_query_groups=2, intermediate_size=448)  # Llama's MLP-to-width ratio
TOLERANCE = (0.80, 1.05)
"""measured / predicted: the prediction may count a block's temporaries on top of a graph that frees as its backward
runs (up to a fifth more where a chunk is the whole sequence), and never less than the step holds beyond 5%."""


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages ops create while this mode is on, as long as they live, and their peak; storages
    that existed before (``ignore``, by data pointer) are not counted, nor their views."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.ignore, self.live, self.peak = ignore, 0, 0
        self._counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or key in self._counted or key in self.ignore:
            return
        self._counted.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)  # storages keep their Python object while they live

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._counted.discard(key)


def _measure(config: GPTConfig, engine: LayerMajorEngine, bf16: bool) -> int:
    """The counted peak of one step (the second: the first makes the engine's buffers and host pools)."""
    torch.manual_seed(0)
    model = GPT(config)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the step adds into them: the model state is not what is measured
    ids, targets = make_batch(config, 1, config.block_size)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    engine.forward_backward(model, ids, targets, forward_context=context)
    ignore = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad)}
    ignore |= {slab.untyped_storage().data_ptr() for slab in _host_slabs(engine)}
    counter = LiveBytes(ignore)
    with counter:
        engine.forward_backward(model, ids, targets, forward_context=context)
    return counter.peak


def _host_slabs(engine: LayerMajorEngine) -> list[torch.Tensor]:
    """The pinned-host pools' slabs (host memory on a GPU; on CPU the same device as the rest)."""
    pools = [engine._checkpoints.pool]
    spill = engine._cache.spill
    if spill is not None and spill._host is not None:
        pools.append(spill._host)
    return [slab for pool in pools for slab in pool._slabs]


def _predicted(config: GPTConfig, engine: LayerMajorEngine, bf16: bool):
    dtypes = precision_bytes("bf16-mixed" if bf16 else "fp32")
    costs = CostModel(config, dtypes, BUILTIN_PROFILES["h100"], optimizer=False)
    plan = engine.plan(torch.zeros(1, config.block_size, dtype=torch.long), config)  # the cut the step ran
    setup = LayerOrderSetup(engine.recompute, engine.offload, plan.kv_device_tokens, plan.kv_chunk_tokens)
    return layer_order_memory(costs, plan.spans, setup)


HEADS = dict(n_embd=64, n_head=4, n_query_groups=2, head_size=64, intermediate_size=128)  # wide heads: large dq sums
CASES = [
    # (seq_len, chunks, recompute, offload, kv_device_tokens, kv_chunk_tokens, bf16, dims): the replay's peak
    # (few long chunks), the chunk-major loop's (many), K/V on host in chunks straddling the layer chunks
    (1024, 2, "full", "none", None, 128, False, NARROW),
    (2048, 4, "selective", "full", 0, 256, True, WIDE),
    (2048, 16, "full", "full", 0, 128, False, NARROW),
    (2048, 8, "full", "full", 500, 200, True, NARROW),
    (1024, 8, "full", "full", 0, 128, False, HEADS),
]


@pytest.mark.parametrize(("seq_len", "chunks", "recompute", "offload", "kv", "kv_chunk", "bf16", "dims"), CASES)
def test_a_step_holds_what_the_planner_counts(seq_len, chunks, recompute, offload, kv, kv_chunk, bf16, dims):
    config = GPTConfig(n_layer=2, vocab_size=64, block_size=seq_len, **dims)
    engine = LayerMajorEngine(chunks, recompute=recompute, offload=offload, kv_device_tokens=kv,
                              kv_chunk_tokens=kv_chunk, attention="sdpa")  # fmt: skip
    measured = _measure(config, engine, bf16)
    memory = _predicted(config, engine, bf16)
    assert engine.meter.peak == memory.kv_cache
    ratio = measured / (memory.kv_cache + memory.activations + memory.transient)
    assert TOLERANCE[0] <= ratio <= TOLERANCE[1], ratio


def test_negative_control_without_the_dq_sums_the_count_falls_short(monkeypatch):
    """Where the chunk-major loop holds the peak (many chunks), leaving out its fp32 dq sums (as if they never
    coexisted with the rest of the working set) predicts less than the step holds."""
    config = GPTConfig(n_layer=2, vocab_size=64, block_size=2048, **HEADS)
    engine = LayerMajorEngine(8, recompute="full", offload="full", kv_device_tokens=0, kv_chunk_tokens=256,
                              attention="sdpa")  # fmt: skip
    measured = _measure(config, engine, True)
    monkeypatch.setattr(layer_order, "working_bytes_per_token", _without_dq(layer_order.working_bytes_per_token))
    monkeypatch.setattr(layer_order, "dq_bytes_per_token", lambda config: 0)
    memory = _predicted(config, engine, True)
    assert measured / (memory.kv_cache + memory.activations + memory.transient) > TOLERANCE[1]


def _without_dq(working):
    return lambda config, dtypes, recompute: working(config, dtypes, recompute) - 4 * config.n_head * config.head_size


def test_per_rank_bytes_are_counted_per_rank():
    """The structure a multi-rank test reads: on each of sp ranks, K/V, the checkpoints on host and the spilled K/V are
    a 1/sp share of one rank's; the phases hold about that share (a chunk's graph also keeps Ulysses' copy)."""
    config = GPTConfig(n_layer=3, vocab_size=64, block_size=4096, **WIDE)
    costs = CostModel(config, precision_bytes("bf16-mixed", sharded=True), BUILTIN_PROFILES["h100"], optimizer=False)
    spans = to_spans([1024] * 4)
    one = layer_order_memory(costs, spans, LayerOrderSetup("full", "full", 0, 512))
    two = layer_order_memory(costs, spans, LayerOrderSetup("full", "full", 0, 512, layout=Layout(2, 1, 1)))
    assert two.kv_cache * 2 == one.kv_cache and two.host * 2 == one.host and two.host_kv * 2 == one.host_kv
    assert 0.5 * one.activations <= two.activations < 0.55 * one.activations
