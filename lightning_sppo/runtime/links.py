"""The process groups that carry a pipeline's messages: one per stage pair and direction, so NCCL cannot deadlock.

NCCL's rules for point-to-point messages (the NCCL p2p docs, ProcessGroupNCCL):

* every un-batched send or receive between two ranks of one process group runs on one in-order stream;
* a receive blocks that stream until the peer's matching send runs, and a send may block it until the matching
  receive runs (always, for messages larger than NCCL's buffers);
* ``tag`` is ignored; the k-th send from a to b on a group matches the k-th receive there.

The runtime posts receives ahead of the sends that come before them in its action list (``recv_lookahead``).
On one group per stage pair, rank k's stream would hold ``recv(B), recv(B), send(F), send(F)`` and rank k+1's
``recv(F), recv(F), send(B), send(B)``: each head waits on a send queued behind the other's head, and the
first step of every layout hangs. Gloo buffers sends and honours tags, so CPU runs never show it.

Here every (pipeline column, stage pair, direction) gets its own 2-rank group: activations k -> k+1 on one,
gradients k+1 -> k on another. A group then carries one direction only; the sender queues its sends and the
receiver its receives, both in schedule order, so the k-th send meets the k-th receive whatever else either
rank has in flight, and no rank's queue can wait on a message queued behind its own. Tags are not needed:
within one direction the schedule's order identifies every message.

Why not ``batch_isend_irecv`` (matched send/receive pairs issued together, as Megatron and torch's pipelining
do)? Schedules are data: the runtime executes SEND and RECV actions one by one, in the order lowering put them.
Batching would need a lowering pass that pairs every rank's sends with its neighbour's receives so that both
sides issue identical batches, and a send could not leave before the receive it is paired with is posted. Per
direction groups keep the action lists as they are and keep receives posted ahead. The price is four NCCL
communicators per rank at most (one per neighbour and direction), created once.

``lightning_sppo.parallel.comm_order`` replays steps recorded on gloo under these rules; CI replays every
schedule and layout (tests/distributed/test_nccl_order.py).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["Link", "pipeline_links"]

Link = tuple[int, int]
"""``(source stage, destination stage)`` of one direction between neighbouring stages."""


def pipeline_links(columns: list[list[int]], rank: int) -> dict[Link, dist.ProcessGroup]:
    """The groups of ``rank``'s column, by direction: ``(k, k + 1)`` activations, ``(k + 1, k)`` gradients.

    ``columns`` lists, for every (dp, sp) column, the global rank of each stage. NCCL creates communicators
    collectively (with a bound device, ``new_group`` splits the default communicator on every rank), so every
    rank creates every column's groups, in this one order, and keeps its own.
    """
    links: dict[Link, dist.ProcessGroup] = {}
    for column in columns:
        for stage in range(len(column) - 1):
            for src, dst, kind in ((stage, stage + 1, "activations"), (stage + 1, stage, "gradients")):
                ranks = [column[src], column[dst]]
                group = dist.new_group(ranks, group_desc=f"pp_{kind}_{column[src]}_to_{column[dst]}")
                if rank in ranks:
                    links[(src, dst)] = group
    return links
