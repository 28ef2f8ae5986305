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
global when they look it up, before it could be called. ``weights_only=False`` is refused as well. A file that
cannot be read as a checkpoint at all (empty, cut short, garbled, a folder where a file belongs, a DCP folder
without ``.metadata``, a shard that is missing or shorter than its metadata says, metadata of the wrong types)
raises ``UnreadableCheckpointError`` (a ``ValueError`` too), one line naming the file: never a traceback of
whatever the reader tripped on. A DCP folder is checked before anything is allocated: its tensors may declare at
most the bytes its shard files hold, so a small folder cannot make a reader allocate a huge tensor.

What is allowed was found by listing the globals of every checkpoint the project writes (``sppo fit`` on one
process and on several, folder and file; Fabric's ``save`` on one and several; ``recipes/pretrain_fabric.py``;
``torch.serialization.get_unsafe_globals_in_checkpoint`` and a recording unpickler for DCP's ``.metadata``): they
need none beyond PyTorch's own list but for ``pathlib`` paths (a ``Path`` given as a hyper-parameter, DCP's
``StorageMeta.checkpoint_id``). A type you trust is added, by name and explicitly, with PyTorch's
``torch.serialization.add_safe_globals([...])``, which ``load_file`` honours (docs/checkpoints.md).
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
import re
import stat
import struct
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
    "UnreadableCheckpointError",
    "UnsafeCheckpointError",
    "check_weights_only",
    "load_dict",
    "load_distributed",
    "load_file",
    "unreadable",
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


class UnreadableCheckpointError(ValueError):
    """A file or folder that cannot be read as a checkpoint (damaged, cut short, or not one): one line naming it."""


_READ_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError,  # torch's zip reader ("failed finding central directory", a record of the wrong size)
    EOFError,  # an empty or cut-short pickle
    ValueError,  # a garbled pickle (UnicodeDecodeError, an enum value it does not have)
    KeyError,  # a storage key or layout name the file does not have
    IndexError,
    TypeError,  # a type called with arguments it does not take
    AttributeError,
    OverflowError,
    struct.error,
    pickle.UnpicklingError,
)
"""What reading a damaged file raises from inside the unpicklers and torch's zip reader: the file's fault, so one
``UnreadableCheckpointError`` line naming it instead of the traceback (a refusal, ``UnsafeCheckpointError``, is
raised as itself before)."""


def unreadable(where: str, reason: str) -> UnreadableCheckpointError:
    """The one-line error for ``where`` (a file, or a folder) that cannot be read as a checkpoint, and why."""
    return UnreadableCheckpointError(
        f"Cannot read {where}: {reason}; it is damaged, cut short or not a checkpoint lightning-sppo wrote: give a"
        " complete checkpoint (docs/checkpoints.md)."
    )


def _first_line(error: BaseException) -> str:
    """An exception as one short line: its type and the first non-empty line of its message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    text = text if len(text) <= 200 else text[:200] + "..."
    kind = type(error).__name__
    kind = kind if kind[0].isupper() else f"{type(error).__module__}.{kind}"  # struct.error
    return f"{kind}: {text}" if text else kind


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
    that asks for anything else, ``UnreadableCheckpointError`` for one that cannot be read (a ``FileNotFoundError``
    for a missing one, which callers tell apart)."""
    where = name or str(path)
    if isinstance(path, (str, os.PathLike)) and Path(path).is_dir():
        raise unreadable(where, "it is a folder where a checkpoint file belongs")
    _refuse_unsafe_globals(path, where)
    try:
        with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:  # what the scan cannot see (a legacy file, a global built on the stack)
        raise _refusal(where, error) from None
    except _READ_ERRORS as error:  # a damaged file: torch's zip reader or the unpickler tripped on it
        raise unreadable(where, _first_line(error)) from error


def load_dict(
    path: Path | IO[bytes], *, mmap: bool = False, map_location: Any = "cpu", name: str | None = None
) -> dict:
    """``load_file`` of a file that must hold a dict (every checkpoint file, a folder's ``meta.pt``): anything else
    is one ``UnreadableCheckpointError`` line, not an ``AttributeError`` wherever its entries are first read."""
    loaded = load_file(path, mmap=mmap, map_location=map_location, name=name)
    if not isinstance(loaded, dict):
        raise unreadable(name or str(path), f"it holds a {type(loaded).__name__}, not a checkpoint's dict of entries")
    return loaded


