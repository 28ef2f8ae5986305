"""A crash during a save never leaves a checkpoint that loads as valid, and never loses the newest complete one."""

import os
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from lightning_sppo.strategy import checkpoint_files
from lightning_sppo.strategy.checkpoint_files import (
    atomic_torch_save,
    is_complete,
    newest_complete_checkpoint,
    recover,
    replace,
)
from tests.subprocesses import one_thread_env


def _folder(path, step: int, mtime_ns: int | None = None):
    """A complete checkpoint folder: a shard file and its meta.pt (written last)."""
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"shard")
    torch.save({"step": step}, path / "meta.pt")
    if mtime_ns is not None:
        os.utime(path / "meta.pt", ns=(mtime_ns, mtime_ns))
    return path


def _step(path) -> int:
    return torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=True)["step"]


@pytest.mark.slow
def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1, "weights": torch.arange(10.0)}, path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_big = (
        "import torch, pathlib; from lightning_sppo.strategy.checkpoint import atomic_torch_save;"
        f" atomic_torch_save({{'step': 2, 'weights': torch.randn(96, 1024, 1024)}}, pathlib.Path({str(path)!r}))"
    )
    child = subprocess.Popen([sys.executable, "-c", save_big], env=one_thread_env())
    deadline = time.monotonic() + 120
    while not tmp.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert tmp.exists(), "the save finished (or never started) before it could be killed"
    child.kill()  # SIGKILL in the middle of writing
    child.wait()
    assert child.returncode == -9
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["step"] == 1 and torch.equal(checkpoint["weights"], torch.arange(10.0))
    assert newest_complete_checkpoint(tmp_path) == path  # the partial file is not a candidate
    atomic_torch_save({"step": 3}, path)  # the next save drops the partial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"] and _step(path) == 3


def test_folder_checkpoints_are_swapped_in_whole(tmp_path):
    """A sharded checkpoint is written to a temporary folder and only then swapped with the old one."""
    old, new = _folder(tmp_path / "last.ckpt", 1), _folder(tmp_path / ".last.ckpt.tmp", 2)
    replace(new, old)
    assert _step(old) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_kill_between_the_renames_loses_nothing(tmp_path, monkeypatch):
    """Killed after the old folder moved aside and before the new one moved in: no ``last.ckpt``, but
    ``newest_complete_checkpoint`` finds the new state, and the next save swaps it in instead of deleting it.
    Also, after each rename of the swap, the newest complete checkpoint in the folder is the newest state."""
    path = _folder(tmp_path / "last.ckpt", 1, mtime_ns=1_000_000_000)
    tmp = _folder(tmp_path / ".last.ckpt.tmp", 2, mtime_ns=2_000_000_000)
    rename, seen = os.replace, []

    def killed_at_second_rename(src, dst):
        if len(seen) == 1:
            raise KeyboardInterrupt("killed")  # nothing after this instant runs, as with SIGKILL
        rename(src, dst)
        seen.append(_step(newest_complete_checkpoint(tmp_path)))

    monkeypatch.setattr(checkpoint_files.os, "replace", killed_at_second_rename)
    with pytest.raises(KeyboardInterrupt):
        replace(tmp, path)
    monkeypatch.setattr(checkpoint_files.os, "replace", rename)
    assert seen == [2]  # after the first rename the newest state (2) was still complete somewhere
    assert not path.exists() and sorted(p.name for p in tmp_path.iterdir()) == [".last.ckpt.old", ".last.ckpt.tmp"]
    assert newest_complete_checkpoint(tmp_path) == tmp and _step(tmp) == 2
    recover(path)  # what the next save does first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"] and _step(path) == 2


def test_a_kill_before_the_swap_keeps_the_newer_temporary(tmp_path):
    """Killed once the new checkpoint is complete but before any rename: it is newer than ``path``."""
    path = tmp_path / "last.ckpt"
    torch.save({"step": 1}, path)
    torch.save({"step": 2}, tmp_path / ".last.ckpt.tmp")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    assert newest_complete_checkpoint(tmp_path).name == ".last.ckpt.tmp"
    recover(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"] and _step(path) == 2


def test_only_the_old_copy_survives(tmp_path):
    """A kill between the renames whose temporary copy was then lost: the old copy is restored."""
    path = tmp_path / "last.ckpt"
    _folder(tmp_path / ".last.ckpt.old", 1)
    recover(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"] and _step(path) == 1


def test_newest_complete_checkpoint_skips_what_is_not_complete(tmp_path):
    assert newest_complete_checkpoint(tmp_path / "missing") is None
    assert newest_complete_checkpoint(tmp_path) is None
    older = _folder(tmp_path / "epoch=0-step=5.ckpt", 5, mtime_ns=1_000_000_000)
    newer = tmp_path / "epoch=1-step=10.ckpt"
    torch.save({"step": 10}, newer)
    os.utime(newer, ns=(2_000_000_000, 2_000_000_000))
    (tmp_path / "step-15").mkdir()  # DCP shards without meta.pt
    (tmp_path / "step-15" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "partial.ckpt").write_bytes(newer.read_bytes()[:-40])  # cut before the zip directory
    with zipfile.ZipFile(tmp_path / "notes.zip", "w") as archive:  # a zip, but not a torch.save file
        archive.writestr("notes.txt", "hello")
    (tmp_path / "metrics.csv").write_text("step,loss\n")
    for late in ("step-15", "partial.ckpt", "notes.zip", "metrics.csv"):
        os.utime(tmp_path / late, ns=(3_000_000_000, 3_000_000_000))
    assert not is_complete(tmp_path / "partial.ckpt") and is_complete(older) and is_complete(newer)
    assert newest_complete_checkpoint(tmp_path) == newer
    newer.unlink()
    assert newest_complete_checkpoint(tmp_path) == older


def test_an_incomplete_folder_is_refused(tmp_path):
    """DCP shards without the metadata file written last mean the save was cut short."""
    from lightning_sppo.strategy.checkpoint import load_stage

    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / "__0_0.distcp").write_bytes(b"partial")
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint"):
        load_stage(tmp_path / "step-5", "model", None, {})
