"""A bare module on one device (issue 39 item 6): ``fabric.load_raw(path, module)`` loads the module's weights from a
checkpoint of any layout (a folder of pp=2, its single file, a one-device file, a plain state dict), and
``fabric.load(path, module)``, which Fabric does not take (it loads into a dict), is one line saying what does.
Before, the folder was an ``IsADirectoryError`` and a file torch's list of every missing and unexpected key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric

from lightning_sppo import GPT, GPTConfig, SPPOStrategy
from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.strategy.checkpoint import CheckpointMismatchError
from tests.conftest import launch_fabric
from tests.distributed.harness import run_distributed

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, intermediate_size=32,
                   block_size=256)  # fmt: skip


def _plain(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIG)


def save_pp2(rank: int, world_size: int, out: str) -> None:
    """pp=2 saves the plain model of seed 0 as a folder and as a single file."""
    fabric = launch_fabric(world_size, pipeline_parallel=2, num_subsequences=2)
    model = _plain(0)
    stage, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    fabric.save(Path(out) / "folder", {"model": stage, "optimizer": optimizer, "step": 3})
    fabric.strategy.config.save_distributed_checkpoint = False
    fabric.save(Path(out) / "file.pt", {"model": stage, "optimizer": optimizer, "step": 3})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("load-module")
    run_distributed(save_pp2, 2, str(out))
    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=2), accelerator="cpu", devices=1)
    model = fabric.setup(_plain(0))
    fabric.save(out / "one.pt", {"model": model, "step": 3})
    torch.save(_plain(0).state_dict(), out / "raw.pt")
    return out


@pytest.fixture
def fabric() -> Fabric:
    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=2), accelerator="cpu", devices=1)
    fabric.launch()
    return fabric


@pytest.mark.slow  # the fixture saves with 2 processes (gloo)
@pytest.mark.parametrize("name", ["folder", "file.pt", "one.pt", "raw.pt"])
def test_load_raw_of_a_bare_module_reads_any_layout(saved: Path, fabric: Fabric, name: str):
    expected = _plain(0).state_dict()
    module = fabric.setup(_plain(1))
    assert not torch.equal(module.wte.weight, expected["wte.weight"])
    fabric.load_raw(saved / name, module)
    assert all(torch.equal(value, expected[key]) for key, value in module.state_dict().items())


@pytest.mark.slow
def test_fabric_load_of_a_bare_module_is_one_line(saved: Path, fabric: Fabric):
    module = fabric.setup(_plain(1))
    with pytest.raises(SPPOConfigError) as error:
        fabric.load(saved / "folder", module)
    assert "fabric.load_raw(path, module)" in str(error.value) and len(str(error.value).splitlines()) == 1
    state = {"model": module}  # the dict form: the same folder loads
    assert fabric.load(saved / "folder", state)["step"] == 3


@pytest.mark.slow
def test_a_bare_module_of_another_architecture_or_an_unknown_entry_is_one_line(saved: Path, fabric: Fabric, tmp_path):
    other = fabric.setup(GPT(GPTConfig(**{**CONFIG.to_dict(), "n_layer": 3})))
    with pytest.raises(CheckpointMismatchError):
        fabric.load_raw(saved / "folder", other)
    torch.save({"weights": {"unrelated.weight": torch.zeros(2)}, "step": 1}, tmp_path / "odd.pt")
    with pytest.raises(SPPOConfigError, match=r"holds entries \['step', 'weights'\].*fabric.load\(path, \{'model'"):
        fabric.load_raw(tmp_path / "odd.pt", fabric.setup(_plain(1)))
