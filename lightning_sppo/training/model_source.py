"""Which model a run trains, and where its weights come from: ``GPTPretraining``'s ``model``, ``model_overrides``
and ``init_from``, turned into a ``GPTConfig`` with errors that name those settings, and the one line a run
prints about them when it starts.

The architecture comes from ``init_from`` when it is set (a Hugging Face folder's ``config.json``, or the
``model_config`` a checkpoint of this project records), else from the registered name ``model``; then
``model_overrides`` changes fields on top. The weights come from a resumed checkpoint (``ckpt_path``), else from
``init_from`` (its safetensors, or a checkpoint's weights alone: optimizer, schedule, step and data position
start afresh), else from a random initialisation.
"""

from __future__ import annotations

import difflib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from torch import nn

from lightning_sppo.errors import SPPOConfigError, config_errors
from lightning_sppo.model import GPTConfig
from lightning_sppo.model.hf import check_hf_shapes, hf_model_config, load_hf_weights

__all__ = ["PLACEHOLDER", "load_initial_weights", "model_config", "start_line"]

PLACEHOLDER = "REPLACE-ME"
"""What the shipped configs hold where a user's own path goes (``init_from``)."""
_META = "meta.pt"


def model_config(model: str, overrides: dict[str, Any] | None, init_from: str | None) -> GPTConfig:
    """The ``GPTConfig`` the settings ask for (see the module docstring); a mistake is one ``SPPOConfigError``
    line naming ``model.model``, ``model.init_from`` or ``model.model_overrides``."""
    if init_from is not None:
        base = _init_from_config(str(init_from))
    elif model in GPTConfig.available():
        base = GPTConfig.from_name(model)
    else:
        close = difflib.get_close_matches(str(model), GPTConfig.available(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SPPOConfigError(
            f"model.model={model!r} is not a registered model; {hint}registered: {', '.join(GPTConfig.available())}"
            " (or set model.init_from to a Hugging Face folder)."
        )
    return _overridden(base, overrides or {})


def _overridden(base: GPTConfig, overrides: dict[str, Any]) -> GPTConfig:
    names = [f.name for f in fields(GPTConfig)]
    for key in overrides:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"fields: {', '.join(names)}"
            raise SPPOConfigError(f"model.model_overrides has no field {key!r} (a GPTConfig field); {hint}")
    try:
        return replace(base, **overrides)
    except (TypeError, ValueError) as error:
        raise SPPOConfigError(f"model.model_overrides={overrides}: {error}") from error


def _init_from_config(path: str) -> GPTConfig:
    if is_checkpoint(Path(path)):
        from lightning_sppo.model.export import check_recorded_architecture, checkpoint_meta, resolve_config

        config = resolve_config(checkpoint_meta(Path(path)), source=Path(path))
        check_recorded_architecture(Path(path), config)  # before every rank allocates the model it records
        return config
    try:
        config = hf_model_config(path)
        check_hf_shapes(path, config)  # before every rank allocates the model config.json declares
        return config
    except FileNotFoundError as error:
        what = "is the config's placeholder" if PLACEHOLDER in path else "is not a Hugging Face checkpoint folder"
        raise SPPOConfigError(
            f"model.init_from={path!r} {what}: it has no config.json. Set --model.init_from to a local folder holding"
            " config.json and the *.safetensors weights (e.g. from `hf download`), or to a checkpoint of this project"
            " (its weights only), or remove init_from to start from random weights (of the architecture model.model"
            " names)."
        ) from error
    except ValueError as error:  # a config.json of another architecture, or one we cannot read
        raise SPPOConfigError(
            f"model.init_from={path!r}: {error} Set --model.init_from to the Hugging Face folder of a supported model,"
            " or remove it to start from random weights (of the architecture model.model names)."
        ) from error


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint of this project (a ``torch.save`` file, or a folder with ``meta.pt``), as
    opposed to a Hugging Face folder."""
    return path.is_file() or (path / _META).is_file()


def load_initial_weights(model: nn.Module, init_from: str) -> None:
    """``init_from``'s weights into ``model`` (a GPT or this rank's stage of one, possibly sharded)."""
    try:
        with config_errors():  # hf.py's and export.py's one-line ValueErrors: this runs inside fit, not at set-up
            if is_checkpoint(Path(init_from)):
                from lightning_sppo.model.export import load_checkpoint_weights

                load_checkpoint_weights(model, Path(init_from))
            else:
                load_hf_weights(model, init_from)
    except SPPOConfigError as error:
        if "init_from" in str(error):  # already names the setting
            raise
        raise SPPOConfigError(f"model.init_from={init_from!r}: {error}") from error


def start_line(
    config: GPTConfig, model: str, overrides: dict[str, Any] | None, init_from: str | None, ckpt_path: str | None
) -> str:
    """What a run trains and from which weights, in one line (printed once, by rank 0, when it starts)."""
    name = f"{config.name!r}" if config.name else "a custom architecture"
    sizes = f"{config.num_parameters() / 1e6:.1f}M parameters, {config.n_layer} layers, n_embd={config.n_embd}"
    if init_from is not None:
        source = "the checkpoint" if is_checkpoint(Path(init_from)) else "config.json of"
        where = f"model.init_from ({source} {init_from})"
        if model != "tiny":  # the class default: a name the settings gave, which init_from overrules
            where += f"; model.model={model!r} is ignored"
    else:
        where = f"model.model={model!r}"
    if overrides:
        where += f", with model.model_overrides {overrides}"
    if ckpt_path is not None:
        weights = f"the checkpoint {ckpt_path} (resumed)"
    elif init_from is not None:
        weights = f"{init_from} (model.init_from)"
    else:
        weights = "a random initialisation (seed_everything)"
    return f"Model: {name} ({sizes}), architecture from {where}; weights from {weights}."
