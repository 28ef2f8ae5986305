"""Workers for the layer order (FPDT's) on several processes: every case against the plain model on one process.

One launch per layout loops over its cases (process start-up costs more than a step of the tiny model).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_sppo import GPT
from lightning_sppo.runtime.layer_major import LayerGroups, LayerMajorEngine
from tests.conftest import (
    IGNORE,
    document_ids_from_lengths,
    full_tensor,
    launch_fabric,
    make_batch,
    parity_config,
    relative_error,
)

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

    def __str__(self) -> str:
        spill = f" kv_device_tokens={self.kv_device_tokens}" if self.kv_device_tokens is not None else ""
        documents = " documents" if self.documents else ""
        host = " model_state=host" if self.host else ""
        return f"N={self.chunks} {self.recompute} offload={self.offload} G={self.groups}{spill}{documents}{host}"

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
    config = parity_config(gqa=True, n_query_groups=case.groups)
    ids, targets = make_batch(config, rows, S, seed=case.chunks)
    document_ids = document_ids_from_lengths(DOCUMENTS[:rows]) if case.documents else None
    return config, ids, targets, document_ids


def engine_parity(rank: int, world_size: int, cases: list[Case]) -> None:
    """The engine alone with every rank sequence-parallel (no sharding): the loss on every rank, and the
    gradients each rank leaves summed over the ranks, equal the plain model's (relative error < 1e-5)."""
    dist.init_process_group("gloo")
    groups = LayerGroups(sequence=dist.group.WORLD, loss=dist.group.WORLD)
    for case in cases:
        config, ids, targets, document_ids = batch(case, 2)
        plain, ref_loss, ref_grads = reference(config, ids, targets, document_ids)
        model = copy.deepcopy(plain)
        engine = LayerMajorEngine(
            case.chunks, recompute=case.recompute, offload=case.offload, kv_device_tokens=case.kv_device_tokens,
            kv_chunk_tokens=5, groups=groups,
        )  # fmt: skip
        loss = engine.forward_backward(model, ids, targets, document_ids)
        where = f"rank {rank} of sp={world_size}: {case}"
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (where, loss.item(), ref_loss.item())
        if case.kv_device_tokens is not None:
            assert engine.cache_host_nbytes() > 0, where  # K/V really went to host
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad)  # each rank's share of the gradient
            err = relative_error(grad, ref_grads[name])
            assert err < 1e-5, f"{where}: grad of {name} off by {err}"


def parity(rank: int, world_size: int, dp: int, sp: int, cases: list[Case]) -> None:
    """Through the Fabric strategy (order="layer", FSDP2 over dp x sp): the loss, every gradient, the global
    gradient norm and the parameters after a clipped SGD step equal the plain model's (relative error < 1e-5)."""
    rows = 2 * dp
    for case in cases:
        config, ids, targets, document_ids = batch(case, rows)
        plain, ref_loss, ref_grads = reference(config, ids, targets, document_ids)
        fabric = launch_fabric(world_size, sequence_parallel=sp, **case.settings())
        model = copy.deepcopy(plain)
        stage, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        mine = _rows(fabric, rank)
        loss = fabric.strategy.forward_backward(
            stage, ids[mine], targets[mine], None if document_ids is None else document_ids[mine]
        )
        where = f"rank {rank} (dp={dp}, sp={sp}) {case}"
        engine = fabric.strategy.engine
        assert type(engine).__name__ == "LayerMajorEngine" and len(engine.last_lengths) == case.chunks, where
        _check_memory_modes(stage, engine, case, where)
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (where, loss.item(), ref_loss.item())
        for name, param in stage.module.named_parameters():
            err = relative_error(full_tensor(param.grad), ref_grads[name])
            assert err < 1e-5, f"{where}: grad of {name} off by {err}"
        # Clip to half the global norm: every shard must agree on the norm of the whole model.
        ref_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm()
        norm = fabric.clip_gradients(stage, optimizer, max_norm=0.5 * ref_norm.item())
        assert abs(norm.item() - ref_norm.item()) / ref_norm.item() < 1e-5, (where, norm.item(), ref_norm.item())
        scale = 0.5 * ref_norm / (ref_norm + 1e-6)
        optimizer.step()
        plain_params = dict(plain.named_parameters())
        for name, param in stage.module.named_parameters():
            expected = plain_params[name].detach() - LR * scale * ref_grads[name]
            err = relative_error(full_tensor(param.detach()), expected)
            assert err < 1e-5, f"{where}: parameter {name} after SGD off by {err}"


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
        for step in range(2):
            log.clear()
            fabric.strategy.forward_backward(stage, ids[mine], targets[mine])
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
