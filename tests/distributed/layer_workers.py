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
from tests.conftest import IGNORE, document_ids_from_lengths, make_batch, parity_config, relative_error

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

    def __str__(self) -> str:
        spill = f" kv_device_tokens={self.kv_device_tokens}" if self.kv_device_tokens is not None else ""
        documents = " documents" if self.documents else ""
        return f"N={self.chunks} {self.recompute} offload={self.offload} G={self.groups}{spill}{documents}"


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
