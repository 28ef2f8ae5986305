"""Checkpoints of a pipelined, sharded model, keyed by the plain GPT's parameter names.

* distributed (default): torch.distributed.checkpoint writes each rank's shards into a folder, and rank 0
  writes ``meta.pt`` last (the other entries, the optimizers' hyperparameters, ``model_config``). The keys
  are plain GPT keys, so a checkpoint loads into any other (pp, dp, sp) layout.
* single file (``save_distributed_checkpoint=False``): ``{"model": <plain GPT state dict>, "optimizer":
  {"state": {name: {...}}, "param_groups": [...]}, ..., "model_config": {...}}``, gathered from every stage
  and shard (``state_gather``) and written by rank 0 with ``torch.save``. ``"model"`` loads into the plain
  ``GPT`` with ``load_state_dict(strict=True)``.

``model_config`` (``GPTConfig.to_dict()``) records the architecture, for exporters and for clear load errors;
checkpoints without it still load.

Before anything is written, the keys every rank contributes are checked against the plain ``GPT`` built
from the stage's config (``checkpoint_checks``): a checkpoint that would miss a stage, a shard or an
optimizer state raises ``CheckpointError`` on every rank instead. A load checks keys and shapes first and
names the first mismatch in one line. Writes go under a temporary name and are swapped in so that a kill
at any point loses nothing (``checkpoint_files``; ``newest_complete_checkpoint`` finds what to resume from). Every
read goes through ``safe_load``: a checkpoint is data (tensors, containers, primitives), never code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_sppo.parallel.tied import is_tied_copy
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.strategy.checkpoint_checks import (
    CheckpointError,
    CheckpointMismatchError,
    Written,
    load_mismatch,
    optimizer_mismatch,
    plain_shapes,
    save_shortfall,
)
from lightning_sppo.strategy.checkpoint_files import (
    META,
    atomic_torch_save,
    is_complete,
    newest_complete_checkpoint,
    recover,
    remove_path,
    replace,
    temporary_path,
)
from lightning_sppo.strategy.safe_load import DataOnlyReader, load_dict, load_distributed, load_file, unreadable
from lightning_sppo.strategy.state_gather import (
    full_state_on_leader,
    is_stage_leader,
    object_group,
    recv_state,
    send_state,
)

__all__ = [
    "MODEL_CONFIG",
    "PARAMETER_NAMES",
    "CheckpointError",
    "CheckpointMismatchError",
    "atomic_torch_save",
    "check_whole_model",
    "is_complete",
    "load_checkpoint",
    "load_stage",
    "named_optimizer_state",
    "newest_complete_checkpoint",
    "optimizer_parameter_names",
    "read_on_one_process",
    "remove_path",
    "save_checkpoint",
    "save_stage",
]

MODEL_CONFIG = "model_config"
"""Top-level entry (of the file, or of ``meta.pt``) holding ``GPTConfig.to_dict()`` of the saved model."""
_HYPERPARAMETERS = "_sppo_optimizer_hyperparameters"
PARAMETER_NAMES = "optimizer_parameter_names"
"""In a Trainer checkpoint of one device (Lightning's format: optimizer states keyed by index): per optimizer, the
plain GPT names of its parameters in index order, so that a load on several devices finds each state by name."""


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
    model_key, stage, optimizers, rest = _split(state)
    # As Fabric on one device: an entry asked for that the checkpoint lacks is an error (the model and optimizers are
    # checked by ``load_stage``, the model's architecture first).
    if strict and rest and is_complete(path):
        saved = _saved_entries(path)
        if missing := [key for key in rest if key not in saved]:
            raise KeyError(
                f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint"
                f" {path} (it holds {sorted(saved)}). To disable strict loading, set `strict=False`."
            )
    extra = load_stage(path, model_key, stage, optimizers, strict)
    for key in [k for k in extra if k in state]:
        if _is_stateful(state[key]):
            state[key].load_state_dict(extra.pop(key))
        else:
            state[key] = extra.pop(key)
    return extra


def _saved_entries(path: Path) -> set[str]:
    """The top-level entries of a checkpoint, read without its tensors' data."""
    if path.is_dir():
        tensors = DataOnlyReader(path).read_metadata().state_dict_metadata
        meta = set(load_dict(path / META)) - {_HYPERPARAMETERS}
        return meta | {key.split(".", 1)[0] for key in tensors}
    saved = load_file(path, mmap=True)
    return set(saved) if isinstance(saved, dict) else set()


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


# -- save -----------------------------------------------------------------------------------------


def save_stage(
    path: Path,
    model_key: str,
    stage: StageModule,
    optimizers: dict[str, Optimizer],
    rest: dict[str, Any],
    distributed: bool,
) -> None:
    """Write the model and optimizer states of every stage plus ``rest`` (saved by rank 0) to ``path``.

    Called on every rank. Raises ``CheckpointError`` on every rank, before anything is written, if the
    checkpoint would lack a key of the plain GPT or the state of a parameter its optimizer has state for.
    """
    group = object_group()
    model = stage.model
    rest = rest | {MODEL_CONFIG: model.config.to_dict()}
    expected = plain_shapes(model.config)
    state = _stage_state(model, optimizers, model_key)
    if distributed:
        _on_rank_zero(lambda: _begin(path), group)  # before anyone writes into the temporary folder
        _check_written(path, expected, _written(state, model_key, model, optimizers, True), group, True)
        _save_folder(path, model_key, state, optimizers, rest, group)
    else:
        leader = is_stage_leader(model)
        full = full_state_on_leader(state, leader)  # collectives within each stage's shard group
        written = _written(full, model_key, model, optimizers, leader)
        leaders = _check_written(path, expected, written, group, False)
        if leader and dist.get_rank() != 0:
            send_state(full, 0, group)
        parts = [full] if full is not None else []
        if dist.get_rank() == 0:
            parts += [recv_state(source, group) for source in leaders if source != 0]
        _on_rank_zero(lambda: _write_file(path, model_key, parts, list(optimizers), rest, expected), group)


def _stage_state(model: nn.Module, optimizers: dict[str, Optimizer], model_key: str) -> dict[str, Any]:
    """This rank's share of the checkpoint, keyed by plain GPT names (DTensor shards under FSDP)."""
    state: dict[str, Any] = {model_key: get_model_state_dict(model)}
    return state | {key: get_optimizer_state_dict(model, opt) for key, opt in optimizers.items()}


def _written(
    state: dict[str, Any] | None, model_key: str, model: nn.Module, optimizers: dict[str, Optimizer], leader: bool
) -> Written:
    having = {
        key: frozenset(name for name, p in model.named_parameters() if opt.state.get(p))
        for key, opt in optimizers.items()
    }
    if state is None:  # a single-file save sends nothing from this rank
        return Written(False, frozenset(), {key: (frozenset(), names) for key, names in having.items()})
    saved = {key: frozenset(state.get(key, {}).get("state", {})) for key in optimizers}
    return Written(leader, frozenset(state.get(model_key, {})), {k: (saved[k], having[k]) for k in optimizers})


def _check_written(
    path: Path, expected: dict[str, Any], mine: Written, group: ProcessGroup | None, distributed: bool
) -> list[int]:
    """Every rank's share, checked together (the same verdict on every rank); returns the leaders' ranks."""
    written: list[Written | None] = [None] * dist.get_world_size()
    dist.all_gather_object(written, mine, group=group)
    reason = save_shortfall(path, expected, written, distributed)
    if reason is not None:
        raise CheckpointError(reason)
    return [rank for rank, share in enumerate(written) if share.leader]


def _save_folder(
    path: Path,
    model_key: str,
    state: dict[str, Any],
    optimizers: dict[str, Optimizer],
    rest: dict[str, Any],
    group: ProcessGroup | None,
) -> None:
    tmp = temporary_path(path)
    # Tensors go through DCP; the optimizers' hyperparameters (the same on every rank) into the metadata.
    shards = {model_key: state[model_key]} | {key: {"state": state[key]["state"]} for key in optimizers}
    # DCP checks that the shards cover every tensor (else it raises on every rank) and returns once every
    # rank's shards are written.
    dcp.save(shards, checkpoint_id=tmp)
    hyperparameters = {k: [_hyperparameters(g) for g in opt.param_groups] for k, opt in optimizers.items()}

    def finish() -> None:
        torch.save(rest | {_HYPERPARAMETERS: hyperparameters}, tmp / META)  # last: marks the folder complete
        replace(tmp, path)

    _on_rank_zero(finish, group)


def _write_file(
    path: Path,
    model_key: str,
    parts: list[dict[str, Any]],
    optimizer_keys: list[str],
    rest: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    """On rank 0: merge the stages' full states and write them (then swap the file in)."""
    merged = {model_key: _merge_models([part[model_key] for part in parts])}
    merged |= {key: _merge_optimizers([part[key] for part in parts]) for key in optimizer_keys}
    model = merged[model_key]
    if wrong := [key for key, shape in expected.items() if key not in model or tuple(model[key].shape) != shape]:
        raise CheckpointError(f"Refusing to write {path}: the merged model state lacks or misshapes {wrong[:4]}.")
    _begin(path)
    tmp = temporary_path(path)
    torch.save(merged | rest, tmp)
    replace(tmp, path)


def _begin(path: Path) -> None:
    """Before a save to ``path``: finish or undo an interrupted one, so the newest state is at ``path`` and
    the temporary name is free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)


def _on_rank_zero(action: Callable[[], None], group: ProcessGroup | None) -> None:
    """``action`` on rank 0 while the others wait; a failure there is raised on every rank (a barrier that
    carries the error, so no rank waits for one that died)."""
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            action()
        except Exception as error:  # re-raised below, after the others have been told
            failure = error
    box = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(box, src=0, group=group)
    if failure is not None:
        raise failure
    if box[0] is not None:
        raise CheckpointError(f"Rank 0 failed while writing the checkpoint: {box[0]}")


# -- load -----------------------------------------------------------------------------------------


def load_stage(
    path: Path, model_key: str, stage: StageModule, optimizers: dict[str, Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Restore the stage and optimizers in place from either format; returns the other saved entries.

    Keys and shapes are checked first: a checkpoint of another architecture raises
    ``CheckpointMismatchError`` on every rank, naming the first mismatch. ``strict=False`` lets model keys
    be absent (shapes must still match).
    """
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}.")
    if path.is_dir() and not (path / META).exists():
        raise FileNotFoundError(f"{path} is an incomplete checkpoint (no {META}); it was not fully written.")
    group = object_group()
    templates = {key: get_optimizer_state_dict(stage.model, opt) for key, opt in optimizers.items()}
    if path.is_dir():
        return _load_folder(path, model_key, stage, optimizers, templates, strict, group)
    return _load_file(path, model_key, stage, optimizers, templates, strict, group)


def _load_folder(
    path: Path,
    model_key: str,
    stage: StageModule,
    optimizers: dict[str, Optimizer],
    templates: dict[str, dict[str, Any]],
    strict: bool,
    group: ProcessGroup | None,
) -> dict[str, Any]:
    meta = load_dict(path / META, map_location=None)  # tensors where they were saved, as torch.load leaves them
    saved = {
        key: tuple(getattr(entry, "size", ()))
        for key, entry in DataOnlyReader(path).read_metadata().state_dict_metadata.items()
    }
    prefix = f"{model_key}."
    model_shapes = {key[len(prefix) :]: shape for key, shape in saved.items() if key.startswith(prefix)} or None

    def has(opt: str, name: str, field: str) -> bool:
        return f"{opt}.state.{name}.{field}" in saved

    aliases = {key: _tied_state_aliases(stage, lambda name, key=key: any(has(key, name, f) for f in _FIELDS))
               for key in optimizers}  # fmt: skip
    _check_fits(path, stage, model_key, model_shapes, meta.get(MODEL_CONFIG), strict, group, templates,
                lambda opt, name, field: has(opt, aliases[opt].get(name, name), field))  # fmt: skip
    model_state = get_model_state_dict(stage.model)
    if not strict:
        model_state = {key: value for key, value in model_state.items() if key in model_shapes}
    # Optimizer states are read under the names they were saved with (a tied head's may be the embedding's).
    shards = {model_key: model_state} | {
        key: {"state": {aliases[key].get(name, name): value for name, value in t["state"].items()}}
        for key, t in templates.items()
    }
    load_distributed(shards, path)
    set_model_state_dict(stage.model, shards[model_key], options=StateDictOptions(strict=strict))
    hyperparameters = _saved_hyperparameters(meta, path)
    for key, opt in optimizers.items():
        groups = templates[key]["param_groups"]
        for group_state, saved_group in zip(groups, hyperparameters.get(key, []), strict=False):
            group_state.update(saved_group)
        state = {name: shards[key]["state"][aliases[key].get(name, name)] for name in templates[key]["state"]}
        set_optimizer_state_dict(stage.model, opt, {"state": state, "param_groups": groups})
    return meta


def _load_file(
    path: Path,
    model_key: str,
    stage: StageModule,
    optimizers: dict[str, Optimizer],
    templates: dict[str, dict[str, Any]],
    strict: bool,
    group: ProcessGroup | None,
) -> dict[str, Any]:
    # Memory-mapped: each rank reads the pages of the tensors its stage (and shard) takes, not the whole file.
    checkpoint = load_dict(path, mmap=True)
    checkpoint = _from_one_device(path, checkpoint, model_key, list(optimizers))
    model = checkpoint.get(model_key)
    model_shapes = {key: tuple(value.shape) for key, value in model.items()} if isinstance(model, dict) else None

    def has(opt: str, name: str, field: str) -> bool:
        return field in checkpoint.get(opt, {}).get("state", {}).get(name, {})

    aliases = {key: _tied_state_aliases(stage, lambda name, key=key: bool(checkpoint.get(key, {}).get("state", {})
               .get(name))) for key in optimizers}  # fmt: skip
    _check_fits(path, stage, model_key, model_shapes, checkpoint.get(MODEL_CONFIG), strict, group, templates,
                lambda opt, name, field: has(opt, aliases[opt].get(name, name), field))  # fmt: skip
    owned = set(stage.model.state_dict())
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(stage.model, {k: v for k, v in model.items() if k in owned}, options=full)
    parameters = {name for name, _ in stage.model.named_parameters()}  # a tied weight once, by the first name
    for key, opt in optimizers.items():
        state = _stage_optimizer_state(checkpoint[key], parameters, aliases[key])
        set_optimizer_state_dict(stage.model, opt, state, options=full)
    return {k: v for k, v in checkpoint.items() if k not in optimizers and k != model_key}


def _check_fits(
    path: Path,
    stage: StageModule,
    model_key: str,
    model_shapes: dict[str, tuple[int, ...]] | None,
    saved_config: dict[str, Any] | None,
    strict: bool,
    group: ProcessGroup | None,
    templates: dict[str, dict[str, Any]],
    has: Callable[[str, str, str], bool],
) -> None:
    """Raise ``CheckpointError`` on every rank if any rank finds the checkpoint does not fit (one line)."""
    config = stage.model.config
    reason = load_mismatch(path, model_shapes, plain_shapes(config), strict, model_key, saved_config, config)
    for key, template in templates.items():
        if reason is not None:
            break
        required = [(name, field) for name, fields in template["state"].items() for field in fields]
        reason = optimizer_mismatch(path, key, required, lambda name, field, key=key: has(key, name, field))
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason, group=group)
    if first := next((r for r in reasons if r is not None), None):
        raise CheckpointMismatchError(first)


def check_whole_model(
    path: Path, model_state: Any, model: nn.Module, strict: bool, model_key: str, saved_config: dict[str, Any] | None
) -> None:
    """On one device: ``CheckpointMismatchError`` (one line naming the first mismatch and the config fields that
    differ) if the plain state dict ``model_state`` cannot load into the ``GPT`` ``model``; before torch's own
    error, which lists every key over many lines."""
    config = getattr(model, "config", None)
    if not isinstance(model_state, dict) or not hasattr(config, "to_dict"):
        return
    shapes = {key: tuple(value.shape) for key, value in model_state.items() if hasattr(value, "shape")}
    reason = load_mismatch(path, shapes, plain_shapes(config), strict, model_key, saved_config, config)
    if reason is not None:
        raise CheckpointMismatchError(reason)


# -- the single file's merge and split ---------------------------------------------------------------


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _merge_models(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)  # one part per stage: disjoint keys
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


def _stage_optimizer_state(full: dict[str, Any], owned: set[str], aliases: dict[str, str]) -> dict[str, Any]:
    """The stage's part of a full optimizer state; ``aliases`` maps a parameter to the name it was saved under."""
    saved_as = {aliases.get(name, name): name for name in owned}
    groups = [{**g, "params": [saved_as[p] for p in g["params"] if p in saved_as]} for g in full["param_groups"]]
    return {"state": {saved_as[k]: v for k, v in full["state"].items() if k in saved_as}, "param_groups": groups}


