"""Fabric's load on two processes (pp=2, gloo) of malicious checkpoints (``tests/training/untrusted.py``, issue 36):
every rank refuses in one line naming the file and the global, and the command in the checkpoint never runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.strategy.safe_load import UnsafeCheckpointError
from tests.conftest import launch_fabric
from tests.distributed.harness import run_distributed
from tests.training.untrusted import KINDS, OVERRIDES, make_untrusted, runs_code

pytestmark = pytest.mark.slow  # two processes (gloo)

MARKER = "CODE-RAN"
REFUSED_AT = {"file": "untrusted-file.ckpt:", "folder-meta": "meta.pt:", "folder-metadata": ".metadata:"}
"""The file each refusal names. The folder's own DCP entry (``folder-entry``) is not among them: a load into a stage
requests the model's and optimizer's tensors only, so that entry is never read."""


def refuses_on_every_rank(rank: int, world_size: int, tmp: str) -> None:
    tmp = Path(tmp)
    fabric = launch_fabric(world_size, pipeline_parallel=2, num_subsequences=2)
    model = GPT(GPTConfig.from_name("tiny", **OVERRIDES))
    stage, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for kind, refused in REFUSED_AT.items():
        with pytest.raises(UnsafeCheckpointError) as raised:
            fabric.load(tmp / f"untrusted-{kind}.ckpt", {"model": stage, "optimizer": optimizer})
        message = str(raised.value)
        assert "\n" not in message and refused in message and "posix.system" in message, (rank, kind, message)
    state = {"model": stage, "optimizer_0": optimizer}  # the names `sppo fit` saved them under
    fabric.load(tmp / "untrusted-folder-entry.ckpt", state)  # the stage's tensors: the entry stays unread
    assert optimizer.state, rank
    fabric.barrier()
    assert not (tmp / MARKER).exists(), rank


def test_fabric_on_two_processes_refuses_every_malicious_checkpoint(tmp_path):
    paths = make_untrusted(tmp_path, tmp_path / MARKER)
    run_distributed(refuses_on_every_rank, 2, str(tmp_path))
    assert not (tmp_path / MARKER).exists()
    assert all(runs_code(paths[kind], tmp_path / MARKER) for kind in KINDS)  # the negative control