def _refuse_unsafe_globals(path: Path | IO[bytes], where: str) -> None:
    """Every global the file's pickle names, read from its opcodes without running them: all of them in the error."""
    with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except _READ_ERRORS:  # not a zip checkpoint, or a damaged one: torch.load says what it is
            unsafe = []
        finally:
            if not isinstance(path, (str, Path)):
                path.seek(0)
    if unsafe:
        shown = ", ".join(sorted(unsafe)[:3]) + (", ..." if len(unsafe) > 3 else "")
        raise _refused(where, f"it asks for the global{'s' if len(unsafe) > 1 else ''} {shown}")


def _refusal(where: str, error: pickle.UnpicklingError) -> UnsafeCheckpointError | UnreadableCheckpointError:
    """torch's multi-line "Weights only load failed" as one line naming the global; an opcode or a pickle it cannot
    read (random bytes, a raw ``pickle`` file, a garbled one) as an unreadable file."""
    text = str(error)
    if "Weights only load failed" not in text:
        return unreadable(where, _first_line(error))
    if found := re.search(
        r"GLOBAL ([\w.]+)", text
    ):  # "Unsupported global: GLOBAL x.y was not ...", "... GLOBAL x.y whose"
        return _refused(where, f"it asks for the global {found.group(1)}")
    found = re.search(r"WeightsUnpickler error:\s*(.*?)\s*(?:\n\n|$)", text, re.S)
    detail = " ".join(found.group(1).split()) if found and found.group(1).strip() else "no detail"
    if detail.startswith("Unsupported operand"):  # not a pickle torch.save writes: data it cannot read
        return unreadable(where, f"it is not a torch.save file (the weights-only unpickler: {detail})")
    return _refused(where, f"the weights-only unpickler refused it ({detail})")


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
        if Path(str(path)).exists():
            return load_dict(Path(path), map_location=map_location)
        with fs.open(path, "rb") as f:  # a remote file (fsspec), as Lightning reads it
            return load_dict(io.BytesIO(f.read()), map_location=map_location, name=str(path))


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
    """DCP's ``FileSystemReader`` whose ``.metadata`` is unpickled finding only DCP's metadata types and checked
    (``_check_metadata``: its types, shard files in the folder that hold what it says, no more tensor bytes than
    they do), and whose pickled entries are read as ``load_file`` reads a file."""

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> _dcp_metadata.Metadata:
        path = Path(str(self._get_metadata_path(kwargs.get("rank"))))
        if not path.is_file():
            raise unreadable(str(path.parent), f"it has no {path.name} (DCP's index of the shards)")
        try:
            with self.fs.create_stream(path, "rb") as file:
                metadata = _MetadataUnpickler(file, str(path)).load()
        except (UnsafeCheckpointError, UnreadableCheckpointError):
            raise
        except _READ_ERRORS as error:  # a damaged or garbled .metadata
            raise unreadable(str(path), _first_line(error)) from error
        _check_metadata(metadata, path)
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = _dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _DataOnlyBytes(planner, Path(str(self.path))))


def _check_metadata(metadata: Any, path: Path) -> None:
    """DCP's ``Metadata`` of the types DCP writes, whose shard files are regular files of the folder (not ``../``
    or absolute paths elsewhere, not a device such as ``/dev/zero``) holding every byte range it names, and whose
    tensors declare no more bytes than those files hold: what DCP's load then allocates and reads is bounded by
    the folder's size. Compressed entries (DCP's experimental ``stream.zstd``) are refused: lightning-sppo writes
    none, and decompressing one is unbounded."""
    if not isinstance(metadata, _dcp_metadata.Metadata):
        raise _refused(str(path), f"it holds a {type(metadata).__name__}, not DCP metadata")
    where = str(path)
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise unreadable(where, "its state_dict_metadata and storage_data are not dicts, as DCP writes them")
    if not isinstance(metadata.storage_meta, (_dcp_metadata.StorageMeta, type(None))):
        raise unreadable(where, f"its storage_meta is a {type(metadata.storage_meta).__name__}, not a StorageMeta")
    declared = sum(_tensor_bytes(key, entry, where) for key, entry in entries.items())
    sizes = _shard_sizes(storage, path)
    if declared > sum(sizes.values()):
        raise unreadable(
            where,
            f"its tensors declare {declared} bytes, more than its shard files hold ({sum(sizes.values())} bytes)",
        )


