"""What a checkpoint must hold: every key of the plain GPT when it is saved, this model's keys and shapes
when it is loaded. Each check returns a one-line reason (or None); the caller makes every rank agree on it,
so that an error is raised on all ranks and none waits in a collective for the others.

The reference is always ``GPT(config)`` built on the meta device (no memory), so the checks follow the
model's definition (a future switch such as tied embeddings changes both sides alike).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_sppo.model import GPT, GPTConfig

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "Written",
    "load_mismatch",
    "optimizer_mismatch",
    "plain_shapes",
    "save_shortfall",
    "trainer_entries_problem",
]


class CheckpointError(RuntimeError):
    """A checkpoint that would be written incomplete (a bug: nothing is written), or one that does not fit
    the model it is loaded into (``CheckpointMismatchError``). Raised on every rank."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is of another architecture or optimizer than what it is loaded into: a user error,
    whose one-line message names the first mismatch."""


def plain_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the plain ``GPT(config)``'s state dict, in its order (built on the meta device)."""
    return dict(_plain_shapes(json.dumps(config.to_dict(), sort_keys=True)))


@functools.lru_cache(maxsize=8)
def _plain_shapes(config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    # Cached (keyed by the config's JSON: it nests dicts, e.g. rope_scaling): every save and load asks, and
    # building a large GPT even on the meta device takes a while.
    with torch.device("meta"):
        model = GPT(GPTConfig.from_dict(json.loads(config_json)))
    return tuple((key, tuple(value.shape)) for key, value in model.state_dict().items())


@dataclass(frozen=True)
class Written:
    """What one rank puts into a checkpoint: its share of the model keys, and per optimizer the parameters
    whose state it writes and those that have state in the optimizer."""

    leader: bool = True
    """Whether this rank sends its stage's full state (single file: one rank per stage)."""
    model: frozenset[str] = frozenset()
    optimizers: dict[str, tuple[frozenset[str], frozenset[str]]] = field(default_factory=dict)


def save_shortfall(path: Path, expected: Iterable[str], written: list[Written], distributed: bool) -> str | None:
    """Why the checkpoint every rank's ``written`` share adds up to must not be written, or None.

    It must hold every key of the plain GPT (``expected``), and each optimizer's state must cover every
    parameter that has state.
    """
    model = frozenset().union(*(w.model for w in written))
    expected = list(expected)
    what, missing = "model state", [key for key in expected if key not in model]
    if not missing:
        for name in sorted({name for w in written for name in w.optimizers}):
            saved = frozenset().union(*(w.optimizers[name][0] for w in written if name in w.optimizers))
            having = frozenset().union(*(w.optimizers[name][1] for w in written if name in w.optimizers))
            what, missing = f"optimizer {name!r} state", [key for key in expected if key in having - saved]
            if missing:
                break
    if not missing:
        return None
    other = "False" if distributed else "True"
    return (
        f"Refusing to write the checkpoint {path}: its {what} lacks {_few(missing)} of the plain GPT's"
        f" {len(expected)} parameters, so a pipeline stage or shard was not collected. Nothing was written;"
        " the previous checkpoint at that path is kept. This is a bug in lightning_sppo's checkpointing:"
        " please report it with the layout (pipeline_parallel, sequence_parallel, world size); meanwhile"
        f" save_distributed_checkpoint={other} writes the other format through other code."
    )


def load_mismatch(
    path: Path,
    saved: dict[str, tuple[int, ...]] | None,
    expected: dict[str, tuple[int, ...]],
    strict: bool,
    model_key: str,
    saved_config: dict[str, Any] | None,
    config: GPTConfig,
) -> str | None:
    """Why the model state ``saved`` (key -> shape; None: no ``model_key`` entry) cannot be loaded into the
    model whose plain keys are ``expected``, or None. Names the first mismatch in the plain GPT's order."""
    if saved is None:
        return f"The checkpoint {path} holds no {model_key!r} entry, so it has no model to load."
    reason = None
    for key, shape in expected.items():
        if key not in saved:
            if strict:
                reason = f"it has no {key!r} (shape {list(shape)})"
                break
        elif tuple(saved[key]) != shape:
            reason = f"{key!r} has shape {list(saved[key])} there but {list(shape)} in this model"
            break
    if reason is None and strict:
        extra = next((key for key in saved if key not in expected), None)
        reason = extra and f"it has {extra!r}, which this model does not"
    if reason is None:
        return None
    return (
        f"The checkpoint {path} does not fit this model: {reason}{_config_difference(saved_config, config)}."
        " Build the model with the checkpoint's architecture, or load a checkpoint of this model."
    )


_TRAINER_ENTRIES: dict[str, type | tuple[type, ...]] = {
    "state_dict": dict,
    "optimizer_states": list,
    "lr_schedulers": list,
    "loops": dict,
    "callbacks": dict,
    "epoch": int,
    "global_step": int,
    "pytorch-lightning_version": str,
    "hyper_parameters": dict,
}
"""Lightning's entries of a Trainer checkpoint and the types Lightning writes them as."""


def trainer_entries_problem(checkpoint: dict[str, Any]) -> str | None:
    """The first of Lightning's entries a Trainer checkpoint holds as another type (a damaged or forged file), as
    a reason; Lightning's restore would stop with a traceback wherever it first read it."""
    for key, kind in _TRAINER_ENTRIES.items():
        if key in checkpoint and not isinstance(checkpoint[key], kind):
            return f"its {key!r} is a {type(checkpoint[key]).__name__}, which Lightning writes as {kind.__name__}"
    return None


def optimizer_mismatch(path: Path, name: str, required: Iterable[tuple[str, str]], has: Any) -> str | None:
    """Why optimizer ``name``'s state cannot be loaded: the first (parameter, field) in ``required`` that
    ``has(parameter, field)`` says the checkpoint lacks, or None."""
    for parameter, key in required:
        if not has(parameter, key):
            return (
                f"The checkpoint {path} does not fit optimizer {name!r}: it has no {key!r} state for"
                f" {parameter!r} (saved with another optimizer, or without {name!r}?). Load it with the same"
                " optimizer, or leave the optimizer out of the state to load."
            )
    return None


def _config_difference(saved: dict[str, Any] | None, config: GPTConfig) -> str:
    if not saved or not isinstance(saved, dict):  # none recorded, or a damaged record: the shapes say enough
        return ""
    mine = config.to_dict()
    fields = [k for k in mine if k != "name" and k in saved and saved[k] != mine[k]]
    if not fields:
        return ""
    theirs = ", ".join(f"{k}={saved[k]!r}" for k in fields)
    ours = ", ".join(f"{k}={mine[k]!r}" for k in fields)
    return f"; it was saved from a model with {theirs} (this one has {ours})"


def _few(keys: list[str], shown: int = 4) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{len(keys)} ({', '.join(keys[:shown])}{more})"
