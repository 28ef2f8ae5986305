"""Checkpoints of a pipelined, sharded model, keyed by the plain GPT's parameter names.

* distributed (default): torch.distributed.checkpoint writes each rank's shards into a folder; the keys
  are plain GPT keys, so a checkpoint loads into any other (pp, dp, sp) layout.
* single file (``save_distributed_checkpoint=False``): rank 0 gathers every stage and writes
  ``{"model": <plain GPT state dict>, "optimizer": ..., ...}`` with ``torch.save``.
"""

from __future__ import annotations

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

__all__ = ["load_checkpoint", "save_checkpoint"]

_META = "meta.pt"


def _split(state: dict[str, Any]) -> tuple[StageModule | None, dict[str, Optimizer], dict[str, Any]]:
    module, optimizers, rest = None, {}, {}
    for key, value in state.items():
        if isinstance(value, StageModule):
            module = value
        elif isinstance(value, Optimizer):
            optimizers[key] = value
        else:
            rest[key] = value
    return module, optimizers, rest


def save_checkpoint(path: Path, state: dict[str, Any], distributed: bool) -> None:
    module, optimizers, rest = _split(state)
    model_key = next(k for k, v in state.items() if v is module)
    if distributed:
        shards = {model_key: get_model_state_dict(module.model)}
        shards |= {k: get_optimizer_state_dict(module.model, opt) for k, opt in optimizers.items()}
        dcp.save(shards, checkpoint_id=path)
        if dist.get_rank() == 0:
            torch.save(rest, path / _META)
        dist.barrier()
        return
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    parts = {model_key: get_model_state_dict(module.model, options=full)}
    parts |= {k: get_optimizer_state_dict(module.model, opt, options=full) for k, opt in optimizers.items()}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(parts, gathered, dst=0)
    if dist.get_rank() == 0:
        merged = {model_key: _merge_models([g[model_key] for g in gathered])}
        merged |= {k: _merge_optimizers([g[k] for g in gathered]) for k in optimizers}
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(merged | rest, path)
    dist.barrier()


def load_checkpoint(path: Path, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """Restore ``state`` in place from either format; returns the entries not in ``state``."""
    module, optimizers, _ = _split(state)
    model_key = next(k for k, v in state.items() if v is module)
    if path.is_dir():
        shards = {model_key: get_model_state_dict(module.model)}
        shards |= {k: get_optimizer_state_dict(module.model, opt) for k, opt in optimizers.items()}
        dcp.load(shards, checkpoint_id=path)
        set_model_state_dict(module.model, shards[model_key])
        for key, opt in optimizers.items():
            set_optimizer_state_dict(module.model, opt, shards[key])
        extra = torch.load(path / _META, weights_only=False)
    else:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        full = StateDictOptions(full_state_dict=True, strict=False)
        owned = set(module.model.state_dict())
        if strict and (missing := owned - set(checkpoint[model_key])):
            raise KeyError(f"The checkpoint {path} lacks {sorted(missing)[:5]} (and maybe more) for this stage.")
        model_state = {k: v for k, v in checkpoint[model_key].items() if k in owned}
        set_model_state_dict(module.model, model_state, options=full)
        for key, opt in optimizers.items():
            set_optimizer_state_dict(module.model, opt, _stage_optimizer_state(checkpoint[key], owned), options=full)
        extra = {k: v for k, v in checkpoint.items() if k not in optimizers and k != model_key}
    for key in list(extra):
        if key in state:
            state[key] = extra.pop(key)
    return extra


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