def _tensor_bytes(key: Any, entry: Any, where: str) -> int:
    """The bytes an entry's tensor declares (0 for a pickled entry); an entry of another shape is unreadable."""
    if not isinstance(key, str):
        raise unreadable(where, f"it has an entry named {key!r}, not a string")
    if isinstance(entry, _dcp_metadata.BytesStorageMetadata):
        return 0
    if not isinstance(entry, _dcp_metadata.TensorStorageMetadata):
        raise unreadable(where, f"its entry {key!r} is a {type(entry).__name__}, not tensor or bytes metadata")
    size, dtype = entry.size, getattr(entry.properties, "dtype", None)
    if not _sizes(size) or not isinstance(dtype, torch.dtype) or not isinstance(entry.chunks, list):
        raise unreadable(where, f"its entry {key!r} has no valid size, dtype and chunks ({entry!r:.200})")
    for chunk in entry.chunks:
        offsets, lengths = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        fits = _sizes(offsets) and _sizes(lengths) and len(offsets) == len(lengths) == len(size)
        if not fits or any(o + n > dim for o, n, dim in zip(offsets, lengths, size, strict=True)):
            raise unreadable(where, f"a chunk of its entry {key!r} ({chunk!r:.200}) does not lie in its size {size}")
    return math.prod(size) * dtype.itemsize


def _sizes(values: Any) -> bool:
    return isinstance(values, (tuple, list)) and all(type(v) is int and v >= 0 for v in values)


def _shard_sizes(storage: dict[Any, Any], path: Path) -> dict[str, int]:
    """The size of every shard file ``storage`` names, once each its byte ranges are checked to lie in it."""
    where, sizes = str(path), {}
    for info in storage.values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or Path(relative).name != relative or relative in ("", ".", ".."):
            raise _refused(where, f"it names the shard file {relative!r}, which is not a file of its folder")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not _sizes([offset, length]):
            raise unreadable(where, f"it gives the shard {relative!r} the byte range {offset!r}+{length!r}")
        if getattr(info, "transform_descriptors", None):
            raise unreadable(
                where, f"its entries in {relative!r} are transformed ({info.transform_descriptors}), e.g. compressed"
            )
        if relative not in sizes:
            sizes[relative] = _regular_file_size(path.parent / relative, where)
        if offset + length > sizes[relative]:
            raise unreadable(
                where,
                f"it names bytes {offset}..{offset + length} of the shard {relative!r}, which has {sizes[relative]}"
                " (cut short?)",
            )
    return sizes


def _regular_file_size(file: Path, where: str) -> int:
    try:
        found = file.stat()  # through a symlink (a Hugging Face cache links to its blobs): what is read
    except OSError:
        raise unreadable(where, f"its shard file {file.name!r} is missing") from None
    if not stat.S_ISREG(found.st_mode):
        raise unreadable(where, f"its shard file {file.name!r} is not a regular file (a device, a pipe, a folder)")
    return found.st_size


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
        with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):  # TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 reads it so
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
    except CheckpointException as error:  # a BaseException: as an Exception, a damaged folder's in one line
        failure = _checkpoint_failure(error, path)
        raise failure from (None if isinstance(failure, (UnsafeCheckpointError, UnreadableCheckpointError)) else error)


def _checkpoint_failure(error: CheckpointException, path: Path) -> Exception:
    """The first refusal among every rank's failures, else the first failure reading the folder raised as one
    ``UnreadableCheckpointError`` line, else the first failure as itself (a bug keeps its traceback). DCP's
    ``CheckpointException`` is a ``BaseException`` (an ``except Exception`` lets it through) whose message holds
    every rank's traceback. DCP's own reads of tensor entries use the weights-only unpickler: its refusal names
    the global too."""
    failures = [failure for failure, _ in error.failures.values()]
    for kind in (UnsafeCheckpointError, UnreadableCheckpointError):
        if found := [failure for failure in failures if isinstance(failure, kind)]:
            return found[0]
    for failure in failures:
        if isinstance(failure, pickle.UnpicklingError):
            return _refusal(f"{path} (a tensor entry)", failure)
    for failure in failures:  # DCP's reader tripped on the folder's bytes (a size it asserts, a short read)
        if isinstance(failure, (*_READ_ERRORS, OSError, AssertionError)):
            return unreadable(str(path), _first_line(failure))
    return next((f for f in failures if isinstance(f, Exception)), RuntimeError(f"DCP's load of {path} failed"))
