"""Workers for the initial weights of a model built on the meta device (as ``sppo fit`` builds it): every layout
materialises the plain model's weights and computes the plain model's first loss."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_sppo import GPT, GPTConfig
from tests.conftest import full_tensor, launch_fabric, make_batch, old_reset_parameters, plain_loss_and_grads

SEED = 1337
S = 64
BATCH_PER_DP = 2
CONFIG = dict(n_layer=4, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, intermediate_size=32, block_size=256)


def config(tied: bool = False) -> GPTConfig:
    return GPTConfig(**CONFIG, tie_embeddings=tied)


def first_loss(rank: int, world_size: int, settings: dict, out: str, old_init: bool = False) -> None:
    """One ``forward_backward`` of a model built on the meta device under ``torch.manual_seed(SEED)`` on the
    layout ``settings`` describes. Rank 0 writes the loss, the plain model's, and the names of the parameters that
    differ from the plain model's (gathered over the ranks; DTensor shards gathered whole). Ranks other than 0 draw
    from the global generator once more before the model: the strategy must use rank 0's seed. ``old_init``: the
    initialisation before issue 39 (the negative control)."""
    if old_init:
        GPT.reset_parameters = old_reset_parameters
    tied = settings.pop("tied", False)
    model_config = config(tied)
    torch.manual_seed(SEED)
    plain = GPT(model_config)
    fabric = launch_fabric(world_size, **settings)
    torch.manual_seed(SEED)
    if rank > 0:
        torch.rand(3)  # a rank that used the global generator otherwise draws another seed: rank 0's must win
    with torch.device("meta"):
        model = GPT(model_config)
    stage = fabric.setup_module(model)
    dims = fabric.strategy.dims
    dp = dims.dp if dims is not None else 1
    dp_rank = dims.coordinates(rank)[1] if dims is not None else 0
    ids, targets = make_batch(model_config, dp * BATCH_PER_DP, S, seed=5)
    rows = slice(dp_rank * BATCH_PER_DP, (dp_rank + 1) * BATCH_PER_DP)
    loss = fabric.strategy.forward_backward(stage, ids[rows], targets[rows])
    ref_loss, _ = plain_loss_and_grads(plain, ids, targets)

    expected = dict(plain.named_parameters())
    names = {"wte.weight" if tied and n == "lm_head.weight" else n: p for n, p in stage.module.named_parameters()}
    differing = sorted(n for n, p in names.items() if not torch.equal(full_tensor(p.detach()), expected[n].detach()))
    held = sorted(names)
    if dist.is_initialized():
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, (differing, held))
        differing = sorted({n for d, _ in gathered for n in d})
        held = sorted({n for _, h in gathered for n in h})
    if rank == 0:
        result = {"loss": loss.item(), "plain": ref_loss.item(), "differing": differing, "held": held,
                  "plain_names": sorted(expected)}  # fmt: skip
        Path(out).write_text(json.dumps(result))
