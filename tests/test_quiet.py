"""What `lightning_sppo.quiet` hides (Lightning's product tips, torch's LeafSpec deprecation raised inside
Lightning) and what it keeps: every other log record and warning, and the same deprecation from other code."""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch import Trainer
from lightning.pytorch.utilities._pytree import _tree_flatten
from torch.utils._pytree import LeafSpec

from lightning_sppo.quiet import TIPS_LOGGER, quiet_dependencies


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _trainer_messages(quiet: bool) -> list[str]:
    """What Lightning logs (rank-zero info) while a Trainer is built, with or without ``quiet_dependencies``."""
    logger = logging.getLogger(TIPS_LOGGER)
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        if quiet:
            with quiet_dependencies():
                Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        else:
            Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return records.messages


def test_lightning_tips_are_hidden_and_its_other_messages_kept():
    plain = _trainer_messages(quiet=False)
    assert any("litlogger" in m for m in plain), plain  # the negative control: Lightning prints the tip
    quiet = _trainer_messages(quiet=True)
    assert not any("litlogger" in m or "💡" in m for m in quiet), quiet
    assert any(m.startswith("GPU available") for m in quiet), quiet  # everything else still logged
    assert [m for m in plain if "💡" not in m] == quiet
    assert not logging.getLogger(TIPS_LOGGER).filters  # the filter left with the block


def test_only_lightning_s_leafspec_deprecation_is_filtered():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _tree_flatten(1)  # Lightning's _pytree builds a LeafSpec: torch's FutureWarning, attributed to Lightning
        assert [w.category for w in seen] == [FutureWarning] and "LeafSpec" in str(seen[0].message)
        seen.clear()
        with quiet_dependencies():
            _tree_flatten(1)
            warnings.warn("a genuine warning", UserWarning, stacklevel=1)
            LeafSpec()  # the same deprecation from other code than Lightning's: still shown
        _tree_flatten(1)  # after the block: shown again
    assert [(w.category, str(w.message)[:24]) for w in seen] == [
        (UserWarning, "a genuine warning"),
        (FutureWarning, "`isinstance(treespec, Le"),
        (FutureWarning, "`isinstance(treespec, Le"),
    ]
    assert seen[1].filename == __file__ and seen[2].filename.endswith("lightning/pytorch/utilities/_pytree.py")
