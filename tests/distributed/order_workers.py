"""Workers for the NCCL-order tests: record real steps on gloo, replay every rank's calls under NCCL's rules.

One worker per world size loops over its layouts (process start-up costs more than a step of the tiny
model). ``record`` is the piece other tests can reuse: it builds a layout the way ``workers.py`` does and
runs any body (a training step, an evaluation pass) under the recorder.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from lightning.fabric import Fabric

from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.offload import OffloadCallback
from lightning_sppo.parallel.comm_order import Call, CommunicationHang, Message, Trace, Wait, replay
from lightning_sppo.parallel.comm_trace import gather_traces, record_communication
from lightning_sppo.schedule import Op
from tests.conftest import document_ids_from_lengths, make_batch, parity_config

S = 48  # tokens: with N=4, subsequences of 12, split over sp=2 and shared by up to 4 ranks in blocks of 2
SCHEDULES = ("seq1f1b", "gpipe", "sppo")


class Layout(NamedTuple):
    pp: int
    sp: int
    schedule: str
    num_microbatches: int
    offload: str  # "none" or "full"
    dp: int = 1
    partition: str = "length"
    documents: bool = False  # packed documents (document_ids with the batch)
    recompute: str = "none"  # "selective" and "full" run a stage's all-to-alls again in backward
    kv_device_tokens: int | None = None  # K/V beyond these tokens on host, streamed in chunks of 8
    model_state: str = "device"  # "host": FSDP2's CPU offload (a one-rank FSDP mesh per stage where dp x sp = 1)

    def without_spill(self) -> Layout:
        return self._replace(kv_device_tokens=None)

    @property
    def num_subsequences(self) -> int:
        return max(self.pp, 2)  # the "sppo" schedule needs N >= pp

    def __str__(self) -> str:
        documents = " documents" if self.documents else ""
        recompute = f" recompute={self.recompute}" if self.recompute != "none" else ""
        spill = f" kv_device_tokens={self.kv_device_tokens}" if self.kv_device_tokens is not None else ""
        host = " model_state=host" if self.model_state == "host" else ""
        return (
            f"pp={self.pp} sp={self.sp} dp={self.dp} {self.schedule} M={self.num_microbatches} offload={self.offload}"
            f" {self.partition}{documents}{recompute}{spill}{host}"
        )


def grid(pp: int, sp: int) -> list[Layout]:
    """Every schedule, M in {1, 2}, offload off and on, for one (pp, sp)."""
    return [Layout(pp, sp, s, m, o) for s in SCHEDULES for m in (1, 2) for o in ("none", "full")]


def train_step(fabric: Fabric, stage, ids: torch.Tensor, targets: torch.Tensor, document_ids=None) -> None:
    """What a training step communicates: forward and backward of every unit, then gradient clipping."""
    fabric.strategy.forward_backward(stage, ids, targets, document_ids)
    fabric.clip_gradients(stage, None, max_norm=1.0)


def record(
    layout: Layout,
    world_size: int,
    body: Callable = train_step,
    tamper: Callable | None = None,
) -> tuple[Fabric, list[Trace]]:
    """Build ``layout`` (a tiny GPT), run ``body(fabric, stage, ids, targets)`` once under the recorder; every
    rank's trace, on every rank. ``tamper(runtime)`` may change the runtime first (negative controls)."""
    offload = "none" if layout.offload == "none" else OffloadCallback(layout.offload, min_bytes=0)  # tiny tensors count
    strategy = SPPOStrategy(
        pipeline_parallel=layout.pp,
        sequence_parallel=layout.sp,
        num_subsequences=layout.num_subsequences,
        num_microbatches=layout.num_microbatches,
        schedule=layout.schedule,
        offload=offload,
        partition=layout.partition,
        recompute=layout.recompute,
        kv_device_tokens=layout.kv_device_tokens,
        kv_chunk_tokens=8,
        model_state=layout.model_state,
    )
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    torch.manual_seed(0)
    config = parity_config(gqa=True, n_layer=layout.pp)
    stage = fabric.setup(GPT(config))
    if tamper is not None:
        tamper(fabric.strategy.core.runtime)
    m = layout.num_microbatches
    ids, targets = make_batch(config, m * layout.dp, S, seed=1)
    dp_rank = fabric.strategy.dims.coordinates(dist.get_rank())[1]
    rows = slice(dp_rank * m, (dp_rank + 1) * m)
    with record_communication() as trace:
        if layout.documents:  # one document across subsequences, one-token ones, different per row
            lengths = [[30, 1, 5, 12], [12, 1, 1, 20, 14], [48], [3, 7, 2, 9, 11, 16]]
            document_ids = document_ids_from_lengths([lengths[r % 4] for r in range(m * layout.dp)])
            body(fabric, stage, ids[rows], targets[rows], document_ids=document_ids[rows])
        else:
            body(fabric, stage, ids[rows], targets[rows])
    return fabric, gather_traces(trace)


