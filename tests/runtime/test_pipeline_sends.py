"""The pipeline runtime releases each sent tensor once its send completes, not when the step ends.

One process runs the last of two stages; ``torch.distributed``'s isend and irecv are replaced by works
whose completion the test controls (gloo's send works report completion only once waited, so a real
gloo run cannot show the release). Like NCCL's, a send work holds its tensor until it is dropped.
"""

import weakref

import pytest
import torch
import torch.distributed as dist

from lightning_sppo import GPT
from lightning_sppo.parallel import ParallelDims
from lightning_sppo.parallel.parallelize import build_stage
from lightning_sppo.runtime.pipeline import PipelineGroups, PipelineRuntime
from lightning_sppo.step_plan import StepPlan
from tests.conftest import make_batch, parity_config


class _Work:
    """A send or receive that completes after ``polls`` calls of ``is_completed`` (never if None); ``wait``
    notes ``name`` in ``waits``."""

    def __init__(self, tensor: torch.Tensor, polls: int | None, name: int = 0, waits: list | None = None) -> None:
        self.tensor, self.polls, self.name, self.waits = tensor, polls, name, waits

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        if self.waits is not None:
            self.waits.append(self.name)
        return True


def _last_stage_step(monkeypatch, polls: int | None) -> tuple[list[int], list[int]]:
    """One seq1f1b step of stage 1 of 2 (N=4): at each send, how many earlier sent tensors were still alive;
    and which sends were waited on."""
    sent: list[weakref.ref] = []
    alive_at_send: list[int] = []
    waits: list[int] = []

    def isend(tensor, dst=None, group=None):
        assert (dst, group) == (0, "gradients"), (dst, group)
        alive_at_send.append(sum(ref() is not None for ref in sent))
        sent.append(weakref.ref(tensor))
        return _Work(tensor, polls, len(sent) - 1, waits)

    def irecv(tensor, src=None, group=None):
        assert (src, group) == (0, "activations"), (src, group)
        tensor.copy_(torch.randn(tensor.shape))
        return _Work(tensor, 0)

    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "irecv", irecv)
    config = parity_config(gqa=True, n_layer=2)
    stage = build_stage(GPT(config), 1, ParallelDims(2, 1, 1), torch.device("cpu"), None)
    groups = PipelineGroups(
        pp=2, sp=1, pp_rank=1, sp_rank=0, pp_global_ranks=[0, 1], dp_group=None, world_group=None,
        links={(0, 1): "activations", (1, 0): "gradients"},
    )  # fmt: skip
    ids, targets = make_batch(config, 1, 48)
    PipelineRuntime(stage, groups).step(ids, targets, StepPlan((12,) * 4))
    return alive_at_send, waits


def test_sent_gradients_are_released_when_their_send_completes(monkeypatch):
    alive_at_send, waits = _last_stage_step(monkeypatch, polls=0)
    assert alive_at_send == [0, 0, 0, 0]
    assert waits == []  # none left to wait for at the end


def test_unfinished_sends_are_kept_and_waited_at_the_end(monkeypatch):
    """Negative control: sends that never report completion keep every sent tensor until the step ends."""
    alive_at_send, waits = _last_stage_step(monkeypatch, polls=None)
    assert alive_at_send == [0, 1, 2, 3]
    assert waits == [0, 1, 2, 3]


def test_a_stage_without_its_links_is_refused():
    stage = build_stage(GPT(parity_config(n_layer=2)), 1, ParallelDims(2, 1, 1), torch.device("cpu"), None)
    groups = PipelineGroups(pp=2, sp=1, pp_rank=1, sp_rank=0, pp_global_ranks=[0, 1], dp_group=None, world_group=None)
    with pytest.raises(ValueError, match=r"lacks \[\(1, 0\), \(0, 1\)\].*pipeline_links"):
        PipelineRuntime(stage, groups)
