"""Real multi-process runs on the gloo backend (CPU): start N processes, run a worker in each.

A worker is a module-level function ``worker(rank, world_size, *args)``; any exception in any process
fails the calling test with that process's traceback. Nothing here skips: if processes cannot start, the
test errors. Processes start from a fork server that has torch, Lightning and lightning_sppo imported already.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "lightning", "lightning_sppo", "tests.distributed.harness"]
# The processes are forked from a server that imported these once: a new process for every run (nothing carries
# over from one run to the next), without paying the imports again in each (seconds per process on CI's two cores).
mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def _entry(rank: int, worker: Callable, world_size: int, port: int, args: tuple) -> None:
    # The environment torchrun would set; Lightning's environment reads it and starts no processes itself.
    os.environ |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        # Connect to the parent's store as a client (torchrun's agent hosts it the same way).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    torch.set_num_threads(1)  # N processes share 2 cores
    try:
        worker(rank, world_size, *args)
        if dist.is_initialized():
            # Nobody tears the group down while a peer may still be talking to it: a gloo rank whose peer
            # closed its connections mid-operation can abort the process ("terminate called ..."). A gloo
            # barrier alone still races (a rank leaves it while its peer finishes the last exchange), so every
            # rank then also waits on the store until all of them are past it.
            dist.barrier()
            _store_barrier(world_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _store_barrier(world_size: int) -> None:
    store = dist.distributed_c10d._get_default_store()
    if store.add("harness/leaving", 1) == world_size:
        store.set("harness/all_left_gloo", "1")
    store.wait(["harness/all_left_gloo"])


def run_distributed(worker: Callable, world_size: int, *args) -> None:
    # The parent hosts the rendezvous store and holds its port for the whole run: a port found free and closed
    # again for rank 0 to listen on can be taken by another process meanwhile (EADDRINUSE).
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    mp.start_processes(
        _entry, args=(worker, world_size, store.port, args), nprocs=world_size, join=True, start_method="forkserver"
    )
