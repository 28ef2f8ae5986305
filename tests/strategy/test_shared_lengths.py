"""Every rank cuts the sequence as rank 0 does, whatever its own costs and device say (``step_plan/agree.py``).

Two gloo processes form a two-stage pipeline. Each is fed its own offload costs (for ``partition="adaptive"``)
or its own hardware profile (for ``num_subsequences="auto"``), chosen so that the two would cut differently:
the negative control asks each rank's own policy and sees the difference; the step itself must run on rank
0's lengths everywhere and give the plain model's loss.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric

from lightning_sppo import GPT, GPTConfig, SPPOStrategy
from lightning_sppo.offload import OffloadCallback, OffloadCosts
from lightning_sppo.partition import flops
from lightning_sppo.partition import spans as to_spans
from lightning_sppo.planner import BUILTIN_PROFILES
from lightning_sppo.step_plan.agree import LengthChoice, SharedLengths
from tests.conftest import make_batch, parity_config, plain_loss_and_grads
from tests.distributed.harness import run_distributed

S, N = 64, 4
AUTO_SEQ_LEN = 8192
AUTO_CONFIG = GPTConfig.from_name("tiny-gqa", block_size=AUTO_SEQ_LEN)
PROFILE_MIB = (80, 65)
"""Rank 0's and rank 1's GPU memory: on their own they plan N=2 (flops) and N=3 (length) for AUTO_CONFIG."""


def _costs(rank: int) -> OffloadCosts:
    """Measured-looking costs of the flops partition: rank 0 copies fast (flops lengths), rank 1 slowly."""
    base = flops(S, N, 1, config=parity_config(gqa=True, n_layer=2))
    bandwidth = 1e12 if rank == 0 else 1e2
    return OffloadCosts(d2h_bytes_per_s=bandwidth, forward_s=(1.0,) * N, spans=tuple(to_spans(base)),
                        level2_bytes=(1000,) * N)  # fmt: skip


def _gathered(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _fabric(**settings) -> Fabric:
    fabric = Fabric(strategy=SPPOStrategy(pipeline_parallel=2, **settings), accelerator="cpu", devices=2)
    fabric.launch()
    return fabric


def adaptive_lengths_agree(rank: int, world_size: int) -> None:
    config = parity_config(gqa=True, n_layer=2)
    torch.manual_seed(0)
    plain = GPT(config)
    ids, targets = make_batch(config, 1, S)
    ref_loss, _ = plain_loss_and_grads(plain, ids, targets)
    offload = OffloadCallback("adaptive", costs=_costs(rank), min_bytes=0)
    fabric = _fabric(num_subsequences=N, partition="adaptive", offload=offload)
    stage = fabric.setup(copy.deepcopy(plain))
    own = offload.offloader.partition(S, N, 1, config)  # what this rank would cut on its own costs
    loss = fabric.strategy.forward_backward(stage, ids, targets)
    used = list(fabric.strategy.core.last_plan.lengths)

    owns, useds = _gathered(own), _gathered(used)
    assert owns[0] != owns[1], owns  # negative control: the costs alone would split the ranks
    assert useds == [owns[0], owns[0]], (useds, owns)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (rank, loss.item(), ref_loss.item())
    assert fabric.strategy.core.plans.shared._final == {((S, 1), False): owns[0]}  # settled: later steps send nothing


def auto_lengths_agree(rank: int, world_size: int, profiles: list[str]) -> None:
    fabric = _fabric(planner_profile=profiles[rank], partition=None)
    torch.manual_seed(0)
    stage = fabric.setup(GPT(AUTO_CONFIG))
    ids, targets = make_batch(AUTO_CONFIG, 1, AUTO_SEQ_LEN)
    fabric.strategy.forward_backward(stage, ids, targets)
    used = list(fabric.strategy.core.last_plan.lengths)
    core = fabric.strategy.core
    n, policy, granularity = core.planner.subsequences(
        stage._forward_module.model, AUTO_SEQ_LEN, 1, core.dims, torch.device("cpu"), core.plans.settings.granularity
    )  # this rank's own plan (rank 0: the cached one it used)

    plans, useds = _gathered((n, policy)), _gathered(used)
    assert plans[0] != plans[1], plans  # negative control: the device profiles alone would split the ranks
    assert useds[0] == useds[1] and len(useds[0]) == plans[0][0], (useds, plans)


def lengths_agree(rank: int, world_size: int, profiles: list[str]) -> None:
    """One pair of processes for all three checks: starting processes costs more than the checks."""
    adaptive_lengths_agree(rank, world_size)
    auto_lengths_agree(rank, world_size, profiles)
    protocol(rank, world_size)


@pytest.mark.slow
def test_ranks_fed_different_costs_or_devices_cut_as_rank_zero(tmp_path):
    profiles = []
    for mib in PROFILE_MIB:
        path = tmp_path / f"gpu-{mib}.json"
        profile = replace(BUILTIN_PROFILES["a100-80gb"], name=f"gpu-{mib}", hbm_bytes=mib * 2**20, reserved_bytes=0,
                          allocator_slack_bytes=0)  # fmt: skip
        replace(profile, gpus_per_node=2).save(path)
        profiles.append(str(path))
    run_distributed(lengths_agree, 2, profiles)


# -- the protocol itself -------------------------------------------------------------------------------


def protocol(rank: int, world_size: int) -> None:
    """Broadcasts while not final, none once final; a failure on rank 0 or a shape mismatch raises everywhere."""
    sent = []
    broadcast = dist.broadcast
    dist.broadcast = lambda tensor, src, **kw: sent.append(tensor.numel()) or broadcast(tensor, src, **kw)
    try:
        _protocol_checks(rank, sent)
    finally:
        dist.broadcast = broadcast


def _protocol_checks(rank: int, sent: list[int]) -> None:
    shared, cpu = SharedLengths(), torch.device("cpu")

    mine = [3 + rank, 7 - rank]
    assert shared.decide((10, 1), lambda: LengthChoice(mine, final=False), cpu) == [3, 7]
    assert shared.decide((10, 1), lambda: LengthChoice(mine, final=True), cpu) == [3, 7]  # not final: asks again
    assert sent == [4, 2, 4, 2]  # header and lengths, twice

    def refuse() -> LengthChoice:
        raise AssertionError("a final choice was made again")

    assert shared.decide((10, 1), refuse, cpu) == [3, 7] and len(sent) == 4  # final: no communication

    # Packed documents: a batch with them never takes the choice made without them, and lengths that follow the
    # documents are not final, so every batch is cut by rank 0 and sent.
    for _ in range(2):
        cut = [5 + rank, 5 - rank]
        assert shared.decide((10, 1), lambda cut=cut: LengthChoice(cut, final=False), cpu, documents=True) == [5, 5]
    assert len(sent) == 8

    def fails() -> LengthChoice:
        raise ValueError("the planner found nothing that fits")

    expected = ValueError if rank == 0 else RuntimeError
    try:
        shared.decide((12, 1), fails, cpu)
    except expected as error:
        assert rank == 0 or "Rank 0 could not choose" in str(error), error
    else:
        raise AssertionError("a failed choice on rank 0 went unnoticed")

    shape = (16, 1) if rank == 0 else (18, 1)
    try:
        shared.decide(shape, lambda: LengthChoice([8, 8], final=True), cpu)
    except RuntimeError as error:
        assert rank == 1 and "same batch shape" in str(error), error
    else:
        assert rank == 0


def test_one_process_chooses_locally_and_caches_what_is_final():
    shared, calls = SharedLengths(), []

    def choose(final: bool):
        return lambda: calls.append(final) or LengthChoice([2, 2], final)

    for final in (False, False, True, True):
        assert shared.decide((4, 1), choose(final), torch.device("cpu")) == [2, 2]
    assert calls == [False, False, True]
