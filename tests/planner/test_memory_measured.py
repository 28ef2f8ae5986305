"""The planner's memory prediction against what a real step holds, on CPU, one device, no offload.

A tiny GPT runs ``SubsequenceEngine`` (forward 0..N-1 under a saved-tensor byte counter, as
``benchmarks/activation_memory.py`` does, then backward N-1..0 and an AdamW step). What the step holds at its
peak, the start of backward, is measured piece by piece from real tensors: parameters, gradients, AdamW
state, the K/V cache with its dK/dV buffers, and the saved activations. The planner predicts the same
configuration through the solver's own path (``planner.evaluate`` with layout sp = pp = dp = 1 and the
exact partition); temporaries and the reserve are excluded on both sides.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.planner import CostModel, Layout, precision_bytes
from lightning_sppo.planner.evaluate import Evaluation, Limits, evaluate
from lightning_sppo.planner.layout import placement, stage_specs
from lightning_sppo.runtime import SubsequenceEngine
from tests.planner.conftest import UNLIMITED

SEQ_LEN = 512


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see tests/conftest.py


class SavedBytes:
    """Distinct non-parameter storages saved for backward (parameters and their autocast copies skipped)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.total = self.casts = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            if _is_param_cast(t):
                self.casts += storage.nbytes()
            else:
                self.total += storage.nbytes()
        return t


def _is_param_cast(t: torch.Tensor) -> bool:
    fn = (t._base if t._base is not None else t).grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions if f is not None)


def measure_step(config: GPTConfig, n: int, partition: str, autocast: bool) -> dict[str, int]:
    """Run one step; return what it held, by owner, and the partition it used."""
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(config.vocab_size, (1, SEQ_LEN))
    targets = torch.randint(config.vocab_size, (1, SEQ_LEN))
    engine = SubsequenceEngine(num_subsequences=n, partition=partition)
    meter = SavedBytes(model)
    state = engine.begin(model, ids, targets)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
    with context, torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        for i in range(n):
            engine.forward(state, i)
    for i in reversed(range(n)):
        engine.backward(state, i)
    level1 = engine.cache_peak_nbytes()  # K/V and the dK/dV buffers at their most (during the backward)
    engine.end(state)
    optimizer.step()
    optimizer_state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "weights": sum(p.nbytes for p in model.parameters()) + meter.casts,
        "gradients": sum(p.grad.nbytes for p in model.parameters()),
        "optimizer": sum(t.nbytes for t in optimizer_state if t.dim() > 0),  # the scalar step counters are ~0
        "level1": level1,
        "saved": meter.total,
        "partition": [length for _, length in state.spans],
    }


def predict(config: GPTConfig, partition: list[int], precision: str) -> Evaluation:
    costs = CostModel(config, precision_bytes(precision), UNLIMITED)
    layout = Layout(sp=1, pp=1, dp=1)
    return evaluate(
        costs, layout, placement(layout, 8), stage_specs(config, 1), partition,
        Limits(UNLIMITED.hbm_bytes, UNLIMITED.host_bytes_per_gpu),
    )  # fmt: skip


@pytest.mark.parametrize(("n", "partition"), [(1, "length"), (4, "flops"), (8, "length")])
def test_fp32_peak_within_ten_percent(n, partition):
    config = GPTConfig.from_name("tiny-gqa")
    measured = measure_step(config, n, partition, autocast=False)
    evaluation = predict(config, measured["partition"], "fp32")
    assert evaluation.policy == "none" and evaluation.stages[0].offload.alpha == (0.0,) * n
    memory = evaluation.stages[0].memory
    total = sum(v for k, v in measured.items() if k != "partition")
    assert abs(memory.resident_bytes - total) <= 0.10 * total, (memory, measured)
    # The parts, each closer than the whole needs to be.
    assert memory.weights == measured["weights"]
    assert memory.gradients == measured["gradients"]
    assert memory.optimizer == measured["optimizer"]
    assert memory.level1_bytes == measured["level1"]
    assert abs(memory.activations + memory.boundary - measured["saved"]) <= 0.01 * measured["saved"]


def test_bf16_autocast_peak_within_ten_percent():
    """CPU autocast makes the same bf16 copies CUDA autocast does (linears, RoPE tables, SwiGLU's two inputs)."""
    config = GPTConfig.from_name("tiny-gqa")
    measured = measure_step(config, 4, "flops", autocast=True)
    memory = predict(config, measured["partition"], "bf16-mixed").stages[0].memory
    total = sum(v for k, v in measured.items() if k != "partition")
    assert abs(memory.resident_bytes - total) <= 0.10 * total, (memory, measured)
    assert memory.weights == measured["weights"]  # fp32 parameters plus the cached bf16 copies of the linears
    assert abs(memory.activations + memory.boundary - measured["saved"]) <= 0.01 * measured["saved"]
