"""``sppo-export CHECKPOINT OUT_DIR``: any checkpoint this project writes, as a Hugging Face folder.

    sppo-export runs/llama/checkpoints/step-001000 hf-out/                    # distributed folder, any layout
    sppo-export runs/llama/checkpoints/last.ckpt hf-out/ --dtype bfloat16     # Trainer checkpoint
    sppo-export old.pt hf-out/ --model gpt-1b --override block_size=1048576   # no config recorded

Reads, on one process and without a process group:

* a distributed checkpoint folder (torch.distributed.checkpoint, written by Fabric's or the Trainer's
  ``save`` on several devices): its keys are the plain GPT's whatever the (pp, dp, sp) layout;
* a single file ``{"model": <plain GPT state dict>, ...}`` (``save_distributed_checkpoint=False``);
* a Trainer ``.ckpt`` of one device: Lightning's ``state_dict`` with the LightningModule's ``model.`` prefix.

Every file is read as data, never code (``strategy.safe_load``: tensors, containers, primitives and an allow-list; a
checkpoint asking for anything else is one ``sppo-export: error:`` line naming the file and the global, before any
of it is built). Optimizer states are not read. The model's architecture comes from, in this order: ``--model NAME``
when given; the checkpoint's ``"model_config"`` entry (``GPTConfig.to_dict()``, in every checkpoint ``sppo fit`` and
Fabric's ``save`` write); the Trainer's ``hyper_parameters`` of older checkpoints (``GPTPretraining``'s
``init_from`` folder or ``model`` name, with ``model_overrides``). ``--override FIELD=VALUE`` changes ``GPTConfig``
fields on top (e.g. the ``block_size`` trained at).

The folder is written whole or not at all: into a fresh hidden folder beside ``OUT_DIR``, then renamed into place,
so it never holds files of two exports (an index of old shards beside new weights would load the old ones); the hidden
folders a killed export left are removed by the next export to the same ``OUT_DIR``. An
``OUT_DIR`` that exists and is not empty is refused unless ``--replace`` says to replace it. The tokenizer files
(``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``, ...) of ``--tokenizer DIR`` (which must
hold some), by default the checkpoint's ``init_from`` folder, are copied in when present.

A mistake in the arguments (a missing or damaged checkpoint, an unknown ``--override`` field, a shard size that is
not a positive finite number, an output that is a file, a ``--tokenizer`` folder without tokenizer files) is one
``sppo-export: error: ...`` line and exit status 2; anything else keeps its traceback and exits with 1.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_sppo.errors import OneLineParser, SPPOConfigError, is_settings_error
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.hf import TOKENIZER_FILES, copy_tokenizer_files, hf_model_config, save_hf

__all__ = [
    "check_recorded_architecture",
    "checkpoint_meta",
    "export_checkpoint",
    "load_checkpoint_weights",
    "main",
    "read_checkpoint",
    "resolve_config",
]

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
    replace_existing: bool = False,
    tokenizer: str | Path | None = None,
) -> GPTConfig:
    """Write ``checkpoint`` as a Hugging Face folder at ``out_dir`` (whole, or nothing: see the module docstring);
    returns the model's config. ``tokenizer``: the folder to copy tokenizer files from (default: the checkpoint's
    ``init_from``, when it still exists)."""
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise SPPOConfigError(
            f"--max-shard-gb must be positive, got {max_shard_bytes / 2**30:g}; e.g. --max-shard-gb 5."
        )
    out_dir = _check_out_dir(Path(out_dir), replace_existing)
    if tokenizer is not None:
        _check_tokenizer_folder(Path(tokenizer))
    state_dict, meta = read_checkpoint(Path(checkpoint))
    try:
        config = resolve_config(meta, model, overrides, source=Path(checkpoint))
    except (TypeError, ValueError) as error:
        if not overrides or is_settings_error(error):
            raise
        raise SPPOConfigError(f"The architecture with --override {overrides} is not valid: {error}") from error
    _check_fits(state_dict, config, Path(checkpoint))
    source = tokenizer if tokenizer is not None else _recorded_tokenizer_folder(meta, Path(checkpoint))
    _remove_killed_exports(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_hf(config, state_dict, tmp, dtype, max_shard_bytes)
        if source is not None and Path(source).is_dir():
            copy_tokenizer_files(Path(source), tmp)
        _swap_in(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return config


def _recorded_tokenizer_folder(meta: dict[str, Any], checkpoint: Path) -> Path | None:
    """The checkpoint's ``init_from`` folder, whose tokenizer files the export copies by default, if it is a folder.
    The checkpoint names it, so its tokenizer files are copied only if they are its own: a forged checkpoint could
    name a folder of its own (relative to where the export runs) whose tokenizer.json links to ~/.ssh/id_rsa, and
    put that file in an export one publishes. A link to a file elsewhere is one line; a Hugging Face cache's links
    from a snapshot into the repository's blobs are the folder's own."""
    source = _hyperparameters(meta, str(checkpoint)).get("init_from")
    if not isinstance(source, (str, os.PathLike)) or not Path(source).is_dir():
        return None
    folder = Path(source).resolve()
    own = [folder] + ([folder.parent.parent / "blobs"] if folder.parent.name == "snapshots" else [])
    for name in TOKENIZER_FILES:
        target = (folder / name).resolve()
        if (folder / name).is_file() and not any(target.is_relative_to(root) for root in own):
            raise SPPOConfigError(
                f"The checkpoint's init_from folder {str(source)!r} links {name} to {str(target)!r}, outside it; its"
                " tokenizer files are copied only when they are its own (the checkpoint names that folder): pass"
                " --tokenizer DIR to copy from a folder you choose."
            )
    return Path(source)


def _check_tokenizer_folder(folder: Path) -> None:
    """A ``--tokenizer`` the user names must be a folder holding tokenizer files: else nothing would be copied."""
    if not folder.is_dir():
        what = "a file, not a folder" if folder.exists() else "not found"
        raise SPPOConfigError(
            f"--tokenizer={str(folder)!r} is {what}; name the folder holding tokenizer.json (the model's Hugging"
            " Face folder), or leave --tokenizer out to copy the checkpoint's init_from tokenizer."
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise SPPOConfigError(
            f"--tokenizer={str(folder)!r} holds none of the tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...);"
            " name the folder holding tokenizer.json, or leave --tokenizer out."
        )


def _check_fits(state_dict: dict[str, Tensor], config: GPTConfig, path: Path) -> None:
    """The weights must be those of ``GPT(config)``: else one line naming the first tensor that differs."""
    from lightning_sppo.strategy.checkpoint_checks import plain_shapes

    shapes = {key: tuple(value.shape) for key, value in state_dict.items()}
    problem = _first_difference(shapes, plain_shapes(config), config.tie_embeddings)
    if problem:
        raise SPPOConfigError(
            f"checkpoint {str(path)!r} does not fit the architecture asked for ({config.name or 'custom'},"
            f" {config.n_layer} layers, n_embd={config.n_embd}): {problem}; pass the --model and --override"
            " FIELD=VALUE it was trained with."
        )


def _first_difference(shapes: dict[str, tuple], expected: dict[str, tuple], tied: bool) -> str | None:
    for key, shape in expected.items():
        if key not in shapes and not (tied and key == "lm_head.weight"):  # a tied head may be left out
            return f"it lacks {key!r}"
        if key in shapes and tuple(shapes[key]) != shape:
            return f"{key!r} has shape {list(shapes[key])} there, {list(shape)} in this architecture"
    extra = next((key for key in shapes if key not in expected), None)
    return None if extra is None else f"it has {extra!r}, which this architecture does not"


def check_recorded_architecture(path: Path, config: GPTConfig) -> None:
    """The architecture a checkpoint records (``config``) must be that of its own tensors, whose shapes are read
    without their data (a folder's DCP metadata, a file memory-mapped): else one line. A record that does not fit
    is damaged, or forged: a small file declaring a huge model would have every rank allocate that model before
    its weights were compared (``--model.init_from``)."""
    from lightning_sppo.strategy.checkpoint_checks import plain_shapes
    from lightning_sppo.strategy.safe_load import unreadable

    problem = _first_difference(_saved_shapes(path), plain_shapes(config), config.tie_embeddings)
    if problem:
        raise unreadable(
            str(path),
            f"the architecture it records ({config.n_layer} layers, n_embd={config.n_embd}, vocab_size="
            f"{config.vocab_size}) is not that of its tensors: {problem}",
        )


def _saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The plain GPT's tensor shapes in a checkpoint, without reading their data."""
    if not path.is_dir():
        return {key: tuple(value.shape) for key, value in read_checkpoint(path)[0].items()}
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_sppo.strategy.safe_load import DataOnlyReader

    _check_checkpoint(path)
    entries = DataOnlyReader(path).read_metadata().state_dict_metadata
    prefix = _prefix(entries, path)
    return {
        key.removeprefix(prefix): tuple(entry.size)
        for key, entry in entries.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }


def _check_out_dir(out_dir: Path, replace_existing: bool) -> Path:
    """``out_dir`` if an export may go there: not a file, not under a file, empty or to be replaced."""
    for parent in (out_dir, *out_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise SPPOConfigError(
                f"out_dir={str(out_dir)!r}: {str(parent)!r} is a file, not a folder; name a folder to export into."
            )
    if out_dir.is_dir() and any(out_dir.iterdir()) and not replace_existing:
        raise SPPOConfigError(
            f"out_dir={str(out_dir)!r} is not empty; name a new folder, or pass --replace to replace it and"
            " everything in it with this export."
        )
    return out_dir


def _remove_killed_exports(out_dir: Path) -> None:
    """The hidden folders a killed export to ``out_dir`` left beside it (``_swap_in``'s, named by a process that is
    gone); those of an export still running are left alone."""
    if not out_dir.parent.is_dir():
        return
    for kind in ("export", "replaced"):
        for path in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.{kind}-*"):
            pid = path.name.rsplit("-", 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _swap_in(tmp: Path, out_dir: Path) -> None:
    """Put the finished folder ``tmp`` at ``out_dir``: a rename; an existing ``out_dir`` is moved aside first and
    deleted after (a kill in between leaves the new export complete at ``out_dir`` or in ``tmp``)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
    os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def read_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The plain GPT state dict of a checkpoint, and its other (non-tensor-state) entries."""
    from lightning_sppo.strategy.safe_load import load_dict, unreadable

    _check_checkpoint(path)
    if path.is_dir():
        return _read_distributed(path)
    saved = load_dict(path, mmap=True)
    if isinstance(saved.get("state_dict"), dict):  # the Trainer on one device: the LightningModule's state
        prefix = _prefix(saved["state_dict"], path)
        state_dict = {k.removeprefix(prefix): v for k, v in saved["state_dict"].items() if k.startswith(prefix)}
        return state_dict, {k: v for k, v in saved.items() if k not in ("state_dict", "optimizer_states")}
    models = [k for k, v in saved.items() if isinstance(v, dict) and _MODEL_MARKER in v]
    if len(models) != 1:
        raise unreadable(
            str(path),
            f"it should hold exactly one GPT state dict (an entry with {_MODEL_MARKER!r}); found {models or 'none'}"
            f" among its keys {sorted(map(str, saved))[:12]}",
        )
    return saved[models[0]], {k: v for k, v in saved.items() if k != models[0] and not _is_optimizer(v)}


def _read_distributed(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The model's tensors of a torch.distributed.checkpoint folder, loaded without a process group."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_sppo.strategy.safe_load import DataOnlyReader, load_dict, load_distributed

    meta = load_dict(path / _META)  # first: its own refusal, before any shard is read
    entries = DataOnlyReader(path).read_metadata().state_dict_metadata
    prefix = _prefix(entries, path)
    # Empty tensors of the saved (global) shapes: DCP fills them from whatever shards the layout wrote.
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    load_distributed(state, path, no_dist=True)
    return {key.removeprefix(prefix): value for key, value in state.items()}, meta


def _prefix(keys, path: Path) -> str:
    """The prefix before the GPT's own keys ("model." for the LightningModule's ``model``)."""
    prefixes = {key[: -len(_MODEL_MARKER)] for key in keys if key.endswith(_MODEL_MARKER)}
    prefixes = {p for p in prefixes if p == "" or p.endswith(".")}
    if len(prefixes) != 1:
        from lightning_sppo.strategy.safe_load import unreadable

        raise unreadable(
            str(path),
            f"it should hold exactly one GPT (one key ending in {_MODEL_MARKER!r}); found prefixes"
            f" {sorted(prefixes) or 'none'}",
        )
    return prefixes.pop()


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, dict) and "state" in value and "param_groups" in value


def resolve_config(
    meta: dict[str, Any],
    model: str | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    source: Path | None = None,
) -> GPTConfig:
    """The architecture of a checkpoint (see the module docstring for the order), with ``overrides``. ``source``
    (the checkpoint's path) names it when what it records cannot be built: one ``UnreadableCheckpointError``
    line, as for any checkpoint that cannot be read."""
    config = _recorded_config(meta, model, str(source) if source is not None else "the checkpoint", ())
    return replace(config, **overrides) if overrides else config


_INIT_FROM_CHAIN = 16
"""How many checkpoints deep an architecture recorded only as ``init_from`` is followed (a loop ends here too)."""


def _recorded_config(meta: dict[str, Any], model: str | None, where: str, seen: tuple[Path, ...]) -> GPTConfig:
    if model is not None:
        return GPTConfig.from_name(model)
    if "model_config" in meta:
        recorded = _of_type(meta["model_config"], dict, where, "model_config")
        return _built(where, "model_config", lambda: GPTConfig.from_dict(recorded))
    hparams = _hyperparameters(meta, where)
    model_overrides = _of_type(hparams.get("model_overrides") or {}, dict, where, "hyper_parameters.model_overrides")
    if hparams.get("init_from"):
        source = Path(_of_type(hparams["init_from"], (str, os.PathLike), where, "hyper_parameters.init_from"))
        if (source / "config.json").is_file():
            return _built(where, "hyper_parameters", lambda: hf_model_config(source, **model_overrides))
        if not (source.is_file() or (source / _META).is_file()):  # nor a checkpoint of ours (init_from takes those)
            raise SPPOConfigError(
                f"The checkpoint was trained from init_from={str(source)!r}, whose config.json is gone (a checkpoint"
                " written before the architecture was saved in every one); restore that folder, or pass --model"
                f" NAME (one of {GPTConfig.available()}) and --override FIELD=VALUE for its changed fields."
            )
        if source.resolve() in seen or len(seen) >= _INIT_FROM_CHAIN:
            from lightning_sppo.strategy.safe_load import unreadable

            raise unreadable(where, f"its architecture is recorded only as init_from={str(source)!r}, a chain of"
                                    " checkpoints that loops or does not end")  # fmt: skip
        recorded = _recorded_config(checkpoint_meta(source), None, str(source), (*seen, source.resolve()))
        return _built(where, "hyper_parameters.model_overrides", lambda: replace(recorded, **model_overrides))
    if "model" in hparams:
        return _built(where, "hyper_parameters", lambda: GPTConfig.from_name(hparams["model"], **model_overrides))
    raise SPPOConfigError(
        "The checkpoint records no model configuration (no 'model_config' entry and no Trainer hyper_parameters);"
        f" pass --model NAME with one of {GPTConfig.available()} (and --override FIELD=VALUE for changed fields)."
    )


def _hyperparameters(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """A checkpoint's ``hyper_parameters`` (the Trainer's: ``model``, ``init_from``, ...), or {} without them."""
    return _of_type(meta.get("hyper_parameters") or {}, dict, where, "hyper_parameters")


def _of_type(value: Any, kind: type | tuple[type, ...], where: str, field: str) -> Any:
    """``value`` if it is a ``kind``; else one line naming the checkpoint and the entry."""
    if isinstance(value, kind):
        return value
    from lightning_sppo.strategy.safe_load import unreadable

    raise unreadable(where, f"its {field} is a {type(value).__name__}")


def _built(where: str, field: str, build: Callable[[], GPTConfig]) -> GPTConfig:
    """``build()`` of an architecture from what a checkpoint records: values ``GPTConfig`` refuses are the
    checkpoint's, so one line naming it and the entry (our own typed errors pass as they are)."""
    from lightning_sppo.strategy.safe_load import unreadable

    try:
        return build()
    except (TypeError, ValueError) as error:
        if is_settings_error(error):
            raise
        raise unreadable(where, f"its {field} is not an architecture lightning-sppo builds ({error})") from None


def checkpoint_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's entries other than its tensors' data (``model_config``, ``hyper_parameters``, ...), read
    without loading the weights: a folder's ``meta.pt``, or a file memory-mapped."""
    from lightning_sppo.strategy.safe_load import load_dict, load_file

    _check_checkpoint(path)
    if path.is_dir():
        return load_dict(path / _META)
    saved = load_file(path, mmap=True)
    if not isinstance(saved, dict):
        raise SPPOConfigError(f"{path} holds a {type(saved).__name__}, not a checkpoint of this project.")
    return {k: v for k, v in saved.items() if not (isinstance(v, dict) and (_MODEL_MARKER in v or _is_optimizer(v)))}


def _check_checkpoint(path: Path) -> None:
    """A one-line error for a checkpoint that is missing or not complete, naming the newest complete one beside."""
    from lightning_sppo.strategy.checkpoint_files import is_complete

    if not path.exists():
        raise SPPOConfigError(f"checkpoint {str(path)!r} does not exist{_newest_beside(path)}.")
    if path.is_dir() and not any(path.glob("*.distcp")):
        raise SPPOConfigError(
            f"checkpoint {str(path)!r} is a folder but not a checkpoint of this project (no {_META})."
        )
    if not is_complete(path):
        what = f"it has no {_META}" if path.is_dir() else "its zip directory is missing"
        raise SPPOConfigError(
            f"checkpoint {str(path)!r} is not a complete checkpoint ({what}: cut short by a full disk, a kill or a"
            f" partial copy){_newest_beside(path)}."
        )


def _newest_beside(path: Path) -> str:
    from lightning_sppo.strategy.checkpoint_files import newest_complete_checkpoint

    newest = newest_complete_checkpoint(path.parent) if path.parent.is_dir() else None
    if newest is None or newest.resolve() == path.resolve():
        return ""
    return f"; the newest complete checkpoint in {str(path.parent)!r} is {newest.name!r}"


def load_checkpoint_weights(model: torch.nn.Module, path: Path) -> list[str]:
    """Fill ``model`` (a ``GPT``, or one pipeline stage of one, possibly FSDP2-sharded) in place from the weights
    of a checkpoint of this project (any format ``read_checkpoint`` reads); returns the names read.

    Every rank reads the whole model state on the host (the file memory-mapped) and copies its own tensors; a
    tied head saved only under the embedding's name takes that.
    """
    from lightning_sppo.model.hf import copy_full_tensor

    state, _ = read_checkpoint(path)
    targets: dict[int, tuple[str, Tensor]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        targets.setdefault(id(param), (name, param))
    read = []
    with torch.no_grad():
        for name, param in targets.values():
            source = name if name in state else "wte.weight" if name == "lm_head.weight" else name
            if source not in state or tuple(state[source].shape) != tuple(param.shape):
                raise SPPOConfigError(
                    f"init_from={str(path)!r} does not hold {name!r} of shape {list(param.shape)} (found"
                    f" {list(state[source].shape) if source in state else 'none'}): it is a checkpoint of another"
                    " architecture than the one asked for (model.model_overrides)."
                )
            copy_full_tensor(param, state[source])
            read.append(name)
    return sorted(read)


def _override(text: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` with a JSON value (numbers, true/false, objects), else the value as a string; FIELD must
    be a ``GPTConfig`` field (else the closest is named)."""
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise argparse.ArgumentTypeError(f"--override takes FIELD=VALUE (e.g. block_size=1048576), got {text!r}.")
    names = [f.name for f in fields(GPTConfig)]
    if field not in names:
        close = difflib.get_close_matches(field, names, n=1)
        hint = f"did you mean {close[0]}?" if close else f"fields: {', '.join(names)}"
        raise argparse.ArgumentTypeError(f"{field!r} is not a GPTConfig field; {hint}")
    try:
        return field, json.loads(value)
    except json.JSONDecodeError:
        return field, value


def _positive_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not value * 2**30 >= 1 or not math.isfinite(value):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}; e.g. 5")
    return value


def main(argv: list[str] | None = None) -> None:
    from lightning_sppo.errors import config_errors
    from lightning_sppo.training.failures import exit_on_failure

    parser = OneLineParser(
        prog="sppo-export", description="Write a lightning-sppo checkpoint as a Hugging Face folder."
    )
    parser.add_argument("checkpoint", type=Path, help="distributed checkpoint folder, single file or Trainer .ckpt")
    parser.add_argument("out_dir", type=Path, help="folder to write config.json and *.safetensors to")
    parser.add_argument("--model", choices=GPTConfig.available(), help="the architecture, if the checkpoint has none")
    parser.add_argument(
        "--override", type=_override, action="append", default=[], metavar="FIELD=VALUE", help="GPTConfig field"
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="tensor dtype written (default: as saved)")
    parser.add_argument("--max-shard-gb", type=_positive_gb, default=5.0, help="largest safetensors file (GiB)")
    parser.add_argument("--replace", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    parser.add_argument("--tokenizer", type=Path, help="copy tokenizer files from here (default: init_from)")
    args = parser.parse_args(argv)  # usage errors: one line, exit status 2
    with exit_on_failure("sppo-export"), config_errors():
        config = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            model=args.model,
            overrides=dict(args.override),
            dtype=_DTYPES.get(args.dtype),
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            replace_existing=args.replace,
            tokenizer=args.tokenizer,
        )
    print(f"wrote {args.out_dir} ({config.num_parameters() / 1e6:.1f}M parameters, {config.n_layer} layers)")


if __name__ == "__main__":
    main()
