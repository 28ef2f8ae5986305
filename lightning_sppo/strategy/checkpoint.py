"""Checkpoints of a pipelined, sharded model, keyed by the plain GPT's parameter names.

* distributed (default): torch.distributed.checkpoint writes each rank's shards into a folder; the keys
  are plain GPT keys, so a checkpoint loads into any other (pp, dp, sp) layout.
* single file (``save_distributed_checkpoint=False``): rank 0 gathers every stage and writes
  ``{"model": <plain GPT state dict>, "optimizer": ..., ...}`` with ``torch.save``.

Both are written under a temporary name and renamed into place, so a crash during a save never leaves
something at ``path`` that loads as a valid checkpoint (the previous one stays).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_sppo.runtime.stage import StageModule

__all__ = ["atomic_torch_save", "load_checkpoint", "load_stage", "remove_path", "save_checkpoint", "save_stage"]

_META = "meta.pt"
_HYPERPARAMETERS = "_sppo_optimizer_hyperparameters"


def _split(state: dict[str, Any]) -> tuple[str, StageModule, dict[str, Optimizer], dict[str, Any]]:
    modules = [k for k, v in state.items() if isinstance(v, StageModule)]
    if len(modules) != 1:
        raise ValueError(
            "On several devices a checkpoint state holds exactly one model (the stage from setup), e.g."
            f" {{'model': model, 'optimizer': optimizer}}; got keys {sorted(state)}."
        )
    optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
    rest = {k: v for k, v in state.items() if k != modules[0] and k not in optimizers}
    return modules[0], state[modules[0]], optimizers, rest


def save_checkpoint(path: Path, state: dict[str, Any], distributed: bool) -> None:
    """Fabric's ``save``: ``state`` maps names to the stage, optimizers and plain (picklable) values."""
    model_key, stage, optimizers, rest = _split(state)
    rest = {k: v.state_dict() if _is_stateful(v) else v for k, v in rest.items()}  # e.g. LR schedulers
    save_stage(path, model_key, stage, optimizers, rest, distributed)