_FIELDS = ("step", "exp_avg", "exp_avg_sq", "momentum_buffer")
"""Optimizer state fields that tell whether a parameter has state in a checkpoint folder (AdamW, SGD)."""


def _tied_state_aliases(stage: StageModule, saved: Callable[[str], bool]) -> dict[str, str]:
    """``{"lm_head.weight": "wte.weight"}`` when this stage's head is a tied embedding's pipeline copy and the
    checkpoint kept its optimizer state only under the embedding's name: a model saved without a pipeline has one
    tied parameter, named after the embedding (the copies' states are equal anyway); else ``{}``."""
    head = stage.model.lm_head
    if head is None or not is_tied_copy(head.weight) or saved("lm_head.weight") or not saved("wte.weight"):
        return {}
    return {"lm_head.weight": "wte.weight"}


# -- between one device (Lightning's own format) and the others ----------------------------------------


def optimizer_parameter_names(model: nn.Module, optimizer: Optimizer) -> list[str]:
    """``model``'s names of ``optimizer``'s parameters, in the order of its state dict's indices."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names.get(id(p), "") for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(indexed: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by index (torch's) as one keyed by parameter name (this module's formats)."""
    return {
        "state": {names[i]: value for i, value in indexed.get("state", {}).items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in indexed.get("param_groups", [])],
    }


