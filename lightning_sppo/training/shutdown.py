"""How a run ends on every rank, in one fixed order, so that no thread runs into Python while the interpreter exits.

Lightning tears the Trainer down inside ``fit`` (the strategy, the loops, the loggers' ``finalize``); what it leaves
running is ended here, in this order:

1. W&B: its run finished and its connection torn down (Lightning's logger leaves both to W&B's exit hook, with its
   asyncio thread still running);
2. every rank meets: a barrier of the process group (no rank is still in a collective, nor has work queued on its
   devices), then one of the store, since a rank can leave a gloo barrier while a peer still finishes its last
   exchange, and a connection closed under that exchange aborts the peer. The peer watcher still ends this rank if
   another one fails meanwhile;
3. the peer watcher, stopped and joined (``failures.stop_watching_peers``). It was the thread that aborted runs that
   had finished: a daemon thread inside a store call (C++, the GIL released) when the interpreter finalizes is ended
   by ``pthread_exit``, and the unwinding through pybind11's GIL guard, a ``noexcept`` destructor, calls
   ``std::terminate`` ("terminate called without an active exception", SIGABRT, exit status -6);
4. the process groups, destroyed (every group shut down), the ranks other than 0 first;
5. the store: rank 0, which hosts it under Lightning's launcher and SLURM, keeps it until the others have said they
   left the process group;
6. on a rank 0 that started the other ranks (Lightning's and Fabric's launchers): they are waited for, so the command
   ends after every rank, and with a failed rank's status if its own is 0. Lightning's observer of those ranks would
   SIGKILL rank 0 when one exits with a non-zero status (130, 143) first; it is given no ranks to watch.

The C++ threads left after this (gloo's loops, the TCPStore's server) belong to objects that join them when they are
destroyed and never call into Python. Failures end the process with ``os._exit`` (``failures.exit_on_failure``),
which skips the interpreter's finalization altogether; ``stop_watching_peers`` also runs at ``atexit`` for any other
way out.
"""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import suppress
from typing import Any

import torch.distributed as dist

from lightning_sppo.training.failures import stop_watching_peers

__all__ = ["shut_down"]

_MET = "sppo/met"  # how many ranks have returned from the shutdown's barrier
_ALL_MET = "sppo/all-met"
_LEFT = "sppo/left"  # how many ranks other than 0 have left the process group
_LEFT_WAIT_S = 10.0  # at most this long, rank 0 waits for them before it takes the store down
_RANKS_WAIT_S = 60.0  # at most this long, a launcher's rank 0 waits for the ranks it started to exit


def shut_down(launcher: Any = None, together: bool = True) -> int:
    """End what a run leaves running (see the module). ``launcher``: the strategy's launcher, whose ranks a rank 0
    waits for. ``together``: every rank gets here after the same run (a barrier first, and rank 0 leaves last);
    False after an interruption, when other ranks may be gone. Returns the first non-zero exit status of the ranks
    this process started (0: none failed, or none started)."""
    ranks = _take_ranks(launcher)
    _finish_wandb()
    if together and _world_size() > 1:
        together = _meet()
    stop_watching_peers()
    _leave_process_group(together)
    return _wait_for(ranks)


def _meet() -> bool:
    """Whether every rank got here: the process group's barrier, then the store's (see the module)."""
    try:
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        if store.add(_MET, 1) == dist.get_world_size():
            store.set(_ALL_MET, "1")
        store.wait([_ALL_MET])
    except Exception:  # a rank is gone (killed): leave without it
        return False
    return True


def _take_ranks(launcher: Any) -> list[Any]:
    """The processes ``launcher`` started, taken from the list its observer thread watches (the same list)."""
    started = getattr(launcher, "procs", None)
    if not isinstance(started, list) or not started:
        return []
    ranks = list(started)
    started.clear()
    return ranks


def _finish_wandb() -> None:
    """The run finished and W&B's connection to its service closed (its asyncio thread ends with it)."""
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return
    if getattr(wandb, "run", None) is not None:
        wandb.finish()
    wandb.teardown()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _leave_process_group(together: bool) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store() if world > 1 else None
    if together and store is not None and rank == 0:
        _wait_for_the_others(store, world)
    dist.destroy_process_group()
    if together and store is not None and rank != 0:
        with suppress(Exception):  # rank 0 is gone already: nobody waits for the count
            store.add(_LEFT, 1)


def _wait_for_the_others(store: Any, world: int) -> None:
    deadline = time.monotonic() + _LEFT_WAIT_S
    try:
        while store.add(_LEFT, 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # the store is gone (its host was another process): nobody to wait for
        return


def _wait_for(ranks: list[Any]) -> int:
    status = 0
    deadline = time.monotonic() + _RANKS_WAIT_S
    for process in ranks:
        try:
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        if code and not status:
            status = 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + its number
    return status
