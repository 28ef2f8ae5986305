"""How a failed run ends: one report for the whole job, and every rank out promptly.

* The report: our own configuration errors (``SPPOConfigError`` and the package's other ``ValueError`` types,
  e.g. a checkpoint of another model), a diverged run (``NonFiniteError``),
  Lightning's ``MisconfigurationException`` and command-line mistakes are one line,
  ``sppo: error: [rank R: ]message``; anything else (a bug, a broken environment) keeps its traceback. In a
  job of several processes only the first rank to fail reports: the others fail because it stopped talking.
* The exit: the failing rank leaves with ``os._exit`` (no teardown: collectives with peers that stopped would
  block), and every other rank follows within about a second (``watch_peers``) with the same exit status,
  instead of waiting out the process-group timeout (with NCCL a collective whose peer died returns only then).

Both go through the default process group's key-value store, which every rank already talks to: a failing
rank compare-and-sets "rank:exit status" (the first one's value stays, so it alone reports); a daemon thread on
every rank polls for it; rank 0 leaves once the others have read it (its exit may take the store down) and
before them (so that a launcher reports the first failure's status).
Before the process group exists (a settings error while the command reads its config), torchrun's workers can
already reach the store its agent hosts (``TORCHELASTIC_USE_AGENT_STORE``): the same compare-and-set picks the one
rank that reports, and the others wait until its line is out before they exit (torchrun stops every worker as soon
as one exits, which used to cut rank 0 off before it printed). Without such a store (one process, SLURM's
``srun``, Lightning's own launcher, which starts the other ranks only later) the process reports (a one-line error
only on the rank that launches as 0, since every rank read the same settings) and exits.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, NoReturn

import lightning as L
import torch.distributed as dist
from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_sppo.errors import NonFiniteError, PeerFailedError, SPPOConfigError, error_chain, is_settings_error

__all__ = [
    "CONFIG_ERROR",
    "FailFast",
    "end_now",
    "exit_on_failure",
    "launching_rank_zero",
    "report",
    "stop_watching_peers",
    "watch_peers",
]

CONFIG_ERROR = 2
"""Exit status of a configuration error (as argparse uses); anything else that fails exits with 1."""
_ONE_LINE = (SPPOConfigError, NonFiniteError, MisconfigurationException, ArgumentError)
_STATUS = "sppo/failed"  # "rank:exit status" of the first rank that failed
_SEEN = "sppo/seen"  # how many ranks other than 0 have read it and are leaving
_EARLY_STATUS = "sppo/failed-before-start"  # the same, for a failure before the process group (torchrun's store)
_REPORTED = "sppo/reported-before-start"  # set once that rank's report is written
_REPORT_WAIT_S = 30.0  # at most this long, the other ranks wait for the report before they exit
_POLL_S = 1.0
_LINGER_S = 5.0  # at most this long, rank 0 waits for the others to have read the status
_FOLLOW_S = 2.0  # the others leave this long after, once rank 0 is gone
_watched: Any = None  # the store a watcher thread polls (one per process group)
_watcher: tuple[threading.Thread, threading.Event] | None = None  # the watcher thread and what stops it
_JOIN_S = (
    30.0  # at most this long, stopping the watcher waits for a store call in flight (the store's timeout is longer)
)
_leaving = threading.Lock()  # taken, never released, by whichever thread ends this process after a failure


@contextmanager
def exit_on_failure(program: str = "sppo") -> Iterator[None]:
    """Run the block; on an exception, report it (if this rank fails first) and end the process."""
    try:
        yield
    except Exception as error:  # SystemExit (--help, a finished launcher) and KeyboardInterrupt pass through
        if os.environ.get("SPPO_TRACEBACK"):
            raise
        if _store() is not None and not _leaving.acquire(blocking=False):
            threading.Event().wait()  # another rank failed first: the watcher thread is ending this process
        if (store := _store()) is not None and _follows_a_peer(error) and (status := _peer_status(store)) is not None:
            _leave(store)  # the rank that failed reports its own error; this one only passed it on
            os._exit(status)
        ours = _settings_error(error)
        code = CONFIG_ERROR if ours is not None and not isinstance(ours, NonFiniteError) else 1
        if _store() is None and (early := _launcher_store()) is not None:
            sys.exit(_fail_before_start(early, error, program, code))
        first, code = _announce(code)
        if first:
            report(error, program)
        sys.stdout.flush()
        sys.stderr.flush()
        if (store := _store()) is not None:
            _leave(store)
            os._exit(code)  # peers may be blocked in collectives with us: no teardown, no atexit
        sys.exit(code)


def end_now(code: int) -> NoReturn:
    """End this process at once with ``code`` (no teardown: a second Ctrl-C), and every other rank within about a
    second with the same status (unless another rank failed first: then its status)."""
    if (store := _store()) is not None and _leaving.acquire(blocking=False):
        _, code = _announce(code)
        _leave(store)
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):  # in a signal handler, the stream may be in the middle of a write
            stream.flush()
    os._exit(code)


def report(error: BaseException, program: str = "sppo", chosen: bool = False) -> None:
    """Print ``error`` to stderr: one line for the errors a user fixes in the settings, else the traceback.
    ``chosen``: this rank was picked to report a settings error found before the processes met (no rank named)."""
    rank, world = _rank_and_world()
    where = f"rank {rank}: " if world > 1 else ""
    ours = _settings_error(error)
    if ours is not None:
        if chosen:
            where = ""
        elif _store() is None and not isinstance(ours, NonFiniteError):
            # Before the processes meet every rank read the same settings: the one that becomes global rank 0
            # says it, once, without a rank (a launcher may not say how many ranks there are: SLURM).
            if not launching_rank_zero():
                return
            where = ""
        print(f"{program}: error: {where}{one_line(ours)}", file=sys.stderr)
        return
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    print(f"{text}{program}: {where}failed with the {type(error).__name__} above", file=sys.stderr)


def launching_rank_zero() -> bool:
    """Whether this process is, or launches as, global rank 0, read from what every launcher sets before any
    process group exists: Lightning's rank (``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, or the strategy's once
    set) and the node (``NODE_RANK`` of Lightning's launcher, ``GROUP_RANK`` of torchrun)."""
    node = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    return (rank_zero_only.rank or 0) == 0 and node == "0"


def _follows_a_peer(error: BaseException) -> bool:
    """Whether ``error`` is, or was caused by, another rank's failure passed on to this one."""
    return any(isinstance(link, PeerFailedError) for link in error_chain(error))


def _peer_status(store: Any) -> int | None:
    """The exit status another rank announced for its failure, waited for up to ``_REPORT_WAIT_S`` (its teardown
    runs first); None if none came (that rank died without a word: this one reports what it knows)."""
    try:
        store.wait([_STATUS], timedelta(seconds=_REPORT_WAIT_S))
        rank, _, code = _as_text(store.get(_STATUS)).partition(":")
    except Exception:  # no announcement in time, or the store is gone
        return None
    return int(code) if rank != str(dist.get_rank()) else None


def _settings_error(error: BaseException) -> BaseException | None:
    """The error a user fixes in the settings, if ``error`` is one or wraps one (jsonargparse re-raises the
    error of a class it could not build as its own ``ValueError``, chained to ours)."""
    return next((link for link in error_chain(error) if isinstance(link, _ONE_LINE) or is_settings_error(link)), None)


def one_line(error: BaseException) -> str:
    """The most specific line of a (possibly nested, multi-line) error message; a command-line mistake
    without a suggestion of ours points to ``--help``.

    jsonargparse wraps the error of a class it could not build (ours name the setting) into a report of every
    type it tried; the line from our own checks, or the "not accepted" option, is the one worth showing.
    """
    text, ours = _specific_line(error)
    if isinstance(error, ArgumentError) and not ours and "did you mean" not in text:
        return f"{text} (see `sppo fit --help`)"
    return text


def specific_line(error: BaseException) -> str:
    """``one_line`` without the pointer to ``--help``."""
    return _specific_line(error)[0]


def _specific_line(error: BaseException) -> tuple[str, bool]:
    if (union := _union_line(str(error))) is not None:
        return union, False
    lines = _lines(str(error))
    ours = [line for line in lines if "=" in line and ("Unknown" in line or "must" in line)]
    options = [line for line in lines if "not accepted" in line or "does not exist" in line]
    if not ours and not options and len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}", False  # 'Parser key "data.seq_len": Expected a <class 'int'>. ...'
    return (ours or options or lines or [repr(error)])[0], bool(ours)