def indexed_optimizer_state(
    path: Path, key: str, named: dict[str, Any], optimizer: Optimizer, model: nn.Module
) -> dict[str, Any]:
    """A state keyed by parameter name (``named``, saved on any layout) for ``optimizer`` of the whole ``model`` on one
    device, keyed by index as ``optimizer.load_state_dict`` takes it. ``CheckpointMismatchError`` (one line) if
    it lacks the state of a parameter or has other parameter groups."""
    names = optimizer_parameter_names(model, optimizer)
    saved, template = named.get("state", {}), optimizer.state_dict()
    groups = named.get("param_groups", [])
    if len(groups) != len(template["param_groups"]):
        raise CheckpointMismatchError(
            f"The checkpoint {path} does not fit optimizer {key!r}: it has {len(groups)} parameter groups, this"
            f" optimizer {len(template['param_groups'])}. Load it with the same optimizer."
        )
    if saved and (missing := next((n for n in names if n not in saved), None)) is not None:
        raise CheckpointMismatchError(
            f"The checkpoint {path} does not fit optimizer {key!r}: it has no state for {missing!r} (saved with"
            " another optimizer?). Load it with the same optimizer, or leave the optimizer out of the state to load."
        )
    merged = [{**mine, **{k: v for k, v in theirs.items() if k != "params"}, "params": mine["params"]}
              for mine, theirs in zip(template["param_groups"], groups, strict=True)]  # fmt: skip
    return {"state": {i: saved[name] for i, name in enumerate(names) if name in saved}, "param_groups": merged}


