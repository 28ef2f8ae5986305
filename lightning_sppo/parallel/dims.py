"""Parallel sizes (pp x dp x sp) and the DeviceMesh they form, checked before any communication."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_sppo.model.config import GPTConfig

__all__ = ["MESH_DIMS", "ParallelDims", "build_device_mesh"]

MESH_DIMS = ("pp", "dp", "sp")
"""Mesh dimension names, outermost first: sp innermost (inside a node), data parallel the rest."""


@dataclass(frozen=True)
class ParallelDims:
    """Pipeline, data and sequence parallel sizes; ``pp * dp * sp`` is the world size."""

    pp: int
    dp: int
    sp: int

    @classmethod
    def from_world(cls, world_size: int, pipeline_parallel: int = 1, sequence_parallel: int = 1) -> ParallelDims:
        """Data parallel is what is left of the world after pipeline and sequence parallelism."""
        for name, value in (("pipeline_parallel", pipeline_parallel), ("sequence_parallel", sequence_parallel)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}.")
        if world_size % (pipeline_parallel * sequence_parallel):
            raise ValueError(
                f"pipeline_parallel * sequence_parallel = {pipeline_parallel} * {sequence_parallel} must divide the"
                f" world size {world_size} (data parallel takes the rest); {_suggest(world_size, pipeline_parallel)}."
            )
        return cls(pipeline_parallel, world_size // (pipeline_parallel * sequence_parallel), sequence_parallel)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp

    def check_model(self, config: GPTConfig, repeat_kv: bool = False) -> None:
        """Errors for a model this layout cannot run, naming the setting and a valid value.

        ``repeat_kv``: fewer K/V groups than sp ranks are repeated to the ranks (the layer order,
        ``parallel.ulysses.kv_heads``), so n_query_groups and sequence_parallel need only divide one another."""
        if not _shards_heads(config, self.sp, repeat_kv):
            valid = [d for d in range(1, config.n_head + 1) if _shards_heads(config, d, repeat_kv)]
            rule = (
                f"n_head={config.n_head} must divide by sequence_parallel={self.sp}, and"
                f" n_query_groups={config.n_query_groups} and sequence_parallel must divide one another"
                if repeat_kv
                else f"n_head={config.n_head} and n_query_groups={config.n_query_groups} must both divide by"
                f" sequence_parallel={self.sp}"
            )
            raise ValueError(
                f"Ulysses sequence parallelism shards attention heads: {rule}. Valid sequence_parallel values for"
                f" this model: {valid}."
            )
        if config.n_layer < self.pp:
            raise ValueError(
                f"The model has n_layer={config.n_layer} layers, fewer than pipeline_parallel={self.pp} stages;"
                f" use pipeline_parallel<={config.n_layer}."
            )

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, sp_rank) of a global rank in the (pp, dp, sp) mesh."""
        return rank // (self.dp * self.sp), (rank // self.sp) % self.dp, rank % self.sp


def _shards_heads(config: GPTConfig, sp: int, repeat_kv: bool) -> bool:
    """Whether ``sp`` ranks can each take n_head / sp query heads and the K/V groups those read."""
    groups = config.n_query_groups
    if config.n_head % sp:
        return False
    return groups % sp == 0 or (repeat_kv and sp % groups == 0)


def _suggest(world_size: int, pipeline_parallel: int) -> str:
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if world_size % pipeline_parallel:
        return f"valid pipeline_parallel values: {divisors}"
    rest = world_size // pipeline_parallel
    return f"with pipeline_parallel={pipeline_parallel}, valid sequence_parallel values: {[d for d in divisors if rest % d == 0]}"


def build_device_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh:
    """The (pp, dp, sp) DeviceMesh over the default process group."""
    return init_device_mesh(device.type, (dims.pp, dims.dp, dims.sp), mesh_dim_names=MESH_DIMS)
