"""A step's plan is a value (``lightning_sppo.step_plan``): made once per batch, handed to the engines and the
pipeline runtime, which run it as told, ask nobody, and set none of their attributes while they do. (Several
devices: ``tests/distributed/workers.py``'s parity worker runs every layout's step under the same guard.)"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric

from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.documents import Documents
from lightning_sppo.runtime import LayerMajorEngine, SubsequenceEngine
from lightning_sppo.step_plan import StepPlan, StepSettings, decide, decide_cut
from tests.conftest import (
    document_ids_from_lengths,
    make_batch,
    max_relative_error,
    no_attribute_set,
    parity_config,
    plain_loss_and_grads,
)

ORDERS = {
    "subsequence": dict(num_subsequences=3, partition="flops"),
    "layer": dict(num_subsequences=3, partition="flops", order="layer", recompute="selective"),
}
BATCHES = [(45, None), (40, None), (45, [[10, 35], [30, 15]])]
"""(tokens, documents per row): each batch is cut its own way."""


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_strategy_step_sets_no_attribute_of_the_engine(order):
    config = parity_config(gqa=True)
    fabric = Fabric(strategy=SPPOStrategy(**ORDERS[order]), accelerator="cpu", devices=1)
    fabric.launch()
    model, strategy = fabric.setup(GPT(config)), fabric.strategy
    ids, targets = make_batch(config, 2, 45)
    strategy.forward_backward(model, ids, targets)  # the first step allocates what the engine keeps (its caches)
    cuts = set()
    with no_attribute_set(strategy.engine):
        for seq_len, documents in BATCHES:
            ids, targets = make_batch(config, 2, seq_len)
            document_ids = None if documents is None else document_ids_from_lengths(documents)
            strategy.forward_backward(model, ids, targets, document_ids)
            strategy.evaluate(model, ids, targets, document_ids)
            cuts.add(strategy.core.last_plan.lengths)
    assert len(cuts) == len(BATCHES), cuts  # three plans ran, none of them set on the engine


def test_the_guard_catches_an_engine_that_records_its_step():
    """Negative control: an engine that keeps the lengths it ran (as the engines did before step plans)."""

    class Recording(SubsequenceEngine):
        def begin(self, *args, **kwargs):
            state = super().begin(*args, **kwargs)
            self.last_lengths = [length for _, length in state.spans]
            return state

    config = parity_config()
    model, engine = GPT(config), Recording(3)
    ids, targets = make_batch(config, 1, 45)
    engine.forward_backward(model, ids, targets)
    with no_attribute_set(engine), pytest.raises(AttributeError, match="Recording.last_lengths was set during a step"):
        engine.forward_backward(model, ids, targets)


@pytest.mark.parametrize("engine", [SubsequenceEngine(5), LayerMajorEngine(5)], ids=["subsequence", "layer"])
def test_an_engine_runs_the_plan_it_is_given_and_asks_for_none(engine, monkeypatch):
    """An uneven cut no policy makes, with spill: the plain model's loss and gradients, and no plan of its own."""
    config = parity_config(gqa=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 45)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    order = "layer" if isinstance(engine, LayerMajorEngine) else "subsequence"
    plan = StepPlan((5, 30, 10), order, kv_device_tokens=12, kv_chunk_tokens=7)
    monkeypatch.setattr(decide, "decide_cut", lambda *args: pytest.fail("the engine cut the batch itself"))
    told = []
    if isinstance(engine, SubsequenceEngine):  # what the offloader is told: the plan's spans
        monkeypatch.setattr(engine, "hooks", _Spans(told))
    loss = engine.forward_backward(model, ids, targets, plan=plan)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert max_relative_error(ref_grads, model)[0] < 1e-5
    assert engine.cache_host_nbytes() > 0  # the plan's spill: K/V beyond 12 tokens lived on host
    assert told == ([[(0, 5), (5, 30), (35, 10)]] if order == "subsequence" else [])


def test_a_plan_for_another_batch_or_order_is_refused():
    config = parity_config()
    ids, targets = make_batch(config, 2, 45)
    for engine, plan in [
        (SubsequenceEngine(), StepPlan((20, 20))),
        (SubsequenceEngine(), StepPlan((45,), "layer")),
        (LayerMajorEngine(), StepPlan((45,))),
        (SubsequenceEngine(), StepPlan((45,), num_microbatches=3)),
    ]:
        with pytest.raises(ValueError, match="make the plan from this batch"):
            engine.forward_backward(GPT(config), ids, targets, plan=plan)


def test_a_plan_splits_each_span_over_the_sequence_parallel_ranks():
    plan = StepPlan([8, 4, 4])
    assert plan.spans == [(0, 8), (8, 4), (12, 4)] and plan.seq_len == 16
    assert plan.shard(2, 0) == [(0, 4), (8, 2), (12, 2)]
    assert plan.shard(2, 1) == [(4, 4), (10, 2), (14, 2)]
    assert plan.spill == (None, None) and StepPlan((16,), kv_device_tokens=4).spill == (4, 16384)


def test_the_cut_is_final_unless_documents_or_unsettled_adaptive_lengths_decide_it():
    config = parity_config()
    flops = StepSettings(num_subsequences=3, partition="flops")
    assert decide_cut(45, 1, flops, config).final
    packed = Documents.from_ids(document_ids_from_lengths([[10, 35]]))
    assert not decide_cut(45, 1, flops, config, packed).final
    assert decide_cut(45, 1, StepSettings(num_subsequences=3), config, packed).final  # "length" ignores them
    planned = decide_cut(45, 1, StepSettings(num_subsequences="auto"), config, planner=lambda s, b, g: (2, "flops", 5))
    assert len(planned.lengths) == 2 and all(n % 5 == 0 for n in planned.lengths)
    chunks = decide_cut(40000, 1, StepSettings(order="layer", num_subsequences="auto"), config)
    assert chunks.lengths == [13334, 13333, 13333]  # order="layer": chunks of at most 16K tokens
    layer_sp = StepSettings(order="layer", num_subsequences="auto", granularity=4, sequence_parallel=4)
    split = decide_cut(4 * 40000, 1, layer_sp, config)  # 16K tokens per sequence-parallel rank, not per chunk
    assert split.lengths == [53336, 53332, 53332] and all(n % 4 == 0 for n in split.lengths)


class _Spans:
    """Hooks that record what the step tells the offloader at its start."""

    def __init__(self, told: list) -> None:
        self.told = told

    def begin_step(self, spans) -> None:
        self.told.append(list(spans))

    def forward_context(self, key):
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def after_forward(self, key) -> None: ...

    def before_backward(self, key) -> None: ...

    def after_backward(self, key) -> None: ...

    def end_step(self) -> None: ...