def _calls(trace: Trace) -> list[Call]:
    return [event for event in trace if isinstance(event, Call)]


def _check_messages_recorded(fabric: Fabric, layout: Layout, trace: Trace, steps: int = 1) -> None:
    """The recorder saw exactly the runtime's SENDs and RECVs, each on its direction's 2-rank group."""
    actions = fabric.strategy.core.runtime.actions(layout.num_subsequences, layout.num_microbatches)
    kinds = Counter(call.kind for call in _calls(trace))
    expected = {
        "isend": steps * sum(a.op in (Op.SEND_F, Op.SEND_B) for a in actions),
        "irecv": steps * sum(a.op in (Op.RECV_F, Op.RECV_B) for a in actions),
    }
    assert {kind: kinds[kind] for kind in expected} == expected, (str(layout), kinds, expected)
    links = {call.comm for call in _calls(trace) if call.kind in expected}
    assert all(len(comm.ranks) == 2 for comm in links), (str(layout), links)
    assert len({comm.name for comm in links}) == len(links), links
    if layout.schedule == "sppo" and any(a.multiplexed for a in actions):
        # The shared units' traffic is replayed too: tokens and attention (all-to-all on the sharing groups),
        # weights streamed in (broadcast) and their gradients reduced to the owner.
        shared = {call.kind for call in _calls(trace) if "sppo_sharing" in call.comm.desc}
        assert {"all_to_all", "broadcast", "reduce"} <= shared, (str(layout), shared)


def replay_layouts(rank: int, world_size: int, layouts: list[Layout]) -> None:
    """Each layout's recorded step completes under NCCL's rules (rank 0 prints what it replayed)."""
    for layout in layouts:
        start = time.perf_counter()
        fabric, traces = record(layout, world_size)
        _check_messages_recorded(fabric, layout, traces[rank])
        replay(traces)
        if rank == 0:
            events = sum(map(len, traces))
            print(f"replayed {layout}: {events} events, {time.perf_counter() - start:.1f}s", flush=True)


def spill_keeps_the_order(rank: int, world_size: int, layouts: list[Layout]) -> None:
    """K/V on host (``kv_device_tokens``) replays, and every rank makes exactly the calls it makes without the spill
    (its copies are not collectives; ``site`` aside, nothing may move), except that under "sppo" the owner's prefix
    reaches a shared unit's members in chunks: on the sharing groups, the same broadcasts and reduces (weights and
    their gradients) and more all-to-alls (one per chunk and direction where a prefix spans several chunks)."""
    for layout in layouts:
        fabric, traces = record(layout, world_size)
        assert fabric.strategy.core.runtime.pool.host_nbytes() > 0, str(layout)  # the spill really ran
        replay(traces)
        _, plain = record(layout.without_spill(), world_size)
        for spilled, alone in zip(traces, plain, strict=True):
            assert _off_sharing(spilled) == _off_sharing(alone), str(layout)
            chunked, whole = (Counter(c.kind for c in _calls(t) if _sharing(c)) for t in (spilled, alone))
            assert {k: n for k, n in chunked.items() if k != "all_to_all"} == {
                k: n for k, n in whole.items() if k != "all_to_all"
            }, str(layout)
            assert chunked["all_to_all"] >= whole["all_to_all"], (str(layout), chunked, whole)
        if layout.schedule == "sppo":  # some prefix really travelled in several chunks
            more = sum(c.kind == "all_to_all" and _sharing(c) for t in traces for c in _calls(t))
            assert more > sum(c.kind == "all_to_all" and _sharing(c) for t in plain for c in _calls(t)), str(layout)
        if rank == 0:
            print(f"replayed {layout}: the order of the run without the spill, chunks aside", flush=True)


