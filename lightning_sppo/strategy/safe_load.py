"""Reading a checkpoint a user names as data: tensors, containers, numbers, strings and an allow-list, never code.

A pickle may name any importable function and have the unpickler call it, so reading a checkpoint someone sent
could run any command. Every read of a path a user gives goes through this module instead:

* ``load_file``: a ``torch.save`` file (a single-file checkpoint, a folder's ``meta.pt``) through PyTorch's
  ``weights_only`` unpickler, which builds tensors, containers and primitives and, on top of its own list,
  ``ALLOWED_GLOBALS``;
* ``DataOnlyReader``: a torch.distributed.checkpoint folder, whose ``.metadata`` DCP writes with plain ``pickle``:
  unpickled here finding only DCP's metadata types (and the torch and ``pathlib`` values they hold), and whose
  pickled entries (DCP's ``BytesStorageMetadata``: the non-tensor values of a saved state) go through
  ``load_file``'s rules; ``load_distributed`` runs DCP's load with it;
* ``DataOnlyCheckpointIO``: Lightning's checkpoint IO of the strategies, ``load_file`` in place of ``torch.load``.

A file that asks for any other global raises ``UnsafeCheckpointError`` (a ``ValueError``: one ``sppo: error:``
line, exit status 2) naming the file and the global, before anything in it is built: the unpicklers refuse a
global when they look it up, before it could be called. ``weights_only=False`` is refused as well.

What is allowed was found by listing the globals of every checkpoint the project writes (``sppo fit`` on one
process and on several, folder and file; Fabric's ``save`` on one and several; ``recipes/pretrain_fabric.py``;
``torch.serialization.get_unsafe_globals_in_checkpoint`` and a recording unpickler for DCP's ``.metadata``): they
need none beyond PyTorch's own list but for ``pathlib`` paths (a ``Path`` given as a hyper-parameter, DCP's
``StorageMeta.checkpoint_id``). A type you trust is added, by name and explicitly, with PyTorch's
``torch.serialization.add_safe_globals([...])``, which ``load_file`` honours (docs/checkpoints.md).
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _dcp_files
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future
from typing_extensions import override

from lightning_sppo.errors import SPPOConfigError

__all__ = [
    "ALLOWED_GLOBALS",
    "DataOnlyCheckpointIO",
    "DataOnlyReader",
    "UnsafeCheckpointError",
    "check_weights_only",
    "load_distributed",
    "load_file",
]

ALLOWED_GLOBALS: tuple[type, ...] = (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath,
                                     pathlib.PureWindowsPath)  # fmt: skip
"""Beyond PyTorch's ``weights_only`` list: what the project's and Lightning's checkpoints hold (a path given as a
hyper-parameter, e.g. ``GPTPretraining(init_from=Path(...))``). Building one runs no code of the file's choosing."""

_DCP_METADATA_TYPES: dict[tuple[str, str], Any] = {
    (cls.__module__, cls.__name__): cls
    for cls in (
        _dcp_metadata.Metadata,
        _dcp_metadata.MetadataIndex,
        _dcp_metadata.StorageMeta,
        _dcp_metadata.TensorStorageMetadata,
        _dcp_metadata.BytesStorageMetadata,
        _dcp_metadata.ChunkStorageMetadata,
        _dcp_metadata.TensorProperties,
        _dcp_metadata._MEM_FORMAT_ENCODING,
        _dcp_files._StorageInfo,
        torch.Size,
        *ALLOWED_GLOBALS,
    )
} | {("torch.serialization", "_get_layout"): torch.serialization._get_layout}
"""The globals a DCP ``.metadata`` pickle names (besides ``torch``'s dtypes, memory formats and layouts)."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint that asks for a global outside the allow-list: refused before any of it is built."""


def _refused(where: str, reason: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"Refusing to read {where}: {reason}, and a checkpoint is data, never code (tensors, containers, numbers,"
        " strings and lightning-sppo's allow-list); give a checkpoint lightning-sppo wrote, or see"
        " docs/checkpoints.md to load one you trust."
    )


def check_weights_only(weights_only: bool | None) -> None:
    """``weights_only=False`` (Fabric's and the Trainer's load, ``sppo fit --weights_only false``) would unpickle
    anything: one line instead. None and True read through this module."""
    if weights_only is False:
        raise SPPOConfigError(
            "weights_only=False: lightning-sppo reads checkpoints as data only (docs/checkpoints.md); leave"
            " weights_only unset (or true), and to trust a type a checkpoint needs, add it by name with"
            " torch.serialization.add_safe_globals([...])."
        )


# -- torch.save files ---------------------------------------------------------------------------------------------