def read_on_one_process(path: Path) -> dict[str, Any]:
    """A checkpoint of several devices (a folder, or the single file) read whole, without a process group: the
    model's and optimizers' entries keyed by plain GPT names (``{"state": ..., "param_groups": [...]}`` per
    optimizer) and the other saved entries."""
    if not path.is_dir():
        return load_dict(path)
    if not (path / META).exists():
        raise FileNotFoundError(f"{path} is an incomplete checkpoint (no {META}); it was not fully written.")
    meta = load_dict(path / META)  # first: its own refusal, before any shard is read
    state: dict[str, Any] = {}
    load_distributed(state, path, whole=True)
    for key, groups in _saved_hyperparameters(meta, path).items():
        state.setdefault(key, {}).setdefault("state", {})
        state[key]["param_groups"] = groups
    return meta | state


def _saved_hyperparameters(meta: dict[str, Any], path: Path) -> dict[str, list[dict[str, Any]]]:
    """The optimizers' param-group hyperparameters a folder's ``meta.pt`` holds (popped from ``meta``):
    ``{optimizer key: [group, ...]}``; of another shape, the file is damaged (one line, not an error deep in the
    optimizer's ``load_state_dict``)."""
    saved = meta.pop(_HYPERPARAMETERS, None) or {}
    shaped = isinstance(saved, dict) and all(
        isinstance(groups, list) and all(isinstance(g, dict) for g in groups) for groups in saved.values()
    )
    if not shaped:
        raise unreadable(str(path / META), f"its {_HYPERPARAMETERS!r} is not the optimizers' lists of param groups")
    return saved


