"""A crash during a save never leaves a checkpoint that loads as valid: the previous one stays."""

import subprocess
import sys
import time

import torch

from lightning_sppo.strategy.checkpoint import _replace, atomic_torch_save
from tests.subprocesses import one_thread_env


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


def test_folder_checkpoints_are_swapped_in_whole(tmp_path):
    """A sharded checkpoint is written to a temporary folder and only then swapped with the old one."""
    old, new = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.tmp"
    old.mkdir()
    (old / "meta.pt").write_text("old")
    new.mkdir()
    (new / "meta.pt").write_text("new")
    _replace(new, old)
    assert (old / "meta.pt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_an_incomplete_folder_is_refused(tmp_path):
    """DCP shards without the metadata file written last mean the save was cut short."""
    import pytest

    from lightning_sppo.strategy.checkpoint import load_stage

    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / "__0_0.distcp").write_bytes(b"partial")
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint"):
        load_stage(tmp_path / "step-5", "model", None, {})
