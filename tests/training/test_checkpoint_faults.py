"""SPPOCheckpoint under damage and kills (issue 32, item 2): after each, a resume keeps ``keep`` checkpoints, and
``last.ckpt`` names the newest complete one.

A run saves every 2 steps with ``keep=2`` and is stopped at its step-6 save at one instant of the save: while the
file is written, once it is complete but not yet in place, once in place but before ``last.ckpt`` is relinked,
and once relinked but before the oldest is deleted. The fault is an exception no one catches, raised where the
kill would land (nothing after it runs, as with SIGKILL; ``test_cli.py`` kills real processes). A fifth case
truncates the newest checkpoint after the run (a full disk, a partial copy). Each test asserts the damaged
state first, then that ``ckpt_path="last"`` resumes and ends with exactly the newest ``keep`` checkpoints.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_sppo import SPPOTrainerStrategy
from lightning_sppo.callbacks import SPPOCheckpoint
from lightning_sppo.callbacks import checkpoint as callback_module
from lightning_sppo.data import TokenDataModule
from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.strategy import checkpoint_files
from lightning_sppo.strategy.checkpoint_files import is_complete
from lightning_sppo.training import GPTPretraining
from tests.training.conftest import Losses


class Killed(BaseException):
    """Where a SIGKILL would land: nothing after it runs (Lightning re-raises it after its teardown)."""


def _fit(root, data, max_steps: int, ckpt_path=None, callbacks=()) -> None:
    seed_everything(1337)
    trainer = Trainer(
        strategy=SPPOTrainerStrategy(num_subsequences=2), accelerator="cpu", devices=1, max_steps=max_steps,
        default_root_dir=root, logger=False, callbacks=[SPPOCheckpoint(every_n_train_steps=2, keep=2), *callbacks],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = GPTPretraining(model="tiny", learning_rate=3e-3, warmup_steps=2, max_steps=10, weight_decay=0.0)
    trainer.fit(module, TokenDataModule(data, 32, 2), ckpt_path=ckpt_path)


def _state(folder) -> tuple[list[int], int | None, list[str]]:
    """(steps of the complete checkpoints, the step last.ckpt names or None, hidden entries)."""
    steps = sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in checkpoint_files.checkpoints_in(folder)[0])
    link = folder / "last.ckpt"
    named = int(re.search(r"step=(\d+)", os.readlink(link)).group(1)) if link.is_symlink() else None
    return steps, named, sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _resume_and_check(tmp_path, data) -> None:
    folder = tmp_path / "checkpoints"
    _fit(tmp_path, data, 10, ckpt_path="last")
    steps, named, hidden = _state(folder)
    assert steps == [8, 10] and named == 10 and hidden == [], (steps, named, hidden)
    assert is_complete(folder / "last.ckpt")
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=10.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]


def test_killed_while_writing_the_checkpoint(tmp_path, data, monkeypatch):
    original = torch.save

    def cut_short(obj, path, *args, **kwargs):
        if str(path).endswith(".epoch=0-step=6.ckpt.tmp"):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 partial")  # the start of a zip, never finished
            raise Killed("torch.save")
        return original(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_files.torch, "save", cut_short)
    with pytest.raises(Killed):
        _fit(tmp_path, data, 6)
    monkeypatch.undo()
    steps, named, hidden = _state(tmp_path / "checkpoints")
    assert (steps, named, hidden) == ([2, 4], 4, [".epoch=0-step=6.ckpt.tmp"])
    _resume_and_check(tmp_path, data)


def test_killed_when_complete_but_not_in_place(tmp_path, data, monkeypatch):
    original = checkpoint_files.replace

    def killed(tmp, path):
        if path.name == "epoch=0-step=6.ckpt":
            raise Killed("replace")
        original(tmp, path)

    monkeypatch.setattr(checkpoint_files, "replace", killed)
    with pytest.raises(Killed):
        _fit(tmp_path, data, 6)
    monkeypatch.undo()
    steps, named, hidden = _state(tmp_path / "checkpoints")
    assert (steps, named, hidden) == ([2, 4], 4, [".epoch=0-step=6.ckpt.tmp"])
    _resume_and_check(tmp_path, data)  # the complete .tmp is the newest: resumed from step 6, then swapped in


def test_killed_between_the_checkpoint_and_the_link(tmp_path, data, monkeypatch):
    """The issue's case: the new checkpoint in place, last.ckpt not yet relinked: three files with keep=2 and
    last.ckpt on the older one; the resume prunes to two and relinks."""

    def killed(self, target, link):
        if target.name == "epoch=0-step=6.ckpt":
            raise Killed("link")
        checkpoint_files.link_last(target, link)

    monkeypatch.setattr(SPPOCheckpoint, "_link_last", killed)
    with pytest.raises(Killed):
        _fit(tmp_path, data, 6)
    monkeypatch.undo()
    assert _state(tmp_path / "checkpoints") == ([2, 4, 6], 4, [])
    _resume_and_check(tmp_path, data)


def test_killed_before_the_oldest_is_deleted(tmp_path, data, monkeypatch):
    def killed(path):
        if path.name == "epoch=0-step=2.ckpt":
            raise Killed("remove_path")
        checkpoint_files.remove_path(path)

    monkeypatch.setattr(callback_module, "remove_path", killed)
    with pytest.raises(Killed):
        _fit(tmp_path, data, 6)
    monkeypatch.undo()
    assert _state(tmp_path / "checkpoints") == ([2, 4, 6], 6, [])
    _resume_and_check(tmp_path, data)


def test_a_truncated_newest_checkpoint_is_named_skipped_and_removed(tmp_path, data):
    """The newest file cut short after the run: last.ckpt names it. The resume warns with its name, starts
    from the newest complete one, relinks last.ckpt to a complete checkpoint and removes the damaged file; its
    losses are those of a run never damaged."""
    reference = Losses()
    _fit(tmp_path / "reference", data, 10, callbacks=[reference])
    _fit(tmp_path, data, 6)
    folder = tmp_path / "checkpoints"
    newest = folder / "epoch=0-step=6.ckpt"
    newest.write_bytes(newest.read_bytes()[:-100])
    assert os.readlink(folder / "last.ckpt") == newest.name and not is_complete(folder / "last.ckpt")
    (folder / "notes.ckpt").write_text("not a checkpoint of ours")  # another kind of file: never deleted
    resumed = Losses()
    with pytest.warns(UserWarning, match=r"epoch=0-step=6.ckpt is newer but not a complete checkpoint.*step=4") as seen:
        _fit(tmp_path, data, 10, ckpt_path="last", callbacks=[resumed])
    assert not [str(w.message) for w in seen if "notes.ckpt" in str(w.message)]  # not said to be removed: it is not
    assert sorted(resumed.losses) == list(range(4, 10))
    assert all(resumed.losses[s] == reference.losses[s] for s in resumed.losses), (resumed.losses, reference.losses)
    assert (folder / "notes.ckpt").read_text() == "not a checkpoint of ours" and not newest.exists()
    (folder / "notes.ckpt").unlink()
    _resume_and_check(tmp_path, data)


def test_a_fresh_run_refuses_a_folder_with_an_earlier_run(tmp_path, data):
    """Without ckpt_path the second run would mix its checkpoints with the first's; it stops before step 1 and
    leaves them alone. The same folder with ckpt_path="last" continues (the negative control)."""
    _fit(tmp_path, data, 4)
    with pytest.raises(SPPOConfigError, match=r'holds checkpoints of an earlier run.*ckpt_path="last"'):
        _fit(tmp_path, data, 6)
    assert _state(tmp_path / "checkpoints") == ([2, 4], 4, [])
    _fit(tmp_path, data, 6, ckpt_path="last")
    assert _state(tmp_path / "checkpoints") == ([4, 6], 6, [])
