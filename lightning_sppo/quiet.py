"""Two messages of our dependencies that every SPPO run printed and that a user can do nothing about, hidden
where our entry points run, and nowhere else.

* Lightning's product tips ("💡 Tip: ... try installing litlogger / litmodels"), logged at INFO on the
  ``lightning.pytorch.utilities.rank_zero`` logger whenever a Trainer has no ``LitLogger``. Lightning 2.6 has
  no switch for them; a filter on that logger drops these two records and keeps every other one
  ("GPU available", "Seed set", ...). Only the ``sppo`` command hides them (``quiet_dependencies``): a
  ``Trainer`` built by user code prints them before any of our code runs.
* torch's ``FutureWarning`` "`isinstance(treespec, LeafSpec)` is deprecated", raised by Lightning's own
  ``lightning.pytorch.utilities._pytree`` when the fit loop combines the data loaders (once per rank). The
  filter matches that message, category and module only: the same deprecation from user code, and every
  other warning, still shows. ``quiet_dependencies`` scopes it to the ``sppo`` command;
  ``ignore_leafspec_deprecation`` is what ``SPPOTrainerStrategy.setup`` adds (the fit loop runs after it).

Importing ``lightning_sppo`` changes no filter.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LIGHTNING_TIPS", "TIPS_LOGGER", "ignore_leafspec_deprecation", "quiet_dependencies"]

TIPS_LOGGER = "lightning.pytorch.utilities.rank_zero"
"""The logger Lightning's ``rank_zero_info`` writes to (its tips among the rest)."""
LIGHTNING_TIPS = ("💡 Tip: For seamless cloud logging", "💡 Tip: For seamless cloud uploads")
"""How Lightning's litlogger and litmodels tips begin (lightning 2.6 logger and callback connectors)."""
_LEAFSPEC = {
    "message": r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    "category": FutureWarning,
    "module": r"lightning\.pytorch\.utilities\._pytree\Z",
}


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_TIPS)


def ignore_leafspec_deprecation() -> None:
    """Ignore torch's LeafSpec deprecation where Lightning's ``_pytree`` raises it (idempotent: the filter
    module replaces an equal filter rather than adding a second)."""
    warnings.filterwarnings("ignore", **_LEAFSPEC)


@contextmanager
def quiet_dependencies() -> Iterator[None]:
    """Inside the block: no Lightning product tips, no LeafSpec deprecation from Lightning. Both filters are
    removed on the way out (warnings filters restored as they were)."""
    tips = _DropTips()
    logger = logging.getLogger(TIPS_LOGGER)
    logger.addFilter(tips)
    try:
        with warnings.catch_warnings():
            ignore_leafspec_deprecation()
            yield
    finally:
        logger.removeFilter(tips)
