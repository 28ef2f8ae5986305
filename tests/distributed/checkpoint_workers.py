"""Workers for the checkpoint tests: saves in one (pp, dp, sp) layout, loads in another and into the plain GPT.

The launches form a chain over ``LAYOUTS``: launch i loads what launch i-1 saved (both formats, both
schedules), takes the next optimizer step and saves again. After launch i the state is the plain model's
after i + 1 steps, computed here independently in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.strategy import checkpoint
from lightning_sppo.strategy.checkpoint import CheckpointError, CheckpointMismatchError
from tests.conftest import full_tensor, launch_fabric, make_batch, parity_config, plain_loss_and_grads, relative_error

LAYOUTS = [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)]  # (pp, dp, sp)
CONFIG = parity_config(gqa=True, n_layer=4)  # 4 layers: every layout above can cut it
BATCH, S = 4, 48  # the global batch: each dp rank takes its rows

# schedule -> optimizer; both keep per-parameter state. AdamW's eps is raised from 1e-8: near-zero gradient
# elements would otherwise amplify the layouts' float rounding by lr / eps in the comparison with the plain model.
OPTIMIZERS: dict[str, Callable] = {
    "seq1f1b": lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.1),
    "sppo": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
}


def _save(fabric: Fabric, path: Path, state: dict, distributed: bool) -> None:
    fabric.strategy.config.save_distributed_checkpoint = distributed  # the format is read at each save
    fabric.save(path, state)


def _name(index: int, schedule: str) -> str:
    pp, dp, sp = LAYOUTS[index]
    return f"pp{pp}-dp{dp}-sp{sp}-{schedule}"


def _plain_reference(
    schedule: str, steps: int, dtype: torch.dtype = torch.float32
) -> tuple[GPT, torch.optim.Optimizer]:
    """The plain model and its optimizer after ``steps`` steps on the full global batches (in ``dtype``)."""
    torch.manual_seed(0)
    plain = GPT(CONFIG).to(dtype)
    optimizer = OPTIMIZERS[schedule](plain.parameters())
    for step in range(steps):
        ids, targets = make_batch(CONFIG, BATCH, S, seed=step)
        _, grads = plain_loss_and_grads(plain, ids, targets)
        for name, p in plain.named_parameters():
            p.grad = grads[name]
        optimizer.step()
    return plain, optimizer


def _bounds(schedule: str, steps: int) -> dict[tuple[str, str], float]:
    """Per weight and optimizer field: how far a layout's state may be from the plain model's after ``steps`` steps,
    1e-5 relative, or four times the plain model's own float32 rounding (its distance from the same steps in float64)
    where that is larger. The optimizer's steps amplify rounding by a factor that depends on the trajectory: from
    the initial weights of seed 0 the plain model itself is 1e-4 off float64 after five steps, from seeds 7 and 99
    under 1e-5 (a layout, which only rounds otherwise, is within it either way)."""
    exact, exact_optimizer = _plain_reference(schedule, steps, torch.float64)
    plain, plain_optimizer = _plain_reference(schedule, steps)
    bounds = {}
    for (name, param), wide in zip(plain.named_parameters(), exact.parameters(), strict=True):
        bounds[(name, "weight")] = max(1e-5, 4 * relative_error(param.detach(), wide.detach()))
        for field, value in plain_optimizer.state[param].items():
            rounding = relative_error(value.float(), exact_optimizer.state[wide][field].float())
            bounds[(name, field)] = max(1e-5, 4 * rounding)
    return bounds


def layout_chain_link(rank: int, world_size: int, index: int, tmp: str) -> None:
    """Launch ``index`` of the chain: load the previous launch's checkpoints (folder and file) into this
    layout exactly, step once, save both formats and check the file against the plain model's state."""
    pp, dp, sp = LAYOUTS[index]
    tmp = Path(tmp)
    for schedule, make_optimizer in OPTIMIZERS.items():
        torch.manual_seed(0)
        fabric = launch_fabric(
            world_size, pipeline_parallel=pp, sequence_parallel=sp, num_subsequences=2, schedule=schedule
        )
        model = GPT(CONFIG)
        stage, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
        case = f"rank {rank} {_name(index, schedule)}"
        if index > 0:
            previous = tmp / _name(index - 1, schedule)
            saved = torch.load(previous.with_suffix(".pt"), weights_only=False)  # the exact values to restore
            _load_and_compare(fabric, stage, optimizer, previous.with_suffix(".pt"), saved, index, f"{case} file")
            _scramble(stage, optimizer)
            _load_and_compare(fabric, stage, optimizer, previous.with_name(f"{previous.name}-dcp"), saved, index, case)

        ids, targets = make_batch(CONFIG, BATCH, S, seed=index)
        dp_rank = fabric.strategy.dims.coordinates(rank)[1]
        rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        fabric.strategy.forward_backward(stage, ids[rows], targets[rows])
        optimizer.step()
        optimizer.zero_grad()
        state = {"model": stage, "optimizer": optimizer, "step": index + 1}
        path = tmp / _name(index, schedule)
        _save(fabric, path.with_suffix(".pt"), state, distributed=False)
        _save(fabric, path.with_name(f"{path.name}-dcp"), state, distributed=True)
        if rank == 0:
            _check_file_against_plain(path.with_suffix(".pt"), schedule, index + 1, case)
            _check_folder_equals_file(path.with_name(f"{path.name}-dcp"), path.with_suffix(".pt"), case)