def _lines(text: str) -> list[str]:
    """The non-blank lines of a message, without their indentation and list bullets (``- ``); a leading option
    (``--tokenizer=...``) keeps its dashes."""
    lines = (re.sub(r"^\s*(?:-\s+)*", "", line).rstrip() for line in text.splitlines())
    return [line for line in lines if line.strip("- ")]


_KEY = re.compile(r'^Parser key "([^"]+)":$')
_UNION = "Does not validate against any of the Union subtypes"


def _union_line(text: str) -> str | None:
    """jsonargparse's report of a value that fits none of an option's types, as one line: the option (a class's
    argument in full, ``trainer.strategy.init_args.fsdp_sync``), the types it takes and the value given; None
    for any other message."""
    lines = _lines(text)
    if len(lines) < 2 or not (outer := _KEY.match(lines[0])) or lines[1] != _UNION:
        return None
    if any("not accepted" in line or "does not exist" in line for line in lines):
        return None  # an unknown option inside: _specific_line names it (and the suggestion follows)
    key, rest = outer.group(1), lines[1:]
    inner = next((i for i, line in enumerate(rest) if _KEY.match(line)), None)
    if inner is not None and any(line.startswith("Problem with given class_path") for line in rest[:inner]):
        key, rest = f"{key}.init_args.{_KEY.match(rest[inner]).group(1)}", rest[inner + 1 :]  # type: ignore[union-attr]
        if rest and rest[0] != _UNION:
            return f'Parser key "{key}": {_types(rest[0])}'
    subtypes = next((line.removeprefix("Subtypes: ") for line in rest if line.startswith("Subtypes: ")), "?")
    given = next((line.removeprefix("Given value: ") for line in rest if line.startswith("Given value: ")), "?")
    return f'Parser key "{key}": expected one of {_types(subtypes)}, got value: {given}'


