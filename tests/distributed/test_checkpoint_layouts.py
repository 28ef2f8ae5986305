"""Checkpoints across every layout the strategy accepts (gloo, real processes), both formats, both schedules.

One launch per layout. The launches form a chain (``checkpoint_workers.LAYOUTS``): each loads what the
previous layout saved, steps and saves again; the files are checked against the plain GPT after as many
steps. Running one layout's test alone runs the launches before it first.
"""

import dataclasses

import pytest
import torch

from lightning_sppo.strategy.checkpoint import CheckpointMismatchError
from tests.distributed import checkpoint_workers
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.slow  # several processes (gloo) per test

LAYOUTS = checkpoint_workers.LAYOUTS


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Runs the chain's launches up to a given index, each once per test session."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    done: set[int] = set()

    def run_up_to(index: int) -> None:
        for i in range(index + 1):
            if i not in done:
                pp, dp, sp = LAYOUTS[i]
                run_distributed(checkpoint_workers.layout_chain_link, pp * dp * sp, i, str(tmp))
                done.add(i)

    return run_up_to


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"pp{pp}-dp{dp}-sp{sp}" for pp, dp, sp in LAYOUTS])
def test_layout_saves_what_the_plain_model_holds_and_loads_the_previous_layout(chain, index):
    chain(index)


def test_incomplete_saves_and_mismatched_loads_raise_on_every_rank(tmp_path):
    run_distributed(checkpoint_workers.checkpoint_errors_on_every_rank, 4, str(tmp_path))


def test_fabric_checkpoints_of_one_device_and_of_pp2_load_in_each_other(tmp_path):
    """One device saves after a step; pp=2 (2 processes) loads it and takes the next step with the one-device
    run's loss, then saves a folder and a single file; one device loads each and takes the third step with the
    loss of the uninterrupted run; a tied model too. Before, one device's optimizer states (by index) were "no
    'step' state" on pp=2, and one device could not read a folder (IsADirectoryError). A one-device file of an
    older version (states by index) is one clear error on pp=2 (the negative control)."""
    from lightning.fabric import Fabric

    from lightning_sppo import SPPOStrategy
    from tests.distributed.checkpoint_workers import ACROSS, _fresh, one_device_step

    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=2), accelerator="cpu", devices=1)
    fabric.launch()
    for name, config in ACROSS.items():
        stage, optimizer = _fresh(fabric, config)
        losses = [one_device_step(fabric, stage, optimizer, config, seed=0)]
        fabric.save(tmp_path / f"{name}-one.pt", {"model": stage, "optimizer": optimizer, "step": 1})
        saved = torch.load(tmp_path / f"{name}-one.pt", weights_only=False)
        assert set(saved["optimizer"]["state"]) == set(dict(stage.module.named_parameters())), saved["optimizer"][
            "state"
        ]
        by_index = dict(enumerate(saved["optimizer"]["state"].values()))
        torch.save(saved | {"optimizer": {"state": by_index, "param_groups": []}}, tmp_path / f"{name}-one-by-index.pt")
        losses += [one_device_step(fabric, stage, optimizer, config, seed=s) for s in (1, 2)]
        torch.save(losses, tmp_path / f"{name}-losses.pt")
    run_distributed(checkpoint_workers.load_one_device_save_pp2, 2, str(tmp_path))
    for name, config in ACROSS.items():
        expected = torch.load(tmp_path / f"{name}-losses.pt")
        for saved in (tmp_path / f"{name}-two.pt", tmp_path / f"{name}-two"):
            stage, optimizer = _fresh(fabric, config)
            state = {"model": stage, "optimizer": optimizer, "step": 0}
            assert fabric.load(saved, state) == {"model_config": config.to_dict()} and state["step"] == 2, state
            loss = one_device_step(fabric, stage, optimizer, config, seed=2)
            assert loss == pytest.approx(expected[2], rel=1e-5), (name, saved, loss, expected)
    whole = fabric.load(tmp_path / "untied-two")  # no state: the checkpoint itself, as from a file
    assert whole["step"] == 2 and set(whole["model"]) == set(torch.load(tmp_path / "untied-two.pt")["model"]), whole
    other, optimizer = _fresh(fabric, dataclasses.replace(ACROSS["untied"], n_layer=2))
    with pytest.raises(CheckpointMismatchError, match="does not fit this model"):
        fabric.load(tmp_path / "untied-two", {"model": other, "optimizer": optimizer})
