"""Real multi-process runs on the gloo backend (CPU): start N processes, run a worker in each.

A worker is a module-level function ``worker(rank, world_size, *args)``; any exception in any process
fails the calling test with that process's traceback. Nothing here skips: if processes cannot start, the
test errors.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    mp.start_processes(
        _entry, args=(worker, world_size, _free_port(), args), nprocs=world_size, join=True, start_method="spawn"
    )
