"""Turn a plain GPT into this rank's pipeline stage: cut, subsequence attention, Ulysses, FSDP2.

The order matters: the model is cut first (so FSDP shards only what the stage owns), attention cores are
swapped before Ulysses wraps them, and FSDP comes last because it replaces the parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_sppo.attention import apply_subsequence_attention, select_kernel
from lightning_sppo.model.gpt import GPT
from lightning_sppo.parallel.dims import ParallelDims
from lightning_sppo.parallel.fsdp import FSDPOptions, apply_fsdp
from lightning_sppo.parallel.stages import layers_per_stage, split_stage
from lightning_sppo.parallel.tied import tie_pipeline_embeddings
from lightning_sppo.parallel.ulysses import apply_ulysses
from lightning_sppo.recompute import RecomputeMode, apply_recompute
from lightning_sppo.runtime.stage import StageModule

__all__ = ["build_stage", "build_stage_shell", "materialize", "parallelize_gpt", "parallelize_layers"]


def parallelize_gpt(
    model: GPT,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    attention: str = "auto",
    layers: list[int] | None = None,
    loss_chunk_tokens: int | None = None,
    fsdp: FSDPOptions | None = None,
    recompute: RecomputeMode = "none",
) -> StageModule:
    """This rank's stage of ``model`` (cut in place), ready for ``PipelineRuntime``.

    ``fsdp`` (mixed precision, sync mode, model state on host) applies when the stage is sharded, i.e. when
    dp * sp > 1 or when its model state lives on host. ``recompute``
    applies to the stage's own blocks (``lightning_sppo.recompute``), before FSDP.
    """
    dims.check_model(model.config)
    _agree_on_init_seed(model, device)
    sp_group = mesh.get_group("sp") if dims.sp > 1 else None
    stage = build_stage(
        model, mesh.get_local_rank("pp"), dims, device, sp_group,
        attention=attention, layers=layers, loss_chunk_tokens=loss_chunk_tokens,
    )  # fmt: skip
    apply_recompute(stage, recompute)  # the stage's own blocks, never the "sppo" schedule's shells
    if dims.dp * dims.sp > 1 or (fsdp is not None and fsdp.offload_to_host):  # host state: FSDP even alone
        apply_fsdp(stage, mesh["dp", "sp"]._flatten("dp_sp"), fsdp)
    tie_pipeline_embeddings(stage, model, dims, mesh.get_rank())  # after FSDP: the copies are its shards
    return stage


def parallelize_layers(
    model: GPT,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    attention: str = "auto",
    loss_chunk_tokens: int | None = None,
    fsdp: FSDPOptions | None = None,
) -> StageModule:
    """``model`` as the one stage of the layer order (``runtime.layer_major``), ready for ``LayerMajorEngine``.

    Subsequence attention cores, no Ulysses wrapper: the engine exchanges each chunk's q, k, v itself (heads are
    sharded over sp, K/V groups repeated when fewer than sp). The model itself is FSDP2's root (its embedding,
    final norm and head), each block a unit of its own, sharded over dp x sp, or over this process alone when its
    model state lives on host; the engine drives them per layer (``parallel.fsdp_layers``).
    """
    if dims.pp != 1:
        raise ValueError(
            f"order='layer' runs the whole model as one stage: set pipeline_parallel=1, got"
            f" pipeline_parallel={dims.pp} (or use order='subsequence' to pipeline)."
        )
    dims.check_model(model.config, repeat_kv=True)
    _agree_on_init_seed(model, device)
    apply_subsequence_attention(model, select_kernel(attention, device))
    materialize(model, device).to(device)
    if dims.dp * dims.sp > 1 or (fsdp is not None and fsdp.offload_to_host):  # host state: FSDP even alone
        apply_fsdp(model, mesh["dp", "sp"]._flatten("dp_sp"), fsdp)
    return StageModule(model, loss_chunk_tokens)


def build_stage(
    model: GPT,
    stage: int,
    dims: ParallelDims,
    device: torch.device,
    sp_group: ProcessGroup | None,
    *,
    attention: str = "auto",
    layers: list[int] | None = None,
    loss_chunk_tokens: int | None = None,
) -> StageModule:
    """Stage ``stage`` of ``model`` (cut in place) with subsequence attention and Ulysses, not sharded."""
    shell = build_stage_shell(
        model, stage, dims, device, sp_group, attention=attention, layers=layers, loss_chunk_tokens=loss_chunk_tokens
    )
    materialize(model, device)  # after the cut: only this stage's parameters are ever allocated
    return shell.to(device)


def build_stage_shell(
    model: GPT,
    stage: int,
    dims: ParallelDims,
    device: torch.device,
    sp_group: ProcessGroup | None,
    *,
    attention: str = "auto",
    layers: list[int] | None = None,
    loss_chunk_tokens: int | None = None,
) -> StageModule:
    """Stage ``stage`` of ``model`` (cut in place) with its attention cores for ``device``, left where ``model`` is.

    On a meta-device ``model`` this is the shell the "sppo" schedule's shared units run on: the stage's modules and
    cores, no memory; their weights stream in one piece at a time (``runtime.streaming``).
    """
    split_stage(model, stage, layers_per_stage(model.config, dims.pp, layers))
    apply_subsequence_attention(model, select_kernel(attention, device))
    if dims.sp > 1:
        apply_ulysses(model, sp_group)
    return StageModule(model, loss_chunk_tokens)


def _agree_on_init_seed(model: GPT, device: torch.device) -> None:
    """A model still on the meta device takes global rank 0's ``init_seed``: each rank drew its own from its global
    generator, equal only where every rank consumed that generator alike, and every stage and shard must be drawn
    from the plain model's seed (``lightning_sppo.model.init``)."""
    if not any(p.is_meta for p in model.parameters()) or not dist.is_initialized():
        return
    seed = torch.tensor([model.init_seed], dtype=torch.int64, device=device)
    dist.broadcast(seed, src=0)
    model.init_seed = int(seed.item())


def materialize(model: GPT, device: torch.device) -> GPT:
    """A model built on the meta device (no memory) gets real parameters on ``device``, initialised as the plain
    model's (``GPT.reset_parameters``: by name and ``init_seed``, whichever stage this is)."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        model.reset_parameters()
    return model