def _sharing(call: Call) -> bool:
    """A call on one of the "sppo" schedule's sharing groups (shared units' tokens, attention, weights)."""
    return "sppo_sharing" in call.comm.desc


def _off_sharing(trace: Trace) -> list[tuple]:
    return [_essence(c) for c in _calls(trace) if not _sharing(c)]


def _essence(call: Call) -> tuple:
    return call.kind, call.comm.ranks, call.messages, call.agree


# -- negative controls ------------------------------------------------------------------------------


def _one_group(lookahead: int) -> Callable:
    """The order before per-direction groups: every message on the default group (lookahead 2 was the default)."""

    def tamper(runtime) -> None:
        links = dict.fromkeys(runtime.groups.links, dist.group.WORLD)
        runtime.groups = dataclasses.replace(runtime.groups, links=links)
        runtime.recv_lookahead = lookahead

    return tamper


def one_group_hangs(rank: int, world_size: int, layouts: list[Layout], lookahead: int) -> None:
    """The real runtime with all messages on the default group runs on gloo, but its order hangs under NCCL:
    every rank stops at a message whose counterpart is queued behind the peer's own head call."""
    for layout in layouts:
        _, traces = record(layout, world_size, tamper=_one_group(lookahead))
        try:
            replay(traces)
        except CommunicationHang as hang:
            report = str(hang)
            if rank == 0:
                print(f"{layout}, lookahead {lookahead}: {report}", flush=True)
            assert "'s matching " in report and "is queued behind its call" in report, report
            continue
        raise AssertionError(f"{layout}, lookahead {lookahead}: all messages on one group replayed without a hang")


# -- the recorder itself ----------------------------------------------------------------------------


def recorder_sees_every_call(rank: int) -> None:
    """On 2 ranks: P2P with peer and group, a batch, async and sync collectives, a functional collective, and
    each wait, recorded as issued; the recorder leaves torch.distributed as it found it."""
    originals = (dist.isend, dist.all_reduce, dist.Work.wait, funcol.all_reduce)
    link = dist.new_group([0, 1], group_desc="test_link")
    peer, x, y, z = 1 - rank, torch.full((2, 3), float(rank)), torch.empty(2, 3), torch.empty(2, 3)
    with record_communication() as trace:
        first = dist.isend(x, dst=peer, group=link) if rank == 0 else dist.irecv(y, src=peer, group=link)
        batch = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, z, peer)])
        first.wait()
        for work in batch:
            work.wait()
        dist.all_reduce(x)
        funcol.all_reduce(x, "sum", link).wait()
    assert (dist.isend, dist.all_reduce, dist.Work.wait, funcol.all_reduce) == originals
    world, pair = _calls(trace)[2].comm, _calls(trace)[0].comm
    assert world.ranks == pair.ranks == (0, 1) and world != pair and pair.desc == "test_link", (world, pair)
    expected = [
        Call.send(pair, peer, (2, 3)) if rank == 0 else Call.recv(pair, peer, (2, 3)),
        Call.batch(world, Message(True, peer, (2, 3), "float32"), Message(False, peer, (2, 3), "float32")),
        Wait(0),
        *[Wait(1)] * len(batch),
        Call.collective("all_reduce", world, numel=6, dtype="float32"),
        Wait(3 + len(batch)),
        Call.collective("all_reduce", pair, numel=6, dtype="float32"),
        Wait(5 + len(batch)),
    ]
    assert [dataclasses.replace(e, site="") if isinstance(e, Call) else e for e in trace] == expected, trace
    assert all("order_workers.py" in call.site for call in _calls(trace)), [c.site for c in _calls(trace)]
    replay(gather_traces(trace))


