"""Damaged and forged checkpoints for the tests: real checkpoints of this project (``tests/training/fixtures``) with
one part cut, garbled, missing or of another type, built by the tests themselves, never committed.

Each is what a full disk, a partial copy or a hand-edited file leaves, or what someone could send: reading it
must end in one line naming the file (``UnreadableCheckpointError``), never in the traceback of whatever the reader
tripped on, nor in an allocation of whatever size it declares. Names: ``file-*`` damage a Trainer file
(``fit-1dev.ckpt``), ``folder-*`` a folder of two processes (``fit-pp2-folder.ckpt``), ``fabric-*`` Fabric's own
(``fabric-1dev.ckpt``, ``fabric-pp2-folder.ckpt``).
"""

from __future__ import annotations

import copy
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.training.untrusted import FIXTURES, _trusted, _with_entry

GARBLED = "garbled-entry-value"
"""The value of the extra DCP entry of ``fabric-entry-garbled``, whose bytes are then overwritten."""


def _rezipped(source: Path, target: Path, edit: Callable[[str, bytes], bytes | None]) -> None:
    """``source`` written again as ``target`` with ``edit(name, data)`` applied to every record (None: dropped); its
    zip directory stays intact, so it passes the check for a file cut short and only its contents are damaged."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w") as out:
        for name in archive.namelist():
            if (data := edit(name, archive.read(name))) is not None:
                out.writestr(name, data)


def _saved(source: Path, target: Path, edit: Callable[[dict], None]) -> None:
    checkpoint = _trusted(source)
    edit(checkpoint)
    torch.save(checkpoint, target)


def _metadata(folder: Path, edit: Callable) -> None:
    metadata = copy.deepcopy(FileSystemReader(folder).read_metadata())
    edit(metadata)
    with (folder / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)


def _huge(metadata) -> None:
    """The embedding declared as 2**40 elements: 4 TiB (an allocation that fails), from a folder of kilobytes."""
    entry = next(e for k, e in metadata.state_dict_metadata.items() if k.endswith("wte.weight"))
    entry.size = torch.Size([2**32, 2**8])


def _files(work: Path) -> dict[str, Path]:
    fit, fabric, paths = FIXTURES / "fit-1dev.ckpt", FIXTURES / "fabric-1dev.ckpt", {}
    for name, source, edit in [
        ("file-pickle-cut", fit, lambda n, d: d[: len(d) // 2] if n.endswith("data.pkl") else d),
        ("file-storage-missing", fit, lambda n, d: None if n.endswith("/data/0") else d),
        ("fabric-pickle-cut", fabric, lambda n, d: d[: len(d) // 2] if n.endswith("data.pkl") else d),
    ]:
        paths[name] = work / f"{name}.ckpt"
        _rezipped(source, paths[name], edit)

    def no_config(ckpt: dict, init_from: Path) -> None:
        del ckpt["model_config"]
        ckpt["hyper_parameters"]["init_from"] = str(init_from)

    for name, edit in [
        ("file-state-dict-list", lambda c: c.update(state_dict=[1, 2])),
        ("file-model-config-bad", lambda c: c["model_config"].update(n_layer=-1)),
        ("file-init-from-loop", lambda c: no_config(c, work / "file-init-from-loop.ckpt")),
        ("file-huge-architecture", lambda c: c["model_config"].update(vocab_size=2**40)),
    ]:
        paths[name] = work / f"{name}.ckpt"
        _saved(fit, paths[name], edit)
    return paths


def _folders(work: Path) -> dict[str, Path]:
    paths = {}
    for name in (
        "folder-no-metadata",
        "folder-metadata-cut",
        "folder-shard-cut",
        "folder-huge-tensor",
        "folder-meta-list",
    ):
        paths[name] = work / f"{name}.ckpt"
        shutil.copytree(FIXTURES / "fit-pp2-folder.ckpt", paths[name])
    (paths["folder-no-metadata"] / ".metadata").unlink()
    metadata = paths["folder-metadata-cut"] / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:200])
    for shard in paths["folder-shard-cut"].glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    _metadata(paths["folder-huge-tensor"], _huge)
    torch.save([1, 2], paths["folder-meta-list"] / "meta.pt")
    paths["fabric-shard-cut"] = work / "fabric-shard-cut.ckpt"
    shutil.copytree(FIXTURES / "fabric-pp2-folder.ckpt", paths["fabric-shard-cut"])
    for shard in paths["fabric-shard-cut"].glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    paths["fabric-entry-garbled"] = work / "fabric-entry-garbled.ckpt"
    _with_entry(FIXTURES / "fabric-pp2-folder.ckpt", paths["fabric-entry-garbled"], GARBLED)
    for shard in paths["fabric-entry-garbled"].glob("*.distcp"):
        shard.write_bytes(shard.read_bytes().replace(GARBLED.encode(), b"\xff" * len(GARBLED)))
    return paths


def make_damaged(work: Path) -> dict[str, Path]:
    """Every damaged checkpoint (the module docstring), in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    return _files(work) | _folders(work)
