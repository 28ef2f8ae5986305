"""Parallel sizes (pp x dp x sp) and the DeviceMesh they form, checked before any communication."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_sppo.model.config import GPTConfig

__all__ = ["MESH_DIMS", "ParallelDims", "build_device_mesh", "valid_pipeline_parallel", "valid_sequence_parallel"]

MESH_DIMS = ("pp", "dp", "sp")
"""Mesh dimension names, outermost first: sp innermost (inside a node), data parallel the rest."""


@dataclass(frozen=True)
class ParallelDims:
    """Pipeline, data and sequence parallel sizes; ``pp * dp * sp`` is the world size."""

    pp: int
    dp: int
    sp: int

    @classmethod
    def from_world(
        cls, world_size: int, pipeline_parallel: int = 1, sequence_parallel: int = 1, config: GPTConfig | None = None
    ) -> ParallelDims:
        """Data parallel is what is left of the world after pipeline and sequence parallelism. With ``config`` (the
        model, where it is known already) the sizes are checked against it too (``check_model``), and the sizes
        an error suggests fit both the world and the model."""
        for name, value in (("pipeline_parallel", pipeline_parallel), ("sequence_parallel", sequence_parallel)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}.")
        if world_size % (pipeline_parallel * sequence_parallel):
            raise ValueError(
                f"pipeline_parallel * sequence_parallel = {pipeline_parallel} * {sequence_parallel} must divide the"
                f" world size {world_size} (data parallel takes the rest);"
                f" {_suggest(world_size, pipeline_parallel, sequence_parallel, config)}."
            )
        dims = cls(pipeline_parallel, world_size // (pipeline_parallel * sequence_parallel), sequence_parallel)
        if config is not None:
            dims.check_model(config)
        return dims

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp

    def check_model(self, config: GPTConfig, repeat_kv: bool = False) -> None:
        """Errors for a model this layout cannot run, naming the setting and values that fit the model and the
        world size both (a value that fits only one fails at the next run).

        ``repeat_kv``: fewer K/V groups than sp ranks are repeated to the ranks (the layer order,
        ``parallel.ulysses.kv_heads``), so n_query_groups and sequence_parallel need only divide one another."""
        if not _shards_heads(config, self.sp, repeat_kv):
            valid = valid_sequence_parallel(self.world_size, self.pp, config, repeat_kv)
            rule = (
                f"n_head={config.n_head} must divide by sequence_parallel={self.sp}, and"
                f" n_query_groups={config.n_query_groups} and sequence_parallel must divide one another"
                if repeat_kv
                else f"n_head={config.n_head} and n_query_groups={config.n_query_groups} must both divide by"
                f" sequence_parallel={self.sp}"
            )
            raise ValueError(
                f"Ulysses sequence parallelism shards attention heads: {rule}. Valid sequence_parallel values for"
                f" this model on {self.world_size} processes with pipeline_parallel={self.pp}: {valid}."
            )
        if config.n_layer < self.pp:
            valid = valid_pipeline_parallel(self.world_size, self.sp, config)
            raise ValueError(
                f"The model has n_layer={config.n_layer} layers, fewer than pipeline_parallel={self.pp} stages;"
                f" valid pipeline_parallel values for this model on {self.world_size} processes with"
                f" sequence_parallel={self.sp}: {valid}."
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


def valid_pipeline_parallel(world_size: int, sequence_parallel: int, config: GPTConfig | None = None) -> list[int]:
    """The pipeline_parallel values that run on ``world_size`` processes beside ``sequence_parallel`` (their product
    divides the world) and, with ``config``, on that model (no more stages than layers). 1 is among them whenever
    ``sequence_parallel`` divides the world."""
    return [
        d
        for d in _divisors(world_size)
        if world_size % (d * sequence_parallel) == 0 and (config is None or d <= config.n_layer)
    ]


def valid_sequence_parallel(
    world_size: int, pipeline_parallel: int, config: GPTConfig | None = None, repeat_kv: bool = False
) -> list[int]:
    """The sequence_parallel values that run on ``world_size`` processes beside ``pipeline_parallel`` and, with
    ``config``, on that model (Ulysses shards the heads: ``_shards_heads``)."""
    return [
        d
        for d in _divisors(world_size)
        if world_size % (d * pipeline_parallel) == 0 and (config is None or _shards_heads(config, d, repeat_kv))
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _suggest(world_size: int, pp: int, sp: int, config: GPTConfig | None) -> str:
    """The sizes that would run: another pipeline_parallel beside the given sequence_parallel, another
    sequence_parallel beside the given pipeline_parallel, or (neither fits) pipeline_parallel beside 1."""
    if config is None:  # the model is not known yet: say what else each value must fit
        layers, heads = " (at most the model's n_layer)", " (dividing the model's n_head and n_query_groups)"
    else:
        layers = f" (the model has {config.n_layer} layers)"
        heads = f" (n_head={config.n_head}, n_query_groups={config.n_query_groups})"
    options = []
    if pp_values := valid_pipeline_parallel(world_size, sp, config):
        options.append(f"with sequence_parallel={sp}, valid pipeline_parallel values{layers}: {pp_values}")
    if sp_values := valid_sequence_parallel(world_size, pp, config):
        options.append(f"with pipeline_parallel={pp}, valid sequence_parallel values{heads}: {sp_values}")
    if not options:
        values = valid_pipeline_parallel(world_size, 1, config)
        options.append(f"with sequence_parallel=1, valid pipeline_parallel values{layers}: {values}")
    return "; or ".join(options)


def build_device_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh:
    """The (pp, dp, sp) DeviceMesh over the default process group."""
    return init_device_mesh(device.type, (dims.pp, dims.dp, dims.sp), mesh_dim_names=MESH_DIMS)
