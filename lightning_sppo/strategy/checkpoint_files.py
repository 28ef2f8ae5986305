"""Checkpoints on disk: writes that a kill cannot corrupt, and finding the newest complete one.

A checkpoint at ``path`` is written under ``.{name}.tmp`` and swapped in once complete. A file moves with
one atomic rename. A folder cannot replace another folder atomically, so the old one is first renamed to
``.{name}.old``. At every instant one of these holds a complete copy of the newest state:

=====================================  =========================================================
killed ...                             what the next save (``recover``) or a resume finds
=====================================  =========================================================
while writing ``.tmp``                 ``path`` (the previous state); the partial ``.tmp`` is dropped
after ``.tmp`` is complete             ``.tmp``, newer than ``path``: swapped in first
between the two renames                no ``path``: ``.tmp`` (complete) swapped in, ``.old`` dropped
before ``.old`` is removed             ``path``; ``.old`` is older and dropped
=====================================  =========================================================

Complete means: a folder holding its ``meta.pt`` (written last), or a ``torch.save`` file whose zip
directory (written last) is intact. Nothing complete is deleted before a newer complete copy is at
``path``.

A folder of checkpoints (``SPPOCheckpoint``'s) also holds ``last.ckpt``, a link to the newest complete one:
``link_last`` replaces it atomically (a new link under a temporary name, renamed over the old), and
``checkpoints_in`` lists the folder's checkpoints, complete and not, for retention.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "META",
    "atomic_torch_save",
    "checkpoints_in",
    "is_complete",
    "link_last",
    "newest_complete_checkpoint",
    "recover",
    "recover_folder",
    "remove_path",
    "replace",
    "temporary_path",
]

META = "meta.pt"
"""The file a checkpoint folder is complete with (written after every shard)."""


def temporary_path(path: Path) -> Path:
    """Where a checkpoint for ``path`` is written before it is swapped in."""
    return path.with_name(f".{path.name}.tmp")


def _old_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def is_complete(path: Path) -> bool:
    """A folder with its ``meta.pt``, or a ``torch.save`` file whose zip directory is intact.

    ``torch.save`` writes the zip's central directory last, so a file cut short by a kill has none; this
    reads only that directory, never the tensors.
    """
    if path.is_dir():
        return (path / META).is_file()
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _completed_at(path: Path) -> int:
    """When the checkpoint became complete (ns): the time of what was written last."""
    return ((path / META) if path.is_dir() else path).stat().st_mtime_ns


def newest_complete_checkpoint(dirpath: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``dirpath`` (or None): what to resume from, e.g. when
    ``last.ckpt`` is missing because a save was killed between its two renames.

    Candidates are every entry of the folder, the hidden ``.{name}.tmp`` / ``.{name}.old`` copies of a swap
    included; complete ones (``is_complete``) are ranked by the time their last part was written. A hidden
    copy is returned as is: the next save to its name swaps it into place (``recover``).
    """
    directory = Path(dirpath)
    if not directory.is_dir():
        return None
    complete = [p for p in directory.iterdir() if is_complete(p)]
    return max(complete, key=lambda p: (_completed_at(p), p.name), default=None)


def checkpoints_in(dirpath: str | os.PathLike, suffix: str = ".ckpt") -> tuple[list[Path], list[Path]]:
    """The visible checkpoints of a folder: (complete ones, oldest first by completion time; incomplete ones).

    Entries named ``*{suffix}`` (files or folders); links (``last.ckpt``) and the hidden copies of a swap
    (``.{name}.tmp`` / ``.{name}.old``, which ``recover`` owns) are not listed.
    """
    directory = Path(dirpath)
    if not directory.is_dir():
        return [], []
    entries = [p for p in directory.iterdir() if p.name.endswith(suffix) and not p.is_symlink()]
    entries = [p for p in entries if not p.name.startswith(".")]
    complete = sorted((p for p in entries if is_complete(p)), key=lambda p: (_completed_at(p), p.name))
    return complete, sorted(p for p in entries if p not in complete)


def link_last(target: Path, link: Path) -> None:
    """Point ``link`` (``last.ckpt``) at ``target`` (a sibling), atomically: a kill leaves the old link or the new.

    The new link is made under a hidden name and renamed over the old one (POSIX ``rename`` replaces a link).
    A ``link`` that is a real file or folder (a copy instead of a link) is removed first.
    """
    if link.exists() and not link.is_symlink():
        remove_path(link)
    fresh = link.with_name(f".{link.name}.link")
    fresh.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), fresh)
    os.replace(fresh, link)


def recover(path: Path) -> None:
    """Finish or undo a swap to ``path`` that a kill interrupted (see the module docstring); idempotent.

    Called before every save to ``path`` (on one process): afterwards ``path`` holds the newest complete
    state, if any, and neither temporary copy exists.
    """
    tmp, old = temporary_path(path), _old_path(path)
    if tmp.exists():
        if is_complete(tmp):
            replace(tmp, path)  # complete but not yet in place: it is the newest
        else:
            remove_path(tmp)  # cut short: the previous state is at ``path`` or ``old``
    if not path.exists() and old.exists() and is_complete(old):
        os.replace(old, path)
    if path.exists():
        remove_path(old)


def recover_folder(dirpath: str | os.PathLike) -> None:
    """``recover`` every interrupted swap in a folder (the hidden ``.{name}.tmp`` / ``.{name}.old`` copies), and
    drop a link left half made by ``link_last``: afterwards every complete state is visible under its name."""
    directory = Path(dirpath)
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        name = entry.name
        if name.startswith(".") and name.endswith((".tmp", ".old")):
            recover(directory / name[1:].rpartition(".")[0])
        elif name.startswith(".") and name.endswith(".link") and entry.is_symlink():
            entry.unlink(missing_ok=True)


def replace(tmp: Path, path: Path) -> None:
    """Move the complete checkpoint ``tmp`` to ``path``; a kill at any point loses nothing (``recover``)."""
    if not path.exists() or (tmp.is_file() and path.is_file()):
        os.replace(tmp, path)  # atomic (POSIX rename), also over an existing file
        return
    old = _old_path(path)
    remove_path(old)  # older than ``path`` (``recover`` ran before this save)
    os.replace(path, old)
    os.replace(tmp, path)  # a kill before this leaves ``tmp`` complete and ``old``: nothing is lost
    remove_path(old)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` under a temporary name, then an atomic rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    tmp = temporary_path(path)
    torch.save(obj, tmp)
    replace(tmp, path)


def remove_path(path: Path) -> None:
    """Delete a checkpoint file or folder (no error if it is gone)."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