# -- one worker per world size ----------------------------------------------------------------------


def documents_are_cut_and_sent_every_batch(rank: int, world_size: int, layouts: list[Layout]) -> None:
    """Packed documents with the "flops" partition: rank 0 cuts each batch by its documents and broadcasts the
    lengths (a header and the lengths) at every step, inside the replayed order; the steps replay."""
    for layout in layouts:
        fabric, traces = record(layout, world_size, body=_two_steps)
        _check_messages_recorded(fabric, layout, traces[rank], steps=2)
        replay(traces)
        broadcasts = [c for c in _calls(traces[rank]) if c.kind == "broadcast" and "step_plan/agree.py" in c.site]
        assert len(broadcasts) == 4, (str(layout), broadcasts)  # header + lengths, in both steps
        if rank == 0:
            print(f"replayed {layout}: {sum(map(len, traces))} events", flush=True)


def evaluation_replays(rank: int, world_size: int, layouts: list[Layout]) -> None:
    """The forward-only pass (validation) through each layout, then a training step: both, and their order
    relative to each other, complete under NCCL's rules."""
    for layout in layouts:
        fabric, traces = record(layout, world_size, body=_evaluate_then_train)
        replay(traces)
        sends = sum(call.kind == "isend" for call in _calls(traces[rank]))
        actions = fabric.strategy.core.runtime.actions(layout.num_subsequences, layout.num_microbatches)
        evaluation = fabric.strategy.core.runtime.actions(
            layout.num_subsequences, layout.num_microbatches, evaluation=True
        )
        assert sends == sum(a.op in (Op.SEND_F, Op.SEND_B) for a in [*actions, *evaluation]), (str(layout), sends)
        if rank == 0:
            print(f"replayed evaluation + step {layout}: {sum(map(len, traces))} events", flush=True)


def recompute_replays(rank: int, world_size: int, layouts: list[Layout]) -> None:
    """Recompute runs each block's forward again in its backward, Ulysses' all-to-alls included: the step still
    replays, and every block (of a unit a stage runs alone, or a shared unit's share) has its sequence-parallel
    all-to-alls once more (forward's four: q, k, v, and the attention output), i.e. 3/2 of them. On the "sppo"
    schedule's sharing groups, a selective replay adds no exchange (q and the kept output travel with the output's
    gradient), a full one the group's attention again."""
    for layout in layouts:
        ulysses, sharing = {}, {}
        for mode in ("none", layout.recompute):
            _, traces = record(layout._replace(recompute=mode), world_size)
            replay(traces)
            calls = [c for c in _calls(traces[rank]) if c.kind.startswith("all_to_all")]
            ulysses[mode] = sum(not _sharing(c) for c in calls)
            sharing[mode] = sum(_sharing(c) for c in calls)
        assert 2 * ulysses[layout.recompute] == 3 * ulysses["none"] > 0, (str(layout), ulysses)
        if layout.schedule == "sppo" and layout.recompute == "full":
            assert sharing["full"] > sharing["none"] > 0, (str(layout), sharing)
        else:
            assert sharing[layout.recompute] == sharing["none"], (str(layout), sharing)
        if rank == 0:
            print(f"replayed {layout}: all-to-alls on SP groups {ulysses}, on sharing groups {sharing}", flush=True)


def _evaluate_then_train(fabric: Fabric, stage, ids, targets, document_ids=None) -> None:
    fabric.strategy.evaluate(stage, ids, targets, document_ids)
    train_step(fabric, stage, ids, targets, document_ids)


