"""Malicious checkpoints for the tests: real checkpoints of this project (``tests/training/fixtures``) with one pickled
object added whose unpickling runs a shell command that creates a marker file.

Built by the tests themselves, never committed. Each is otherwise a checkpoint every entry point accepts, so a
refusal can only come from the object, and the command runs if a reader unpickles it with plain ``pickle`` (the
negative control, ``runs_code``). Four places a checkpoint can carry one:

* ``file``: a single-file checkpoint (``torch.save``) with an extra entry;
* ``folder-meta``: a folder whose ``meta.pt`` (torch.save) has the extra entry;
* ``folder-metadata``: a folder whose DCP ``.metadata`` (plain ``pickle``) carries it as one more attribute;
* ``folder-entry``: a folder whose shards hold it as a DCP entry of its own (a ``BytesStorageMetadata``, which DCP's
  default planner unpickles with ``torch.load(weights_only=False)``).
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import torch

from tests.training.fixtures.make_fixtures import OVERRIDES  # noqa: F401 (the fixtures' model, for the tests)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KINDS = ("file", "folder-meta", "folder-metadata", "folder-entry")


class RunsCode:
    """Unpickled, it runs ``touch MARKER`` (``os.system``): what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _trusted(path: Path):
    """A fixture read whole, trusting it (it is ours): for building the malicious copies only."""
    return torch.load(path, map_location="cpu", weights_only=False)


def make_untrusted(folder: Path, marker: Path) -> dict[str, Path]:
    """The four malicious checkpoints (``KINDS``) in ``folder``, each running ``touch marker`` when unpickled."""
    from torch.distributed.checkpoint import FileSystemReader

    folder.mkdir(parents=True, exist_ok=True)
    paths = {kind: folder / f"untrusted-{kind}.ckpt" for kind in KINDS}
    torch.save(_trusted(FIXTURES / "fit-1dev.ckpt") | {"note": RunsCode(marker)}, paths["file"])
    for kind in ("folder-meta", "folder-metadata"):
        shutil.copytree(FIXTURES / "fit-pp2-folder.ckpt", paths[kind])
    meta = _trusted(paths["folder-meta"] / "meta.pt")
    torch.save(meta | {"note": RunsCode(marker)}, paths["folder-meta"] / "meta.pt")
    metadata = FileSystemReader(FIXTURES / "fit-pp2-folder.ckpt").read_metadata()  # torch's own reader: trusted
    metadata.note = RunsCode(marker)  # the folder still loads with torch's reader (after running the command)
    with (paths["folder-metadata"] / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)
    _with_entry(FIXTURES / "fit-pp2-folder.ckpt", paths["folder-entry"], RunsCode(marker))
    return paths


def _with_entry(source: Path, target: Path, value: object) -> None:
    """The DCP folder ``source`` written again to ``target`` with one more entry, ``note``: ``value`` pickled."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": it is
        _load_state_dict(state, dcp.FileSystemReader(source), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        dcp.save(state | {"note": value}, checkpoint_id=target, no_dist=True)
    shutil.copy(source / "meta.pt", target / "meta.pt")  # last: it marks the folder complete


def runs_code(path: Path, marker: Path) -> bool:
    """Whether reading ``path`` as the project read checkpoints before issue 36 (torch.load with
    ``weights_only=False``, DCP's plain ``pickle`` for ``.metadata`` and its default planner for entries) runs the
    command: the negative control that each malicious checkpoint really is one."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    marker.unlink(missing_ok=True)
    if path.is_dir():
        torch.load(path / "meta.pt", weights_only=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _load_state_dict({}, FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    else:
        torch.load(path, weights_only=False)
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran
