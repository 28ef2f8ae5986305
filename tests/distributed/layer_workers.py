"""Workers for the layer order (FPDT's) on several processes: every case against the plain model on one process.

One launch per layout loops over its cases (process start-up costs more than a step of the tiny model).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_sppo import GPT
from lightning_sppo.planner.layer_order import kept_bytes_per_token, kv_peak_bytes
from lightning_sppo.planner.precision import precision_bytes
from lightning_sppo.runtime.layer_major import LayerGroups, LayerMajorEngine
from tests.conftest import (
    IGNORE,
    document_ids_from_lengths,
    full_tensor,
    launch_fabric,
    make_batch,
    no_attribute_set,
    parity_config,
    relative_error,
)
from tests.distributed.workers import check_clipped_sgd_step

LR = 0.1
S = 48  # tokens per row: chunks of 12 or 16 split into 6 or 8 (sp=2), 3 or 4 (sp=4) tokens per rank
DOCUMENTS = [[5, 14, 1, 22, 6], [48], [30, 1, 5, 12], [3, 7, 2, 9, 11, 16]]
"""Per row: documents across chunk and rank boundaries, one-token ones; one document; ... (rows 0..3)."""


class Case(NamedTuple):
    chunks: int
    recompute: str = "selective"
    offload: str = "none"
    kv_device_tokens: int | None = None  # K/V beyond these tokens on host, streamed back in chunks of 5
    groups: int = 2  # K/V groups of the 4 query heads: 2 (GQA), 1 (MQA) or 4
    documents: bool = False
    host: bool = False  # model_state="host": parameters, gradients and optimizer state in host memory
    tied: bool = False  # the head's weight is the embedding's (one FSDP parameter, gradients from both ends)

    def __str__(self) -> str:
        spill = f" kv_device_tokens={self.kv_device_tokens}" if self.kv_device_tokens is not None else ""
        documents = " documents" if self.documents else ""
        host = " model_state=host" if self.host else ""
        tied = " tied" if self.tied else ""
        return f"N={self.chunks} {self.recompute} offload={self.offload} G={self.groups}{spill}{documents}{host}{tied}"

    def settings(self) -> dict:
        """The strategy's settings for this case."""
        return dict(
            order="layer", num_subsequences=self.chunks, recompute=self.recompute, offload=self.offload,
            kv_device_tokens=self.kv_device_tokens, kv_chunk_tokens=5, model_state="host" if self.host else "device",
        )  # fmt: skip