def load_file(path: Path | IO[bytes], *, mmap: bool = False, map_location: Any = "cpu", name: str | None = None) -> Any:
    """The object a ``torch.save`` file holds, built by PyTorch's ``weights_only`` unpickler with
    ``ALLOWED_GLOBALS``; ``UnsafeCheckpointError`` (naming ``name``, default the path, and the global) for a file
    that asks for anything else."""
    where = name or str(path)
    _refuse_unsafe_globals(path, where)
    try:
        with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:  # what the scan cannot see (a legacy file, a global built on the stack)
        raise _refusal(where, error) from None


def _refuse_unsafe_globals(path: Path | IO[bytes], where: str) -> None:
    """Every global the file's pickle names, read from its opcodes without running them: all of them in the error."""
    with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except (ValueError, RuntimeError, KeyError):  # not a zip checkpoint: torch.load says what it is
            unsafe = []
        finally:
            if not isinstance(path, (str, Path)):
                path.seek(0)
    if unsafe:
        shown = ", ".join(sorted(unsafe)[:3]) + (", ..." if len(unsafe) > 3 else "")
        raise _refused(where, f"it asks for the global{'s' if len(unsafe) > 1 else ''} {shown}")


def _refusal(where: str, error: pickle.UnpicklingError) -> UnsafeCheckpointError | pickle.UnpicklingError:
    """torch's multi-line "Weights only load failed" as one line naming the global; other errors as they are."""
    text = str(error)
    if "Weights only load failed" not in text:
        return error
    if found := re.search(
        r"GLOBAL ([\w.]+)", text
    ):  # "Unsupported global: GLOBAL x.y was not ...", "... GLOBAL x.y whose"
        return _refused(where, f"it asks for the global {found.group(1)}")
    detail = re.search(r"WeightsUnpickler error: (.*)", text)
    return _refused(where, f"the weights-only unpickler refused it ({detail.group(1) if detail else 'no detail'})")


class DataOnlyCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` that loads with ``load_file``: the strategies' default checkpoint IO, so
    that Fabric's and the Trainer's own loads read data only too."""

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        check_weights_only(weights_only)
        fs = get_filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if Path(str(path)).is_file():
            return load_file(Path(path), map_location=map_location)
        with fs.open(path, "rb") as f:  # a remote file (fsspec), as Lightning reads it
            return load_file(io.BytesIO(f.read()), map_location=map_location, name=str(path))


# -- torch.distributed.checkpoint folders -------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Finds DCP's metadata types, torch's dtypes, memory formats and layouts, nothing else."""

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self.where = where

    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_TYPES:
            return _DCP_METADATA_TYPES[(module, name)]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            return value
        raise _refused(self.where, f"it asks for the global {module}.{name}, which is no DCP metadata type")


class DataOnlyReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is unpickled finding only DCP's metadata types, whose shard
    files must lie in the folder, and whose pickled entries are read as ``load_file`` reads a file."""

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> _dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file, str(path)).load()
        _check_metadata(metadata, Path(str(path)))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = _dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _DataOnlyBytes(planner, Path(str(self.path))))


def _check_metadata(metadata: Any, path: Path) -> None:
    """DCP's ``Metadata`` whose shard files are names in the folder (not ``../`` or absolute paths elsewhere)."""
    if not isinstance(metadata, _dcp_metadata.Metadata):
        raise _refused(str(path), f"it holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or Path(relative).name != relative or relative in ("", ".", ".."):
            raise _refused(str(path), f"it names the shard file {relative!r}, which is not a file of its folder")


class _DataOnlyBytes:
    """A load planner whose ``load_bytes`` (DCP's default: ``torch.load(weights_only=False)``) reads the entry with
    ``load_file`` first; the planner then gets the entry saved again from what that built (data only)."""

    def __init__(self, planner: LoadPlanner, folder: Path) -> None:
        self._planner, self._folder = planner, folder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        where = f"{self._folder} (entry {read_item.dest_index.fqn!r})"
        checked = io.BytesIO()
        torch.save(load_file(value, name=where), checked)
        checked.seek(0)
        self._planner.load_bytes(read_item, checked)


def load_distributed(state: dict[str, Any], path: Path, *, whole: bool = False, no_dist: bool = False) -> None:
    """DCP's load of ``state`` (in place) from the folder ``path`` through ``DataOnlyReader``. ``whole``: every entry
    of the folder into the empty ``state``, on one process. A refusal on any rank is raised as itself (DCP wraps
    every rank's exception into one ``CheckpointException`` of many lines)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = DataOnlyReader(path)
    reader.read_metadata()  # here, so a refusal is raised as itself: DCP's load reads it again, catching errors
    try:
        with warnings.catch_warnings():  # on one process: "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled", category=UserWarning)
            if whole:
                _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
            else:
                dcp.load(state, storage_reader=reader, no_dist=no_dist)
    except CheckpointException as error:
        refused = [failure for failure, _ in error.failures.values() if isinstance(failure, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise
