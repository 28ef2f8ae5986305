"""``strategy.safe_load``: what a checkpoint may hold (tensors, containers, primitives, the allow-list) and what is
refused, in one line naming the file and the global, before any of it is built.

The entry points' tests are ``tests/training/test_untrusted_checkpoints.py`` and
``tests/distributed/test_untrusted_checkpoints.py``; checkpoints of earlier versions ``tests/training/test_old_checkpoints.py``.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path, PurePosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import TorchCheckpointIO
from torch.distributed.checkpoint import FileSystemReader

from lightning_sppo import SPPOStrategy, SPPOTrainerStrategy
from lightning_sppo.errors import SPPOConfigError, is_settings_error
from lightning_sppo.strategy.safe_load import (
    DataOnlyCheckpointIO,
    DataOnlyReader,
    UnsafeCheckpointError,
    load_distributed,
    load_file,
)
from tests.training.untrusted import RunsCode


class Trusted:
    """A type of a third-party checkpoint that its reader chooses to trust (by name, explicitly)."""

    def __init__(self, value: int) -> None:
        self.value = value


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_tensors_containers_primitives_and_paths_load(tmp_path):
    saved = {"w": torch.arange(6.0).view(2, 3), "nested": [{"step": 3, "lr": 1e-3, "betas": (0.9, 0.95)}, None],
             "name": "tiny", "dtype": torch.bfloat16, "init_from": Path("/models/llama"), "pure": PurePosixPath("a")}  # fmt: skip
    torch.save(saved, tmp_path / "ok.pt")
    loaded = load_file(tmp_path / "ok.pt", mmap=True)
    assert loaded.keys() == saved.keys() and torch.equal(loaded["w"], saved["w"])
    assert {k: v for k, v in loaded.items() if k != "w"} == {k: v for k, v in saved.items() if k != "w"}


def test_a_file_asking_for_code_is_refused_in_one_line_before_it_runs(tmp_path):
    marker = tmp_path / "MARKER"
    torch.save({"w": torch.ones(2), "note": RunsCode(marker)}, tmp_path / "bad.pt")
    with pytest.raises(UnsafeCheckpointError) as raised:
        load_file(tmp_path / "bad.pt")
    message = _one_line(raised)
    assert f"Refusing to read {tmp_path / 'bad.pt'}: it asks for the global posix.system" in message, message
    assert not marker.exists() and is_settings_error(raised.value)  # one `sppo: error:` line, exit status 2
    torch.load(tmp_path / "bad.pt", weights_only=False)  # the negative control: read as before, it runs
    assert marker.exists()


def test_a_legacy_file_asking_for_code_is_refused_by_the_unpickler_itself(tmp_path):
    """torch.save's format before 1.6 has no zip directory for the scan to read: the weights-only unpickler refuses
    when it meets the global, and its message of many lines becomes one."""
    marker = tmp_path / "MARKER"
    torch.save({"note": RunsCode(marker)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointError, match="it asks for the global posix.system") as raised:
        load_file(tmp_path / "old.pt")
    assert str(tmp_path / "old.pt") in _one_line(raised) and not marker.exists()


def test_a_type_trusted_by_name_loads_and_is_refused_otherwise(tmp_path):
    """The escape hatch of docs/checkpoints.md: PyTorch's own allow-list, extended explicitly by the caller."""
    torch.save({"extra": Trusted(7)}, tmp_path / "third-party.pt")
    with pytest.raises(UnsafeCheckpointError, match=f"the global {__name__}.Trusted"):
        load_file(tmp_path / "third-party.pt")
    with torch.serialization.safe_globals([Trusted]):
        assert load_file(tmp_path / "third-party.pt")["extra"].value == 7
    with pytest.raises(UnsafeCheckpointError):  # only inside the block
        load_file(tmp_path / "third-party.pt")


def _dcp_save(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=folder, no_dist=True)


def test_a_dcp_folder_loads_with_its_pickled_entries_read_as_data(tmp_path):
    """DCP pickles every non-tensor value of a state (an optimizer's None momentum, a step count) as an entry of
    its own; they are read as ``load_file`` reads a file."""
    state = {"model": {"w": torch.arange(4.0)}, "optimizer": {"state": {"w": {"momentum_buffer": None}}}, "step": 3}
    _dcp_save(state, tmp_path / "ckpt")
    whole: dict = {}
    load_distributed(whole, tmp_path / "ckpt", whole=True)
    assert torch.equal(whole["model"]["w"], state["model"]["w"]) and whole["optimizer"] == state["optimizer"]
    assert whole["step"] == 3
    into = {"model": {"w": torch.zeros(4)}, "step": 0}
    load_distributed(into, tmp_path / "ckpt", no_dist=True)
    assert torch.equal(into["model"]["w"], state["model"]["w"]) and into["step"] == 3


def test_a_dcp_entry_asking_for_code_is_refused(tmp_path):
    marker = tmp_path / "MARKER"
    _dcp_save({"model": {"w": torch.ones(2)}, "note": RunsCode(marker)}, tmp_path / "ckpt")
    with pytest.raises(UnsafeCheckpointError) as raised:
        load_distributed({}, tmp_path / "ckpt", whole=True)
    assert "(entry 'note'): it asks for the global posix.system" in _one_line(raised) and not marker.exists()


def _metadata_with(folder: Path, edit) -> None:
    metadata = FileSystemReader(folder).read_metadata()
    edit(metadata)
    with (folder / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)


def test_dcp_metadata_asking_for_code_is_refused_by_the_reader(tmp_path):
    marker = tmp_path / "MARKER"
    _dcp_save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert DataOnlyReader(tmp_path / "ckpt").read_metadata().state_dict_metadata.keys() == {"w"}
    _metadata_with(tmp_path / "ckpt", lambda m: setattr(m, "note", RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError) as raised:
        DataOnlyReader(tmp_path / "ckpt").read_metadata()
    message = _one_line(raised)
    assert f"{tmp_path / 'ckpt' / '.metadata'}: it asks for the global posix.system" in message, message
    assert not marker.exists()
    FileSystemReader(tmp_path / "ckpt").read_metadata()  # the negative control: torch's own reader runs it
    assert marker.exists()


def test_dcp_metadata_naming_a_shard_outside_its_folder_or_another_object_is_refused(tmp_path):
    _dcp_save({"w": torch.ones(2)}, tmp_path / "ckpt")

    def elsewhere(metadata) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = "../../etc/passwd"

    _metadata_with(tmp_path / "ckpt", elsewhere)
    with pytest.raises(UnsafeCheckpointError, match="names the shard file '../../etc/passwd', which is not a file"):
        DataOnlyReader(tmp_path / "ckpt").read_metadata()
    with (tmp_path / "ckpt" / ".metadata").open("wb") as f:
        pickle.dump({"not": "metadata"}, f)
    with pytest.raises(UnsafeCheckpointError, match="it holds a dict, not DCP metadata"):
        DataOnlyReader(tmp_path / "ckpt").read_metadata()


def test_the_strategies_read_data_only_by_default_and_keep_a_checkpoint_io_they_are_given(tmp_path):
    assert isinstance(SPPOStrategy().checkpoint_io, DataOnlyCheckpointIO)
    assert isinstance(SPPOTrainerStrategy().checkpoint_io, DataOnlyCheckpointIO)
    given = TorchCheckpointIO()
    assert SPPOStrategy(checkpoint_io=given).checkpoint_io is given
    assert SPPOTrainerStrategy(checkpoint_io=given).checkpoint_io is given
    torch.save({"note": RunsCode(tmp_path / "MARKER")}, tmp_path / "bad.pt")
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        DataOnlyCheckpointIO().load_checkpoint(tmp_path / "bad.pt")
    with pytest.raises(SPPOConfigError, match="weights_only=False: lightning-sppo reads checkpoints as data only"):
        DataOnlyCheckpointIO().load_checkpoint(tmp_path / "bad.pt", weights_only=False)
    assert not (tmp_path / "MARKER").exists()