def _two_steps(fabric: Fabric, stage, ids, targets, document_ids) -> None:
    train_step(fabric, stage, ids, targets, document_ids)
    train_step(fabric, stage, ids, targets, document_ids.flip(0))  # other documents per row: cut again


def two_ranks(rank: int, world_size: int) -> None:
    replay_layouts(rank, world_size, grid(2, 1))  # the first Fabric starts the default process group
    documents_are_cut_and_sent_every_batch(
        rank, world_size, [Layout(2, 1, s, 2, "none", partition="flops", documents=True) for s in ("seq1f1b", "sppo")]
    )
    evaluation_replays(rank, world_size, [Layout(2, 1, s, 2, "none") for s in SCHEDULES])
    spill_keeps_the_order(rank, world_size, [Layout(2, 1, s, 2, "full", kv_device_tokens=16) for s in SCHEDULES])
    # every memory mode at once under "sppo": shared units recompute, stream the prefix in chunks, stages on host
    host = Layout(2, 1, "sppo", 2, "full", recompute="selective", kv_device_tokens=16, model_state="host")
    replay_layouts(rank, world_size, [host, host._replace(recompute="full", num_microbatches=1)])
    recorder_sees_every_call(rank)
    one_group_hangs(rank, world_size, [Layout(2, 1, s, 1, "none") for s in SCHEDULES], lookahead=2)
    # Posting no receive ahead is not enough: seq1f1b with M=2 still crosses a send of each rank.
    one_group_hangs(rank, world_size, [Layout(2, 1, "seq1f1b", 2, "none")], lookahead=0)


def four_ranks(rank: int, world_size: int) -> None:
    replay_layouts(rank, world_size, grid(4, 1) + grid(2, 2))
    evaluation_replays(rank, world_size, [Layout(4, 1, "seq1f1b", 2, "full"), Layout(2, 2, "sppo", 2, "full")])
    recompute_replays(
        rank,
        world_size,
        [
            Layout(2, 2, "seq1f1b", 2, "full", recompute="selective"),
            Layout(2, 2, "gpipe", 1, "none", recompute="full"),
            Layout(2, 2, "sppo", 2, "full", recompute="full"),
            Layout(2, 2, "sppo", 1, "none", recompute="selective"),
        ],
    )
    spill_keeps_the_order(
        rank, world_size, [Layout(2, 2, "sppo", 2, "none", kv_device_tokens=16, recompute="selective")]
    )
    fsdp_collectives_are_recorded(rank, world_size)


def eight_ranks(rank: int, world_size: int) -> None:
    replay_layouts(rank, world_size, grid(4, 2))
    replay_layouts(rank, world_size, [Layout(4, 2, "sppo", 1, "none", recompute="full", kv_device_tokens=16)])


def fsdp_collectives_are_recorded(rank: int, world_size: int) -> None:
    """pp=2 x dp=2 (FSDP2 over dp): FSDP's all-gathers and reduce-scatters, the normalizer's all-reduce over dp
    and the loss and clipping all-reduces over the world are in the trace, and the step replays."""
    for schedule in ("seq1f1b", "sppo"):
        layout = Layout(2, 1, schedule, 2, "none", dp=2)
        fabric, traces = record(layout, world_size)
        replay(traces)
        pp_rank, dp_rank, _ = fabric.strategy.dims.coordinates(rank)
        shard = tuple(r for r in range(world_size) if fabric.strategy.dims.coordinates(r)[0] == pp_rank)
        seen = Counter((call.kind, call.comm.ranks) for call in _calls(traces[rank]))
        world = tuple(range(world_size))
        for kind, ranks in (("all_gather", shard), ("reduce_scatter", shard), ("all_reduce", shard)):
            assert seen[(kind, ranks)] > 0, (str(layout), kind, ranks, seen)
        assert seen[("all_reduce", world)] == 2, (str(layout), seen)  # the global loss, the gradient norm
        if rank == 0:
            print(f"replayed {layout}: {dict(seen)}", flush=True)
