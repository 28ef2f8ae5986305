"""``strategy.safe_load`` given files that are damaged, forged or not checkpoints at all (red team of issue 36): each is
one ``UnreadableCheckpointError`` line naming the file (or ``UnsafeCheckpointError`` for code), never the traceback of
whatever the reader tripped on, and a DCP folder is checked before anything it declares is allocated or read.

Every payload is built here. The negative controls read the same files as before (``torch.load``, DCP's own
``FileSystemReader`` and load): they raise an ``EOFError``, a ``RuntimeError`` or DCP's ``CheckpointException`` (a
``BaseException``, which the commands' ``except Exception`` let through), or accept what is refused here.
"""

from __future__ import annotations

import io
import pickle
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_sppo.errors import is_settings_error
from lightning_sppo.strategy.safe_load import (
    DataOnlyCheckpointIO,
    DataOnlyReader,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
    load_dict,
    load_distributed,
    load_file,
)
from tests.training.untrusted import RunsCode


def _one_line(raised: pytest.ExceptionInfo, names: str) -> str:
    message = str(raised.value)
    assert "\n" not in message and names in message, message
    assert is_settings_error(raised.value)  # the commands print it as one `PROG: error:` line, exit status 2
    return message


def _rewritten(source: Path, target: Path, edit) -> Path:
    """``source`` (a torch.save zip) written again to ``target`` with ``edit(name, data)`` applied to each record
    (None drops it): a file whose zip directory is intact, so only its contents are damaged."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w") as out:
        for name in archive.namelist():
            data = edit(name, archive.read(name))
            if data is not None:
                out.writestr(name, data)
    return target


@pytest.fixture
def saved(tmp_path) -> Path:
    torch.save({"w": torch.arange(64.0), "step": 3}, tmp_path / "ok.pt")
    return tmp_path / "ok.pt"


# -- torch.save files -------------------------------------------------------------------------------------------


def _damaged_files(saved: Path) -> dict[str, Path]:
    folder, data = saved.parent, saved.read_bytes()
    (folder / "empty.pt").write_bytes(b"")
    (folder / "cut.pt").write_bytes(data[: len(data) // 2])
    (folder / "text.pt").write_text("hello world\n")
    _rewritten(
        saved, folder / "garbled.pt", lambda n, d: d[:20] + b"\xff\xfe" + d[22:] if n.endswith("data.pkl") else d
    )
    _rewritten(saved, folder / "pickle-cut.pt", lambda n, d: d[: len(d) // 2] if n.endswith("data.pkl") else d)
    _rewritten(saved, folder / "no-storage.pt", lambda n, d: None if n.endswith("/data/0") else d)
    (folder / "a-folder.pt").mkdir()
    names = ("empty", "cut", "text", "garbled", "pickle-cut", "no-storage", "a-folder")
    return {name: folder / f"{name}.pt" for name in names}


def test_a_damaged_file_is_one_line_naming_it_not_the_readers_traceback(saved):
    for kind, path in _damaged_files(saved).items():
        with pytest.raises(UnreadableCheckpointError) as raised:
            load_file(path)
        assert f"Cannot read {path}:" in _one_line(raised, str(path)), kind
        if kind != "a-folder":  # the negative control: torch says it in its own types (an EOFError, many lines)
            with pytest.raises(Exception) as before:
                torch.load(path, weights_only=True)
            assert not is_settings_error(before.value), (kind, before.value)


def test_a_file_that_is_not_a_dict_is_one_line_where_a_checkpoint_is_read(tmp_path):
    """Fabric's and the Trainer's loads take a file's entries (``.get``): a list, a tensor is one line there."""
    torch.save([1, 2, 3], tmp_path / "list.pt")
    assert load_file(tmp_path / "list.pt") == [1, 2, 3]  # data, read as such
    with pytest.raises(UnreadableCheckpointError) as raised:
        load_dict(tmp_path / "list.pt")
    assert "it holds a list, not a checkpoint's dict of entries" in _one_line(raised, str(tmp_path / "list.pt"))
    with pytest.raises(UnreadableCheckpointError, match="it holds a list"):
        DataOnlyCheckpointIO().load_checkpoint(tmp_path / "list.pt")


def test_a_raw_pickle_or_random_bytes_are_not_a_torch_save_file_rather_than_a_refused_global(tmp_path):
    """torch's weights-only unpickler names no global for them ("Unsupported operand"): they are not checkpoints,
    so the line says that, and a raw pickle still never runs."""
    marker = tmp_path / "MARKER"
    (tmp_path / "raw.pkl").write_bytes(pickle.dumps({"x": RunsCode(marker)}))
    (tmp_path / "random.pt").write_bytes(bytes(range(256)) * 8)
    for path in (tmp_path / "raw.pkl", tmp_path / "random.pt"):
        with pytest.raises(UnreadableCheckpointError) as raised:
            load_file(path)
        assert "it is not a torch.save file (the weights-only unpickler: Unsupported operand" in _one_line(
            raised, str(path)
        )
    assert not marker.exists()


@pytest.mark.parametrize("variable", ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD"])
def test_pytorchs_environment_overrides_change_nothing(tmp_path, monkeypatch, variable):
    """``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns PyTorch's *default* off: a file with code is still refused; and
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` still reads a folder whose entry holds a path (the allow-list)."""
    marker = tmp_path / "MARKER"
    torch.save({"note": RunsCode(marker)}, tmp_path / "bad.pt")
    torch.save({"note": RunsCode(marker)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "init_from": Path("/models/x")}, checkpoint_id=tmp_path / "folder", no_dist=True)
    monkeypatch.setenv(variable, "1")
    for path in (tmp_path / "bad.pt", tmp_path / "old.pt"):
        with pytest.raises(UnsafeCheckpointError, match="posix.system"):
            load_file(path)
    whole: dict = {}
    load_distributed(whole, tmp_path / "folder", whole=True)
    assert whole["init_from"] == Path("/models/x") and not marker.exists()


# -- torch.distributed.checkpoint folders -----------------------------------------------------------------------


_NOTE = "a-pickled-entry-of-the-folder"
"""A non-tensor value: DCP pickles it as an entry of its own (``BytesStorageMetadata``)."""


def _folder(tmp_path: Path) -> Path:
    state = {"model": {"w": torch.arange(4096.0), "b": torch.ones(8)}, "optimizer": {"step": 3, "note": _NOTE}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    return tmp_path / "ckpt"


def _edit_metadata(folder: Path, edit) -> None:
    metadata = FileSystemReader(folder).read_metadata()
    edit(metadata)
    with (folder / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)


def _dcp_load_as_before(folder: Path) -> None:
    """DCP's own reader and planner, as every entry point read a folder before issue 36 (its errors included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict({}, FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True)


def _refused_as_unreadable(folder: Path, names: str) -> str:
    with pytest.raises(UnreadableCheckpointError) as raised:
        load_distributed({}, folder, whole=True)
    return _one_line(raised, names)


def test_a_folder_without_or_with_a_damaged_metadata_is_one_line(tmp_path):
    folder = _folder(tmp_path)
    metadata = (folder / ".metadata").read_bytes()
    (folder / ".metadata").unlink()
    assert "it has no .metadata" in _refused_as_unreadable(folder, str(folder))
    with pytest.raises(FileNotFoundError):  # the negative control
        FileSystemReader(folder).read_metadata()
    garbled = {
        "empty": b"",
        "cut": metadata[: len(metadata) // 2],
        "persistent id": b"\x80\x04\x8c\x01a\x94Q.",  # DCP's .metadata has none: plain pickle has no loader for it
        "unknown layout": b"\x80\x04\x8c\x13torch.serialization\x94\x8c\x0b_get_layout\x94\x93\x94\x8c\x05bogus\x94"
        b"\x85\x94R\x94.",
    }
    for kind, data in garbled.items():
        (folder / ".metadata").write_bytes(data)
        assert f"Cannot read {folder / '.metadata'}:" in _refused_as_unreadable(folder, ".metadata"), kind
        with pytest.raises(Exception) as before:  # the negative control: EOFError, UnpicklingError, KeyError
            FileSystemReader(folder).read_metadata()
        assert not is_settings_error(before.value), kind


def test_dcp_metadata_of_other_types_is_one_line(tmp_path):
    folder = _folder(tmp_path)
    _edit_metadata(folder, lambda m: setattr(m, "state_dict_metadata", "boom"))
    assert "state_dict_metadata and storage_data are not dicts" in _refused_as_unreadable(folder, ".metadata")

    def size_as_text(m) -> None:
        m.state_dict_metadata["model.w"].size = "big"

    folder = _folder(tmp_path / "2")
    _edit_metadata(folder, size_as_text)
    assert "its entry 'model.w' has no valid size, dtype and chunks" in _refused_as_unreadable(folder, ".metadata")
    with pytest.raises(CheckpointException):  # the negative control: a BaseException, through `except Exception`
        _dcp_load_as_before(folder)


def test_a_huge_declared_tensor_is_refused_before_it_is_allocated(tmp_path):
    """A few kilobytes of folder declaring a 4 GiB tensor: DCP's load would allocate it (``torch.empty``) before
    reading a byte, and one declaring more memory than the machine has would be an OOM kill, not an error."""
    folder = _folder(tmp_path)

    def huge(m) -> None:
        entry = m.state_dict_metadata["model.w"]
        entry.size = torch.Size([2**30])
        entry.chunks[0].sizes = entry.size

    _edit_metadata(folder, huge)
    message = _refused_as_unreadable(folder, ".metadata")
    assert f"its tensors declare {2**32 + 32} bytes, more than its shard files hold" in message, message
    entries = FileSystemReader(folder).read_metadata().state_dict_metadata  # the negative control: torch takes it
    assert isinstance(entries["model.w"], TensorStorageMetadata) and entries["model.w"].size == (2**30,)


def test_shard_files_must_be_regular_files_holding_every_range_the_metadata_names(tmp_path):
    folder = _folder(tmp_path)
    [shard] = folder.glob("*.distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # cut short
    assert f"of the shard {shard.name!r}, which has {len(data) // 2} (cut short?)" in _refused_as_unreadable(
        folder, ".metadata"
    )
    with pytest.raises(CheckpointException):  # the negative control: DCP reads and trips inside
        _dcp_load_as_before(folder)
    shard.unlink()
    assert f"its shard file {shard.name!r} is missing" in _refused_as_unreadable(folder, ".metadata")
    shard.symlink_to("/dev/zero")  # a folder from anyone: DCP would read each entry's length of zeros
    _edit_metadata(folder, lambda m: [setattr(info, "length", 10**12) for info in m.storage_data.values()])
    assert "is not a regular file (a device, a pipe, a folder)" in _refused_as_unreadable(folder, ".metadata")
    shard.unlink()
    shard.write_bytes(data)
    _edit_metadata(folder, lambda m: [setattr(i, "transform_descriptors", ["stream.zstd/1"]) for i in m.storage_data.values()])  # fmt: skip
    assert "are transformed (['stream.zstd/1']), e.g. compressed" in _refused_as_unreadable(folder, ".metadata")


def test_a_tensor_entry_asking_for_code_is_refused_in_one_line(tmp_path):
    """DCP reads tensor entries itself, with ``torch.load(weights_only=True)``: it refuses one that asks for code,
    in a ``CheckpointException`` of many lines; the load says which global, in one."""
    marker = tmp_path / "MARKER"
    folder = _folder(tmp_path)
    [shard] = folder.glob("*.distcp")
    payload = io.BytesIO()
    torch.save({"x": RunsCode(marker)}, payload)
    start = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(payload.getvalue())

    def to_payload(m) -> None:
        info = next(v for k, v in m.storage_data.items() if k.fqn == "model.w")
        info.offset, info.length = start, len(payload.getvalue())

    _edit_metadata(folder, to_payload)
    with pytest.raises(UnsafeCheckpointError) as raised:
        load_distributed({}, folder, whole=True)
    assert f"{folder} (a tensor entry): it asks for the global posix.system" in _one_line(raised, str(folder))
    with pytest.raises(CheckpointException, match="Weights only load failed"):  # the negative control
        _dcp_load_as_before(folder)
    assert not marker.exists()


def test_a_garbled_pickled_entry_is_one_line_naming_it(tmp_path):
    folder = _folder(tmp_path)
    [shard] = folder.glob("*.distcp")
    shard.write_bytes(shard.read_bytes().replace(_NOTE.encode(), b"\xff" * len(_NOTE)))  # the pickled entry
    message = _refused_as_unreadable(folder, "(entry 'optimizer.note')")
    assert "UnicodeDecodeError" in message, message
    with pytest.raises(CheckpointException):  # the negative control
        _dcp_load_as_before(folder)


def test_the_checks_pass_every_folder_dcp_writes(tmp_path):
    """Nothing above refuses a folder DCP wrote: its metadata as torch reads it, its entries read whole."""
    folder = _folder(tmp_path)
    ours, torchs = DataOnlyReader(folder).read_metadata(), FileSystemReader(folder).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.storage_data == torchs.storage_data
    whole: dict = {}
    load_distributed(whole, folder, whole=True)
    assert torch.equal(whole["model"]["w"], torch.arange(4096.0)) and whole["optimizer"] == {"step": 3, "note": _NOTE}