def _load_and_compare(fabric, stage, optimizer, path: Path, saved: dict, step: int, case: str) -> None:
    state = {"model": stage, "optimizer": optimizer, "step": 0}
    rest = fabric.load(path, state)
    assert state["step"] == step, (case, path, state["step"])
    assert rest.get("model_config") == CONFIG.to_dict(), (case, path, rest)
    names = dict(stage.module.named_parameters())
    assert names, case
    for name, param in names.items():
        assert torch.equal(full_tensor(param.detach()), saved["model"][name]), (
            f"{case}: {name} differs after loading {path}"
        )
        for field, value in optimizer.state[param].items():
            expected = saved["optimizer"]["state"][name][field]
            assert torch.equal(full_tensor(value), expected), f"{case}: {field} of {name} differs after loading {path}"
    assert optimizer.state, case


def _scramble(stage, optimizer) -> None:
    """Overwrite weights and optimizer state, so that the next load must restore every value."""
    with torch.no_grad():
        for param in stage.parameters():
            param.fill_(7.0)
            for value in optimizer.state[param].values():
                value.fill_(-3.0)


def _check_file_against_plain(path: Path, schedule: str, steps: int, case: str) -> None:
    """The file has exactly the plain GPT's keys, loads into it with strict=True, and its weights and
    optimizer state equal the plain model's after the same steps (relative error < 1e-5, or within the plain
    model's own float32 rounding where the trajectory amplifies it more: ``_bounds``)."""
    plain, plain_optimizer = _plain_reference(schedule, steps)
    bounds = _bounds(schedule, steps)
    saved = torch.load(path, weights_only=False)
    assert list(saved["model"]) == list(plain.state_dict()), (
        case,
        sorted(set(saved["model"]) ^ set(plain.state_dict())),
    )
    assert saved["model_config"] == CONFIG.to_dict() and saved["step"] == steps, case
    loaded = GPT(GPTConfig.from_dict(saved["model_config"]))  # the architecture from the file alone
    loaded.load_state_dict(saved["model"], strict=True)
    for name, param in loaded.named_parameters():
        err = relative_error(param.detach(), dict(plain.named_parameters())[name].detach())
        bound = bounds[(name, "weight")]
        assert err < bound, f"{case}: weight {name} is {err} off the plain model's after {steps} steps (bound {bound})"
    states = saved["optimizer"]["state"]
    assert set(states) == set(dict(plain.named_parameters())), case
    for name, param in plain.named_parameters():
        for field, expected in plain_optimizer.state[param].items():
            err = relative_error(states[name][field].float(), expected.float())
            bound = bounds[(name, field)]
            assert err < bound, f"{case}: optimizer {field} of {name} off by {err} (bound {bound})"
    groups = saved["optimizer"]["param_groups"]
    assert sorted(p for g in groups for p in g["params"]) == sorted(states), case


def _check_folder_equals_file(folder: Path, file: Path, case: str) -> None:
    """The folder holds the same values as the file: read into plain GPT-shaped tensors in this process."""
    saved = torch.load(file, weights_only=False)
    model = {key: torch.empty_like(value) for key, value in saved["model"].items()}
    dcp.load({"model": model}, checkpoint_id=folder, no_dist=True)
    for key, value in model.items():
        assert torch.equal(value, saved["model"][key]), f"{case}: {key} differs between folder and file"
    assert torch.load(folder / "meta.pt", weights_only=False)["model_config"] == CONFIG.to_dict(), case


