"""Which model a run trains, and where its weights come from: ``GPTPretraining``'s ``model``, ``model_overrides``
and ``init_from``, turned into a ``GPTConfig`` with errors that name those settings, and the one line a run
prints about them when it starts.

The architecture comes from ``init_from`` when it is set (a Hugging Face folder's ``config.json``, or the
``model_config`` a checkpoint of this project records), else from the registered name ``model``; then
``model_overrides`` changes fields on top. The weights come from a resumed checkpoint (``ckpt_path``), else from
``init_from`` (its safetensors, or a checkpoint's weights alone: optimizer, schedule, step and data position
start afresh), else from a random initialisation.

With ``init_from`` the weights fix every size a weight has: ``model_overrides`` may change only what sizes no
weight (``block_size``, RoPE, ``norm_eps``, ...); one that reshapes a weight (``vocab_size``, ``n_layer``, ...) is
refused here, before the load it would fail.
"""

from __future__ import annotations

import difflib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_sppo.errors import SPPOConfigError, config_errors
from lightning_sppo.model import GPT, GPTConfig
from lightning_sppo.model.hf import check_hf_shapes, hf_model_config, load_hf_weights

__all__ = ["PLACEHOLDER", "load_initial_weights", "model_config", "start_line", "vocabulary_error", "weight_shapes"]

PLACEHOLDER = "REPLACE-ME"
"""What the shipped configs hold where a user's own path goes (``init_from``)."""
_META = "meta.pt"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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
    config = _overridden(base, overrides or {})
    if init_from is not None and overrides:
        _check_weight_shapes(base, config, overrides, str(init_from))
    return config


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


def _check_weight_shapes(base: GPTConfig, config: GPTConfig, overrides: dict[str, Any], init_from: str) -> None:
    """``model_overrides`` on top of ``init_from`` must leave every weight's shape as the folder or checkpoint has
    it: its weights are loaded into the model, and a weight of another shape cannot be."""
    if weight_shapes(config) == weight_shapes(base):
        return
    reshaping = [
        key for key in overrides if getattr(base, key) != getattr(config, key) and _reshapes(base, key, config)
    ]
    changes = ", ".join(f"{key}: {getattr(base, key)!r} -> {getattr(config, key)!r}" for key in reshaping)
    tokens = (
        " (the data must fit init_from's vocabulary: prepare it with init_from's tokenizer, sppo-prepare TEXTS --output"
        " NAME --tokenizer DIR)"
        if "vocab_size" in reshaping
        else ""
    )
    raise SPPOConfigError(
        f"model.model_overrides {changes or overrides} would reshape the weights of model.init_from={init_from!r},"
        " which load as they are: with init_from, model_overrides may change only what no weight depends on"
        f" (block_size, rope_base, rope_scaling, norm_eps). Remove {', '.join(reshaping) or 'them'} from"
        f" model.model_overrides{tokens}, or remove model.init_from to train that architecture from random weights."
    )


def _reshapes(base: GPTConfig, key: str, config: GPTConfig) -> bool:
    try:
        alone = replace(base, **{key: getattr(config, key)})
    except (TypeError, ValueError):  # valid only together with the other overrides: it takes part
        return True
    return weight_shapes(alone) != weight_shapes(base)


def weight_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape in ``GPT(config)``, built on the meta device (no memory, and the global
    generator left as it was: building a GPT draws its seed from it)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return {name: tuple(t.shape) for name, t in GPT(config).state_dict().items()}


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


def vocabulary_error(data_path: str, vocab_size: int, config: GPTConfig, init_from: str | None) -> str:
    """What to do about a token file whose vocabulary is larger than the model's: with ``init_from`` no setting can
    fix it (its weights fix the vocabulary), so the line names what can: the tokenizer to prepare the data with,
    another token file, or another model."""
    head = (
        f"The token file data.path={data_path!r} has vocab_size={vocab_size}, above the model's"
        f" vocab_size={config.vocab_size}: token ids would fall outside the vocabulary."
    )
    if init_from is None:
        return (
            f"{head} Prepare the data with the model's tokenizer (sppo-prepare TEXTS --output NAME --tokenizer DIR), or"
            f" set model.model_overrides: {{vocab_size: {vocab_size}}} to train a vocabulary that holds it."
        )
    folder = Path(init_from)
    if is_checkpoint(folder):
        tokenizer = "the tokenizer its model was trained with (sppo-prepare TEXTS --output NAME --tokenizer DIR)"
    elif any((folder / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = f"its tokenizer (sppo-prepare TEXTS --output NAME --tokenizer {init_from})"
    else:
        tokenizer = (
            f"the tokenizer its model was trained with ({init_from} holds none; sppo-prepare TEXTS --output NAME"
            " --tokenizer DIR)"
        )
    return (
        f"{head} model.init_from={init_from!r} fixes the vocabulary (its weights are loaded as they are; no"
        f" model.model_overrides can change it): prepare the data with {tokenizer} and give NAME as data.path, or give"
        f" a token file of at most {config.vocab_size} ids, or choose a model.init_from whose vocabulary holds"
        f" {vocab_size} ids."
    )


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
    config: GPTConfig,
    model: str,
    overrides: dict[str, Any] | None,
    init_from: str | None,
    ckpt_path: str | None,
    seed: int | None = None,
) -> str:
    """What a run trains and from which weights, in one line (printed once, by rank 0, when it starts); ``seed``:
    the ``seed_everything`` value a random initialisation comes from, where it is known."""
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
        weights = "a random initialisation (seed_everything" + (f"={seed})" if seed is not None else ")")
    return f"Model: {name} ({sizes}), architecture from {where}; weights from {weights}."