def _from_one_device(path: Path, checkpoint: Any, model_key: str, optimizer_keys: list[str]) -> Any:
    """A Trainer checkpoint of one device (Lightning's ``state_dict`` with the module's ``{model_key}.`` prefix,
    ``optimizer_states`` keyed by index) in the format of several devices; any other checkpoint as it is."""
    if not isinstance(checkpoint, dict):
        return checkpoint
    if model_key in checkpoint or not isinstance(checkpoint.get("state_dict"), dict):
        for key in optimizer_keys:  # Fabric's file of one device from an older lightning_sppo: states by index
            if isinstance(checkpoint.get(key), dict) and any(
                isinstance(k, int) for k in checkpoint[key].get("state", {})
            ):
                raise CheckpointMismatchError(
                    f"The checkpoint {path} holds {key!r} states keyed by index (saved on one device by an older"
                    " lightning_sppo), which cannot be split into stages: load it on one device, or load the model"
                    " alone and start the optimizer afresh."
                )
        return checkpoint
    prefix = f"{model_key}."
    converted = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", PARAMETER_NAMES)}
    converted[model_key] = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    states, names = checkpoint.get("optimizer_states") or [], checkpoint.get(PARAMETER_NAMES)
    for index, key in enumerate(optimizer_keys[: len(states)]):
        if names is None or index >= len(names):
            raise CheckpointMismatchError(
                f"The checkpoint {path} was saved on one device without the names of its optimizer's parameters"
                " (an older lightning_sppo), so its optimizer state cannot be split into stages: resume it on one"
                " device, or start a new run from its weights with --model.init_from."
            )
        converted[key] = named_optimizer_state(states[index], names[index])
    return converted