def checkpoint_errors_on_every_rank(rank: int, world_size: int, tmp: str) -> None:
    """At pp=2 x dp=2. Negative control of the save-side check: a stage's dropped model keys, or its dropped
    optimizer state. Each save raises CheckpointError on every rank (none hangs), names what is missing, and
    leaves the previous checkpoint loadable and unchanged. Then a checkpoint of another model size fails to
    load with one line naming the first mismatch, on every rank, in both formats."""
    tmp = Path(tmp)
    fabric = launch_fabric(world_size, pipeline_parallel=2, num_subsequences=2)
    model = GPT(CONFIG)
    stage, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids, targets = make_batch(CONFIG, 2, S)
    fabric.strategy.forward_backward(stage, ids, targets)
    optimizer.step()
    state = {"model": stage, "optimizer": optimizer}
    for distributed in (False, True):
        _save(fabric, tmp / f"good-{distributed}", state, distributed)
    good = torch.load(tmp / "good-False", weights_only=False)
    original = checkpoint._stage_state

    def dropping(model_keys: bool, ranks: set[int]):
        def stage_state(model, optimizers, model_key):
            state = original(model, optimizers, model_key)
            if rank in ranks:
                part = state[model_key] if model_keys else state["optimizer"]["state"]
                for key in [k for k in part if k.startswith("blocks.")]:
                    del part[key]
            return state

        return stage_state

    cases = [(True, "model state lacks"), (False, "optimizer 'optimizer' state lacks")]  # (model keys?, words)
    for model_keys, words in cases:
        checkpoint._stage_state = dropping(model_keys, {2, 3})  # both shard ranks of stage 1
        try:
            for distributed in (False, True):
                with pytest.raises(CheckpointError, match=words) as raised:
                    _save(fabric, tmp / f"good-{distributed}", state, distributed)
                assert "blocks.2." in str(raised.value), (rank, raised.value)  # stage 1 holds blocks 2 and 3
        finally:
            checkpoint._stage_state = original
    for distributed in (False, True):  # the previous checkpoints are intact and still load
        path = tmp / f"good-{distributed}"
        _scramble(stage, optimizer)
        fabric.load(path, {"model": stage, "optimizer": optimizer})
        for name, param in stage.module.named_parameters():
            assert torch.equal(full_tensor(param.detach()), good["model"][name]), (rank, distributed, name)
    other = parity_config(gqa=True, n_layer=4, n_embd=48)
    if rank == 0:  # written by one process, as an exporter or another training run would
        plain = GPT(other)
        torch.save({"model": plain.state_dict(), "model_config": other.to_dict()}, tmp / "other.pt")
        dcp.save({"model": plain.state_dict()}, checkpoint_id=tmp / "other-dcp", no_dist=True)
        torch.save({"model_config": other.to_dict()}, tmp / "other-dcp" / "meta.pt")
    fabric.barrier()
    for path in (tmp / "other.pt", tmp / "other-dcp"):
        with pytest.raises(CheckpointMismatchError) as raised:
            fabric.load(path, {"model": stage, "optimizer": optimizer})
        message = str(raised.value)
        assert "\n" not in message and "'wte.weight' has shape [64, 48] there but [64, 32] in this model" in message
        assert "saved from a model with n_embd=48" in message, message


# -- one device and several: Fabric's checkpoints of each load in the other ------------------------------------

ACROSS = {"untied": CONFIG, "tied": parity_config(gqa=True, n_layer=4, tie_embeddings=True)}


def one_device_step(fabric: Fabric, stage, optimizer, config: GPTConfig, seed: int) -> float:
    ids, targets = make_batch(config, BATCH, S, seed=seed)
    loss = fabric.strategy.forward_backward(stage, ids, targets)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _fresh(fabric: Fabric, config: GPTConfig):
    torch.manual_seed(1)  # other weights than the saved ones: a load must restore them
    model = GPT(config)
    return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1))


def load_one_device_save_pp2(rank: int, world_size: int, tmp: str) -> None:
    """pp=2: load the one-device file (``{name}-one.pt``), take the step the one-device run took next (same loss),
    then save both formats for the one-device load back."""
    tmp = Path(tmp)
    fabric = launch_fabric(world_size, pipeline_parallel=2, num_subsequences=2)
    for name, config in ACROSS.items():
        stage, optimizer = _fresh(fabric, config)
        state = {"model": stage, "optimizer": optimizer, "step": 0}
        fabric.load(tmp / f"{name}-one.pt", state)
        assert state["step"] == 1 and optimizer.state, (rank, name, state)
        loss = one_device_step(fabric, stage, optimizer, config, seed=1)
        expected = torch.load(tmp / f"{name}-losses.pt")
        assert loss == pytest.approx(expected[1], rel=1e-5), (rank, name, loss, expected)
        state["step"] = 2
        _save(fabric, tmp / f"{name}-two.pt", state, distributed=False)
        _save(fabric, tmp / f"{name}-two", state, distributed=True)
        with pytest.raises(CheckpointMismatchError, match="keyed by index.*older lightning_sppo"):
            fabric.load(tmp / f"{name}-one-by-index.pt", {"model": stage, "optimizer": optimizer})
        for saved in (tmp / f"{name}-two.pt", tmp / f"{name}-two"):  # strict: as Fabric on one device
            more = {
                "model": stage,
                "optimizer": optimizer,
                "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, abs),
            }
            with pytest.raises(KeyError, match="'scheduler' that does not exist in the loaded checkpoint"):
                fabric.load(saved, more)
            assert fabric.load(saved, more, strict=False) == {"model_config": config.to_dict(), "step": 2}
