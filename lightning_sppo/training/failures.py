"""How a failed run ends: one report for the whole job, and every rank out promptly.

* The report: our own configuration errors (``SPPOConfigError``), a diverged run (``NonFiniteError``),
  Lightning's ``MisconfigurationException`` and command-line mistakes are one line,
  ``sppo: error: [rank R: ]message``; anything else (a bug, a broken environment) keeps its traceback. In a
  job of several processes only the first rank to fail reports: the others fail because it stopped talking.
* The exit: the failing rank leaves with ``os._exit`` (no teardown: collectives with peers that stopped would
  block), and every other rank follows within about a second (``watch_peers``) with the same exit status,
  instead of waiting out the process-group timeout (with NCCL a collective whose peer died returns only then).

Both go through the default process group's key-value store, which every rank already talks to: the first
failing rank bumps a counter (1 means first) and records its exit status; a daemon thread on every rank polls
for that status. Without a process group (one process, or a failure before it starts) nothing is shared: the
process reports (a one-line error only on rank 0, since every rank read the same settings) and exits.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch.distributed as dist
from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_sppo.errors import NonFiniteError, SPPOConfigError

__all__ = ["CONFIG_ERROR", "FailFast", "exit_on_failure", "report", "watch_peers"]

CONFIG_ERROR = 2
"""Exit status of a configuration error (as argparse uses); anything else that fails exits with 1."""
_ONE_LINE = (SPPOConfigError, NonFiniteError, MisconfigurationException, ArgumentError)
_FAILURES = "sppo/failures"  # how many ranks have failed so far
_STATUS = "sppo/exit_status"  # the first failure's exit status
_POLL_S = 1.0
_watched: Any = None  # the store a watcher thread polls (one per process group)


@contextmanager
def exit_on_failure(program: str = "sppo") -> Iterator[None]:
    """Run the block; on an exception, report it (if this rank fails first) and end the process."""
    try:
        yield
    except Exception as error:  # SystemExit (--help, a finished launcher) and KeyboardInterrupt pass through
        if os.environ.get("SPPO_TRACEBACK"):
            raise
        ours = _settings_error(error)
        code = CONFIG_ERROR if ours is not None and not isinstance(ours, NonFiniteError) else 1
        first, code = _announce(code)
        if first:
            report(error, program)
        sys.stdout.flush()
        sys.stderr.flush()
        if _store() is not None:
            os._exit(code)  # peers may be blocked in collectives with us: no teardown, no atexit
        sys.exit(code)


def report(error: BaseException, program: str = "sppo") -> None:
    """Print ``error`` to stderr: one line for the errors a user fixes in the settings, else the traceback."""
    rank, world = _rank_and_world()
    where = f"rank {rank}: " if world > 1 else ""
    ours = _settings_error(error)
    if ours is not None:
        if world > 1 and _store() is None and rank != 0 and not isinstance(ours, NonFiniteError):
            return  # before the processes meet: every rank read the same settings, rank 0 says it once
        print(f"{program}: error: {where}{one_line(ours)}", file=sys.stderr)
        return
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    print(f"{text}{program}: {where}failed with the {type(error).__name__} above", file=sys.stderr)


def _settings_error(error: BaseException) -> BaseException | None:
    """The error a user fixes in the settings, if ``error`` is one or wraps one (jsonargparse re-raises the
    error of a class it could not build as its own ``ValueError``, chained to ours)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, _ONE_LINE):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def one_line(error: BaseException) -> str:
    """The most specific line of a (possibly nested, multi-line) error message.

    jsonargparse wraps the error of a class it could not build (ours name the setting) into a report of every
    type it tried; the line from our own checks, or the "not accepted" option, is the one worth showing.
    """
    lines = [line.strip(" -") for line in str(error).splitlines() if line.strip(" -")]
    ours = [line for line in lines if "=" in line and ("Unknown" in line or "must" in line)]
    options = [line for line in lines if "not accepted" in line or "does not exist" in line]
    text = (ours or options or lines or [repr(error)])[0]
    if isinstance(error, ArgumentError) and not ours:
        return f"{text} (see `sppo fit --help`)"
    return text


def watch_peers() -> None:
    """Exit this process, with the same status, within about a second of another rank's failure."""
    global _watched
    store = _store()
    if store is None or store is _watched:
        return
    _watched = store
    threading.Thread(target=_watch, args=(store,), name="sppo-peer-watch", daemon=True).start()


class FailFast(L.Callback):
    """Starts ``watch_peers`` once the processes have met (the Trainer's set-up)."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        watch_peers()


def _watch(store: Any) -> None:
    while dist.is_initialized():
        try:
            if store.check([_STATUS]):
                code = int(store.get(_STATUS))
                sys.stderr.flush()
                os._exit(code)
        except Exception:  # the store went away (its host finished): nothing is left to watch
            return
        time.sleep(_POLL_S)


def _announce(code: int) -> tuple[bool, int]:
    """Count this rank's failure: (whether it is the first, the exit status the job ends with)."""
    store = _store()
    if store is None:
        return True, code
    try:
        if store.add(_FAILURES, 1) == 1:
            store.set(_STATUS, str(code))
            return True, code
        return False, int(store.get(_STATUS))
    except Exception:  # the store's host is gone: say what we know rather than nothing
        return True, code


def _store() -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a process group without a store (none that Lightning or torchrun create)
        return None


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(getattr(rank_zero_only, "rank", 0) or 0), int(os.environ.get("WORLD_SIZE", 1))