def load_checkpoint(path: Path, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """Fabric's ``load``: restore ``state`` in place from either format; returns the entries not in it."""
    model_key, stage, optimizers, _ = _split(state)
    extra = load_stage(path, model_key, stage, optimizers, strict)
    for key in [k for k in extra if k in state]:
        if _is_stateful(state[key]):
            state[key].load_state_dict(extra.pop(key))
        else:
            state[key] = extra.pop(key)
    return extra


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def save_stage(
    path: Path,
    model_key: str,
    stage: StageModule,
    optimizers: dict[str, Optimizer],
    rest: dict[str, Any],
    distributed: bool,
) -> None:
    """Write the model and optimizer states of every stage plus ``rest`` (saved by rank 0) to ``path``."""
    rank = dist.get_rank()
    tmp = path.with_name(f".{path.name}.tmp")
    if distributed:
        shards = {model_key: get_model_state_dict(stage.model)}
        # Tensors go through DCP; the optimizers' hyperparameters (the same on every rank) into the metadata.
        shards |= {k: {"state": get_optimizer_state_dict(stage.model, opt)["state"]} for k, opt in optimizers.items()}
        hyperparameters = {k: [_hyperparameters(g) for g in opt.param_groups] for k, opt in optimizers.items()}
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save(shards, checkpoint_id=tmp)
        if rank == 0:
            torch.save(rest | {_HYPERPARAMETERS: hyperparameters}, tmp / _META)  # last: marks the folder complete
    else:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        parts = {model_key: get_model_state_dict(stage.model, options=full)}
        parts |= {k: get_optimizer_state_dict(stage.model, opt, options=full) for k, opt in optimizers.items()}
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(parts, gathered, dst=0)
        if rank == 0:
            merged = {model_key: _merge_models([g[model_key] for g in gathered])}
            merged |= {k: _merge_optimizers([g[k] for g in gathered]) for k in optimizers}
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(merged | rest, tmp)
    dist.barrier()
    if rank == 0:
        _replace(tmp, path)
    dist.barrier()


def load_stage(
    path: Path, model_key: str, stage: StageModule, optimizers: dict[str, Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Restore the stage and optimizers in place from either format; returns the other saved entries."""
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}.")
    if path.is_dir():
        if not (path / _META).exists():
            raise FileNotFoundError(f"{path} is an incomplete checkpoint (no {_META}); it was not fully written.")
        templates = {k: get_optimizer_state_dict(stage.model, opt) for k, opt in optimizers.items()}
        shards = {model_key: get_model_state_dict(stage.model)}
        shards |= {k: {"state": template["state"]} for k, template in templates.items()}
        dcp.load(shards, checkpoint_id=path)
        set_model_state_dict(stage.model, shards[model_key])
        meta = torch.load(path / _META, weights_only=False)
        hyperparameters = meta.pop(_HYPERPARAMETERS, {})
        for key, opt in optimizers.items():
            groups = templates[key]["param_groups"]
            for group, saved in zip(groups, hyperparameters.get(key, []), strict=False):
                group.update(saved)
            set_optimizer_state_dict(stage.model, opt, {"state": shards[key]["state"], "param_groups": groups})
        return meta
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    owned = set(stage.model.state_dict())
    if strict and (missing := owned - set(checkpoint[model_key])):
        raise KeyError(f"The checkpoint {path} lacks {sorted(missing)[:5]} (and maybe more) for this stage.")
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(stage.model, {k: v for k, v in checkpoint[model_key].items() if k in owned}, options=full)
    for key, opt in optimizers.items():
        set_optimizer_state_dict(stage.model, opt, _stage_optimizer_state(checkpoint[key], owned), options=full)
    return {k: v for k, v in checkpoint.items() if k not in optimizers and k != model_key}


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` under a temporary name, then an atomic rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    _replace(tmp, path)


def _replace(tmp: Path, path: Path) -> None:
    """Move ``tmp`` to ``path`` atomically (files); folders swap through a rename of the old one."""
    if tmp.is_file() or not path.exists():
        os.replace(tmp, path)
        return
    old = path.with_name(f".{path.name}.old")
    remove_path(old)
    os.replace(path, old)
    os.replace(tmp, path)
    remove_path(old)


def remove_path(path: Path) -> None:
    """Delete a checkpoint file or folder (no error if it is gone)."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _merge_models(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)  # replicas (dp, sp) carry identical full tensors
    return merged


def _merge_optimizers(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage optimizer states keyed by parameter name: union of states, param groups merged by index."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for part in parts:
        state.update(part.get("state", {}))
        for index, group in enumerate(part.get("param_groups", [])):
            if index == len(groups):
                groups.append({**group, "params": []})
            groups[index]["params"] += [p for p in group["params"] if p not in groups[index]["params"]]
    return {"state": state, "param_groups": groups}


def _stage_optimizer_state(full: dict[str, Any], owned: set[str]) -> dict[str, Any]:
    groups = [{**g, "params": [p for p in g["params"] if p in owned]} for g in full["param_groups"]]
    return {"state": {k: v for k, v in full["state"].items() if k in owned}, "param_groups": groups}


def newest_complete_checkpoint(dirpath: str | os.PathLike) -> Path | None:
    """TEMP (replaced by the real one at merge): the newest completely written checkpoint in ``dirpath``.

    A file, or a folder holding its metadata file (written last); names starting with "." are the temporary
    and swapped-out parts of a save. Newest by the time the checkpoint was completed; None if there is none.
    """
    folder = Path(dirpath)
    if not folder.is_dir():
        return None

    def completed(path: Path) -> Path | None:
        marker = path / _META if path.is_dir() else path
        return marker if not path.name.startswith(".") and marker.is_file() else None

    done = {path: marker for path in folder.iterdir() if (marker := completed(path)) is not None}
    return max(done, key=lambda path: (done[path].stat().st_mtime_ns, path.name), default=None)