def reference(config, ids: torch.Tensor, targets: torch.Tensor, document_ids: torch.Tensor | None):
    """The plain model's (seed 0) loss and gradients over the whole batch, on one process."""
    torch.manual_seed(0)
    plain = GPT(config)
    ref = copy.deepcopy(plain)
    logits = ref(ids, document_ids=document_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    loss.backward()
    return plain, loss.detach(), {name: p.grad.clone() for name, p in ref.named_parameters()}


def batch(case: Case, rows: int):
    config = parity_config(gqa=True, n_query_groups=case.groups, tie_embeddings=case.tied)
    ids, targets = make_batch(config, rows, S, seed=case.chunks)
    document_ids = document_ids_from_lengths(DOCUMENTS[:rows]) if case.documents else None
    return config, ids, targets, document_ids


def parity(rank: int, world_size: int, dp: int, sp: int, cases: list[Case]) -> None:
    """Through the Fabric strategy (order="layer", FSDP2 over dp x sp): a forward-only evaluation's loss and target
    count, then the training step's loss, every gradient, the global gradient norm and the parameters after a
    clipped SGD step equal the plain model's (relative error < 1e-5)."""
    rows = 2 * dp
    for case in cases:
        config, ids, targets, document_ids = batch(case, rows)
        plain, ref_loss, ref_grads = reference(config, ids, targets, document_ids)
        fabric = launch_fabric(world_size, sequence_parallel=sp, **case.settings())
        model = copy.deepcopy(plain)
        stage, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        mine = _rows(fabric, rank)
        documents = None if document_ids is None else document_ids[mine]
        where = f"rank {rank} (dp={dp}, sp={sp}) {case}"
        with torch.inference_mode():  # as Lightning's validation loop calls it; first, so training sees its leftovers
            total, count = fabric.strategy.evaluate(stage, ids[mine], targets[mine], documents)
        assert count.item() == (targets != IGNORE).sum().item(), (where, count.item())
        assert abs(total.item() / count.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (where, total, count)
        loss = fabric.strategy.forward_backward(stage, ids[mine], targets[mine], documents)
        engine = fabric.strategy.engine
        assert type(engine).__name__ == "LayerMajorEngine", where
        _check_memory_modes(stage, engine, case, where)
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (where, loss.item(), ref_loss.item())
        for name, param in stage.module.named_parameters():
            err = relative_error(full_tensor(param.grad), ref_grads[name])
            assert err < 1e-5, f"{where}: grad of {name} off by {err}"
        check_clipped_sgd_step(fabric, stage, optimizer, plain, ref_grads, LR, where)


def _rows(fabric, rank: int) -> slice:
    """This rank's rows of the global batch: two per data-parallel rank."""
    dp_rank = fabric.strategy.dims.coordinates(rank)[1]
    return slice(2 * dp_rank, 2 * dp_rank + 2)


def _check_memory_modes(stage, engine, case: Case, where: str) -> None:
    """What the case asks for really happened: the model sharded by FSDP2 (on host with model_state="host"), the
    checkpoints on host with offload="full", K/V on host with kv_device_tokens."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from lightning_sppo.parallel.fsdp import fsdp_modules

    modules = fsdp_modules(stage.module)
    policies = [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in modules]
    if dist.get_world_size() > 1 or case.host:
        assert len(modules) == stage.module.config.n_layer + 1, where  # each block, and the root
    assert all(isinstance(p, CPUOffloadPolicy) == case.host for p in policies), where
    if case.offload == "full":
        assert engine.kept_host_nbytes() > 0, where
    if case.kv_device_tokens is not None:
        assert engine.cache_host_nbytes() > 0, where


def gathers_once_per_layer(rank: int, world_size: int, dp: int, sp: int, host: bool) -> None:
    """FSDP2 in the layer order, as issued on this rank over two steps: each block's weights are all-gathered once
    in the forward and once in the backward, the root's (embedding, norm, head) for the embedding, the loss and the
    embedding's backward; each gather is issued before the previous unit computes (the prefetch); gradients are
    reduce-scattered once per block and twice for the root (after the loss, after the embedding), never per chunk."""
    from lightning_sppo.model.gpt import Block

    log: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
    forward = Block.forward

    def logged(name, tag):
        def call(*args, **kwargs):
            log.append(tag)
            return originals[name](*args, **kwargs)

        return call

    dist.all_gather_single = logged("all_gather_single", "G")
    dist.reduce_scatter_single = logged("reduce_scatter_single", "R")
    try:
        case = Case(3, "selective", host=host)
        config, ids, targets, _ = batch(case, 2 * dp)
        plain, ref_loss, _ = reference(config, ids, targets, None)
        fabric = launch_fabric(world_size, sequence_parallel=sp, **case.settings())
        model = copy.deepcopy(plain)
        stage, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        layers = {id(block): str(i) for i, block in enumerate(stage.module.blocks.values())}
        Block.forward = lambda block, *args, **kwargs: log.append(layers[id(block)]) or forward(block, *args, **kwargs)
        mine = _rows(fabric, rank)
        engine = fabric.strategy.engine
        for step in range(2):
            log.clear()
            # The second step runs on what the first allocated (its caches): it runs rank 0's step plan and sets
            # nothing of the engine's own (DESIGN.md, "A step's plan is a value").
            with no_attribute_set(engine) if step else contextlib.nullcontext():
                fabric.strategy.forward_backward(stage, ids[mine], targets[mine])
            cuts = [None] * world_size
            dist.all_gather_object(cuts, fabric.strategy.core.last_plan.lengths)
            assert all(cut == cuts[0] for cut in cuts), (rank, step, cuts)  # every rank ran rank 0's chunks
            optimizer.step()
            optimizer.zero_grad()
            chunks = 3
            # root, block 0 (prefetched); block 1 before block 0 runs; root before block 1 runs; block 1 (for its
            # backward) before the loss; the root's reduce; block 0 before block 1's replay; ...
            expected = ["G", "G", "G", *"0" * chunks, "G", *"1" * chunks, "G", "R", "G", *"1" * chunks, "R", "G"]
            expected += [*"0" * chunks, "R", "R"]
            assert log == expected, (rank, step, "".join(log))
    finally:
        Block.forward = forward
        for name, original in originals.items():
            setattr(dist, name, original)


def negative_controls(rank: int, world_size: int) -> None:
    """sp=2, K/V on host in chunks of 5: the step is exact untouched, and each planted bug breaks the gradients the
    parity check compares: a chunk's dK/dV dropped by the chunk-major backward, a stale prefetched K/V chunk (each
    copy brings the previous host chunk), a gradient missing from one shard (rank 1's share of block 0 never
    reduced). Every rank compares, and they decide together (no rank leaves a collective early)."""
    from unittest import mock

    from lightning_sppo.parallel.fsdp_layers import LayerShards
    from lightning_sppo.runtime import layer_major
    from tests.runtime.streamed_kv import StaleCopies, copies_through

    chunk_major_backward, reduce = layer_major.chunk_major_backward, LayerShards.reduce

    def drop_chunk(chunks, keys, kernel, scale, finish, accumulator=None):
        def finished(j, dq, dk, dv):
            finish(j, dq, *((x.zero_() for x in (dk, dv)) if j == 1 else (dk, dv)))

        return chunk_major_backward(chunks, keys, kernel, scale, finished, accumulator)

    def drop_share(shards, unit):
        if unit == 0 and rank == 1:
            for group in shards._groups[unit]:
                for param in group.fsdp_params:
                    param.unsharded_param.grad.zero_()
        return reduce(shards, unit)

    tampers = {
        "untouched": contextlib.nullcontext,
        "a chunk's dK/dV dropped": lambda: mock.patch.object(layer_major, "chunk_major_backward", drop_chunk),
        "a stale prefetched K/V chunk": lambda: copies_through(StaleCopies()),
        "a gradient missing from one shard": lambda: mock.patch.object(LayerShards, "reduce", drop_share),
    }
    case = Case(4, "selective", kv_device_tokens=10)
    config, ids, targets, _ = batch(case, 2)
    plain, ref_loss, ref_grads = reference(config, ids, targets, None)
    for what, tamper in tampers.items():
        fabric = launch_fabric(world_size, sequence_parallel=2, **case.settings())
        stage = fabric.setup(copy.deepcopy(plain))
        with tamper():  # this process only
            loss = fabric.strategy.forward_backward(stage, ids, targets)
        errors = [relative_error(full_tensor(p.grad), ref_grads[n]) for n, p in stage.module.named_parameters()]
        worst = torch.tensor([max(errors), abs(loss.item() - ref_loss.item()) / ref_loss.item()])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if what == "untouched":
            assert worst.max().item() < 1e-5, (rank, what, worst)
        else:
            assert worst[0].item() > 1e-3, f"rank {rank}: parity held although {what}: {worst}"


def streamed_kv_on_ranks(rank: int, world_size: int) -> None:
    """K/V on host with sequence parallelism (each rank streams its heads' K/V): every chunk's successor in a pass is
    issued before the chunk is waited for, with copies that land only when waited for; and the device's K/V and
    dK/dV bytes (the engine's meter) are the same at 48, 96 and 192 tokens with chunks of 12 tokens (6 per rank) and
    kv_device_tokens=12, where with all K/V on the device they grow; they, and the bytes kept for the backward, are
    what the planner counts for one rank (``kv_peak_bytes`` of its groups, ``kept_bytes_per_token`` / P)."""
    from tests.runtime.streamed_kv import RecordingCopies, copies_through, tagged_passes

    dist.init_process_group("gloo")
    groups = LayerGroups(sequence=dist.group.WORLD, loss=dist.group.WORLD)
    case = Case(4, "full", kv_device_tokens=6, documents=True)
    config, ids, targets, document_ids = batch(case, 2)
    plain, ref_loss, _ = reference(config, ids, targets, document_ids)
    copies = RecordingCopies()
    engine = LayerMajorEngine(4, recompute="full", kv_device_tokens=6, kv_chunk_tokens=5, groups=groups)
    with tagged_passes(), copies_through(copies):
        loss = engine.forward_backward(copy.deepcopy(plain), ids, targets, document_ids)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (rank, loss.item(), ref_loss.item())
    assert copies.double_buffered() >= 10, rank
    peaks: dict[int | None, list[int]] = {12: [], None: []}
    # The planner's per-rank counts: K/V of max(G / P, 1) groups (here G = P = 2), kept bytes / P.
    per_rank = dataclasses.replace(config, n_query_groups=max(config.n_query_groups // world_size, 1))
    kept = kept_bytes_per_token(config, precision_bytes("fp32"), "selective")
    for device_tokens, seq_len in [(r, s) for r in peaks for s in (48, 96, 192)]:
        ids, targets = make_batch(config, 1, seq_len)
        engine = LayerMajorEngine(
            seq_len // 12, offload="full", kv_device_tokens=device_tokens, kv_chunk_tokens=6, groups=groups
        )
        engine.forward_backward(copy.deepcopy(plain), ids, targets)
        peaks[device_tokens].append(engine.meter.peak)
        spans = [(offset, 12) for offset in range(0, seq_len, 12)]  # "length": chunks of 12 tokens
        assert engine.meter.peak == kv_peak_bytes(per_rank, precision_bytes("fp32"), spans, device_tokens, 6), rank
        assert engine.kept_nbytes() == config.n_layer * seq_len // world_size * kept, (rank, engine.kept_nbytes())
    assert len(set(peaks[12])) == 1, (rank, peaks)
    assert peaks[None][0] < peaks[None][1] < peaks[None][2], (rank, peaks)


def replays_under_nccl(rank: int, world_size: int, layouts: list[tuple[int, int, Case]]) -> None:
    """Each (sp, dp, case): a training step, then a forward-only pass, recorded on gloo and replayed under NCCL's
    rules (``parallel.comm_order``). Per rank and step: 6 all-to-alls per chunk and layer on the sp group (forward:
    q/k/v in, out back; the backward's replay the same two; dout in; dq/dk/dv back), 2 in the evaluation; FSDP's
    all-gathers (2 per block, 3 for the root; in the evaluation 1 and 2) and reduce-scatters (1 per block, 2 for
    the root) on the dp x sp group once it has several ranks."""
    from collections import Counter

    from lightning_sppo.parallel.comm_order import Call, replay
    from lightning_sppo.parallel.comm_trace import gather_traces, record_communication

    for sp, dp, case in layouts:
        config, ids, targets, document_ids = batch(case, 2 * dp)
        plain, _, _ = reference(config, ids, targets, document_ids)
        fabric = launch_fabric(world_size, sequence_parallel=sp, **case.settings())
        model = copy.deepcopy(plain)
        stage, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        mine = _rows(fabric, rank)
        documents = None if document_ids is None else document_ids[mine]
        with record_communication() as trace:
            fabric.strategy.forward_backward(stage, ids[mine], targets[mine], documents)
            fabric.clip_gradients(stage, optimizer, max_norm=1.0)
            optimizer.step()
            fabric.strategy.evaluate(stage, ids[mine], targets[mine], documents)
        traces = gather_traces(trace)
        replay(traces)
        seen = Counter((c.kind, len(c.comm.ranks)) for c in traces[rank] if isinstance(c, Call))
        layers, where = config.n_layer, f"rank {rank} (sp={sp}, dp={dp}) {case}"
        assert seen[("all_to_all", sp)] == (6 + 2) * case.chunks * layers * (sp > 1), (where, seen)
        sharded = sp * dp > 1
        assert seen[("all_gather", sp * dp)] == (2 * layers + 3 + layers + 2) * sharded, (where, seen)
        assert seen[("reduce_scatter", sp * dp)] == (layers + 2) * sharded, (where, seen)
        if rank == 0:
            print(f"replayed sp={sp} dp={dp} {case}: {dict(seen)}", flush=True)


def mixed_precision(rank: int, world_size: int) -> None:
    """bf16-mixed at dp=2: FSDP2 gathers bf16 weights, the blocks compute in bf16 (their inputs cast as FSDP's hook
    would), gradients reduce in fp32 into the fp32 shards; the gradients are the plain fp32 model's to bf16 error."""
    from lightning.fabric import Fabric

    from lightning_sppo import SPPOStrategy
    from lightning_sppo.model.gpt import Block

    case = Case(3, "selective", kv_device_tokens=10)
    config, ids, targets, _ = batch(case, 4)
    plain, ref_loss, ref_grads = reference(config, ids, targets, None)
    fabric = Fabric(
        strategy=SPPOStrategy(**case.settings()), accelerator="cpu", devices=world_size, precision="bf16-mixed"
    )
    fabric.launch()
    stage = fabric.setup(copy.deepcopy(plain))
    seen, forward = [], Block.forward
    Block.forward = lambda block, x, *args: (
        seen.append((x.dtype, block.mlp.proj.weight.dtype)) or forward(block, x, *args)
    )
    try:
        loss = fabric.strategy.forward_backward(stage, ids[_rows(fabric, rank)], targets[_rows(fabric, rank)])
    finally:
        Block.forward = forward
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}, (rank, set(seen))
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 2e-2, (rank, loss.item(), ref_loss.item())
    for name, param in stage.module.named_parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, (rank, name)
        assert relative_error(full_tensor(param.grad), ref_grads[name]) < 5e-2, (rank, name)