def _types(text: str) -> str:
    """``<class 'int'>`` -> ``int``, ``typing.Literal['a', 'b']`` -> ``Literal['a', 'b']``."""
    return re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text).replace("typing.", "").replace("NoneType", "None")


def watch_peers() -> None:
    """Exit this process, with the same status, within about a second of another rank's failure.

    The watcher is a daemon thread that calls into the store (C++, the GIL released): it must be stopped with
    ``stop_watching_peers`` before the interpreter finalizes. A daemon thread that comes back from C++ during
    finalization is ended by ``pthread_exit``, whose unwinding through pybind11's GIL guard (a ``noexcept``
    destructor) calls ``std::terminate``: "terminate called without an active exception", SIGABRT, after a run
    that finished."""
    global _watched, _watcher
    store = _store()
    if store is None or store is _watched:
        return
    stop_watching_peers()  # the watcher of an earlier process group, if any
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(store, stop), name="sppo-peer-watch", daemon=True)
    _watched, _watcher = store, (thread, stop)
    thread.start()


@atexit.register  # a safety net for exits that skip the explicit shutdown: atexit runs before finalization
def stop_watching_peers() -> bool:
    """Stop the watcher and wait for it (a store call in flight returns first); drop its store. Returns whether
    no watcher is left running (False only if a store call did not return within ``_JOIN_S``)."""
    global _watched, _watcher
    watcher, _watcher, _watched = _watcher, None, None
    if watcher is None or watcher[0] is threading.current_thread():
        return True
    thread, stop = watcher
    stop.set()
    thread.join(_JOIN_S)
    return not thread.is_alive()


class FailFast(L.Callback):
    """Starts ``watch_peers`` once the processes have met (the Trainer's set-up)."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        watch_peers()


def _watch(store: Any, stop: threading.Event) -> None:
    me = str(dist.get_rank())
    # Once this process is leaving (a failure) or shutting down, hands off the store.
    while dist.is_initialized() and not _leaving.locked() and not stop.is_set():
        try:
            if store.check([_STATUS]):
                rank, _, code = _as_text(store.get(_STATUS)).partition(":")
                if rank == me or not _leaving.acquire(blocking=False):  # the main thread is leaving on its own
                    return
                _leave(store)
                sys.stderr.flush()
                os._exit(int(code))
        except Exception:  # the store went away (its host finished): nothing is left to watch
            return
        stop.wait(_POLL_S)


def _launcher_store() -> Any:
    """A client of the store torchrun's agent hosts, reachable before ``init_process_group`` (None elsewhere)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    except Exception:  # no store to reach: report as without one
        return None


def _fail_before_start(store: Any, error: BaseException, program: str, code: int) -> int:
    """The first rank to fail reports; the others wait until its report is out. Returns the exit status."""
    rank = os.environ.get("RANK", "0")
    try:
        first = _as_text(store.compare_set(_EARLY_STATUS, "", f"{rank}:{code}"))
    except Exception:  # the store went away: say what we know
        first = f"{rank}:{code}"
    if first.partition(":")[0] == rank:
        report(error, program, chosen=True)
        sys.stdout.flush()
        sys.stderr.flush()
        with suppress(Exception):  # nobody left to tell
            store.set(_REPORTED, "1")
    else:
        with suppress(Exception):  # the reporting rank died first: exit with the status it announced
            store.wait([_REPORTED], timedelta(seconds=_REPORT_WAIT_S))
    return int(first.rpartition(":")[2])


def _announce(code: int) -> tuple[bool, int]:
    """Record this rank's failure: (whether it is the first, the exit status the job ends with).

    One atomic compare-and-set of "rank:status": the first rank's value stays, and every later one reads it.
    """
    store = _store()
    if store is None:
        return True, code
    mine = f"{dist.get_rank()}:{code}"
    try:
        first = _as_text(store.compare_set(_STATUS, "", mine))
    except Exception:  # the store's host is gone: say what we know rather than nothing
        return True, code
    return first == mine, int(first.rpartition(":")[2])


def _leave(store: Any) -> None:
    """The order of exits, a few seconds at most: rank 0 leaves once every other rank has read the status
    (Lightning's launcher hosts the store in rank 0: no rank may need it afterwards), and before them (that
    launcher kills its main process with SIGKILL when a child exits first, losing the job's exit status). The
    others touch the store no more once counted: a store whose host has gone prints C++ stack traces."""
    try:
        if dist.get_rank() != 0:
            store.add(_SEEN, 1)
            time.sleep(_FOLLOW_S)
            return
        deadline = time.monotonic() + _LINGER_S
        while store.add(_SEEN, 0) < dist.get_world_size() - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # the store is gone already: nobody is left to wait for
        return


def _as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


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
