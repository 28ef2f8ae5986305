"""``sppo-export CHECKPOINT OUT_DIR``: any checkpoint this project writes, as a Hugging Face folder.

    sppo-export runs/llama/checkpoints/step-001000 hf-out/                    # distributed folder, any layout
    sppo-export runs/llama/checkpoints/last.ckpt hf-out/ --dtype bfloat16     # Trainer checkpoint
    sppo-export old.pt hf-out/ --model gpt-1b --override block_size=1048576   # no config recorded

Reads, on one process and without a process group:

* a distributed checkpoint folder (torch.distributed.checkpoint, written by Fabric's or the Trainer's
  ``save`` on several devices): its keys are the plain GPT's whatever the (pp, dp, sp) layout;
* a single file ``{"model": <plain GPT state dict>, ...}`` (``save_distributed_checkpoint=False``);
* a Trainer ``.ckpt`` of one device: Lightning's ``state_dict`` with the LightningModule's ``model.`` prefix.

Optimizer states are not read. The model's architecture comes from, in this order: ``--model NAME`` when
given; the checkpoint's ``"model_config"`` entry (``GPTConfig.to_dict()``); the Trainer's
``hyper_parameters`` (``GPTPretraining``'s ``init_from`` folder or ``model`` name, with ``model_overrides``).
``--override FIELD=VALUE`` changes ``GPTConfig`` fields on top (e.g. the ``block_size`` trained at).
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.hf import hf_model_config, save_hf

__all__ = ["export_checkpoint", "main", "read_checkpoint", "resolve_config"]

_META = "meta.pt"  # what strategy.checkpoint writes next to the shards of a distributed checkpoint
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODEL_MARKER = "norm_f.weight"  # every whole GPT state dict has it; optimizer states' keys never end with it


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    model: str | None = None,
    overrides: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> GPTConfig:
    """Write ``checkpoint`` as a Hugging Face folder at ``out_dir``; returns the model's config."""
    state_dict, meta = read_checkpoint(Path(checkpoint))
    config = resolve_config(meta, model, overrides)
    save_hf(config, state_dict, Path(out_dir), dtype, max_shard_bytes)
    return config


def read_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The plain GPT state dict of a checkpoint, and its other (non-tensor-state) entries."""
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}.")
    if path.is_dir():
        return _read_distributed(path)
    saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a {type(saved).__name__}, not a checkpoint dict.")
    if isinstance(saved.get("state_dict"), dict):  # the Trainer on one device: the LightningModule's state
        prefix = _prefix(saved["state_dict"], path)
        state_dict = {k.removeprefix(prefix): v for k, v in saved["state_dict"].items() if k.startswith(prefix)}
        return state_dict, {k: v for k, v in saved.items() if k not in ("state_dict", "optimizer_states")}
    models = [k for k, v in saved.items() if isinstance(v, dict) and _MODEL_MARKER in v]
    if len(models) != 1:
        raise ValueError(
            f"{path} should hold exactly one GPT state dict (an entry with {_MODEL_MARKER!r}); found"
            f" {models or 'none'} among its keys {sorted(saved)}."
        )
    return saved[models[0]], {k: v for k, v in saved.items() if k != models[0] and not _is_optimizer(v)}


def _read_distributed(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The model's tensors of a torch.distributed.checkpoint folder, loaded without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / _META).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint folder: it has no {_META}.")
    reader = dcp.FileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata
    prefix = _prefix(entries, path)
    # Empty tensors of the saved (global) shapes: DCP fills them from whatever shards the layout wrote.
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    meta = torch.load(path / _META, map_location="cpu", weights_only=False)
    return {key.removeprefix(prefix): value for key, value in state.items()}, meta


def _prefix(keys, path: Path) -> str:
    """The prefix before the GPT's own keys ("model." for the LightningModule's ``model``)."""
    prefixes = {key[: -len(_MODEL_MARKER)] for key in keys if key.endswith(_MODEL_MARKER)}
    prefixes = {p for p in prefixes if p == "" or p.endswith(".")}
    if len(prefixes) != 1:
        raise ValueError(
            f"{path} should hold exactly one GPT (one key ending in {_MODEL_MARKER!r}); found prefixes"
            f" {sorted(prefixes) or 'none'}."
        )
    return prefixes.pop()


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, dict) and "state" in value and "param_groups" in value


def resolve_config(
    meta: dict[str, Any], model: str | None = None, overrides: dict[str, Any] | None = None
) -> GPTConfig:
    """The architecture of a checkpoint (see the module docstring for the order), with ``overrides``."""
    config = _recorded_config(meta, model)
    return replace(config, **overrides) if overrides else config


def _recorded_config(meta: dict[str, Any], model: str | None) -> GPTConfig:
    if model is not None:
        return GPTConfig.from_name(model)
    if "model_config" in meta:
        return GPTConfig.from_dict(meta["model_config"])
    hparams = meta.get("hyper_parameters") or {}
    model_overrides = hparams.get("model_overrides") or {}
    if hparams.get("init_from"):
        source = Path(hparams["init_from"])
        if not (source / "config.json").is_file():
            raise FileNotFoundError(
                f"The checkpoint was trained from init_from={str(source)!r}, whose config.json is gone; restore that"
                " folder, or pass --model NAME (and --override FIELD=VALUE) to say the architecture."
            )
        return hf_model_config(source, **model_overrides)
    if "model" in hparams:
        return GPTConfig.from_name(hparams["model"], **model_overrides)
    raise ValueError(
        "The checkpoint records no model configuration (no 'model_config' entry and no Trainer hyper_parameters);"
        f" pass --model NAME with one of {GPTConfig.available()} (and --override FIELD=VALUE for changed fields)."
    )


def _override(text: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` with a JSON value (numbers, true/false, objects), else the value as a string."""
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise argparse.ArgumentTypeError(f"--override takes FIELD=VALUE (e.g. block_size=1048576), got {text!r}.")
    try:
        return field, json.loads(value)
    except json.JSONDecodeError:
        return field, value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="sppo-export", description="Write a lightning-sppo checkpoint as a Hugging Face folder."
    )
    parser.add_argument("checkpoint", type=Path, help="distributed checkpoint folder, single file or Trainer .ckpt")
    parser.add_argument("out_dir", type=Path, help="folder to write config.json and *.safetensors to")
    parser.add_argument("--model", choices=GPTConfig.available(), help="the architecture, if the checkpoint has none")
    parser.add_argument(
        "--override", type=_override, action="append", default=[], metavar="FIELD=VALUE", help="GPTConfig field"
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="tensor dtype written (default: as saved)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (GiB)")
    args = parser.parse_args(argv)
    config = export_checkpoint(
        args.checkpoint,
        args.out_dir,
        model=args.model,
        overrides=dict(args.override),
        dtype=_DTYPES.get(args.dtype),
        max_shard_bytes=int(args.max_shard_gb * 2**30),
    )
    print(f"wrote {args.out_dir} ({config.num_parameters() / 1e6:.1f}M parameters, {config.n_layer} layers)")


if __name__ == "__main__":
    main()
