"""Parallel layouts the solver may pick, and where their ranks land on nodes.

Ranks are placed exactly as ``parallel/dims.py`` builds the (pp, dp, sp) mesh: sp innermost, then dp, pp
outermost, and consecutive global ranks fill a node. From that placement follow the links each message
crosses: an SP group, a pipeline boundary (stage k to k+1) and a stage's FSDP group (dp x sp) are
inside a node or cross one. Note: with pp outermost, every pipeline boundary crosses nodes once dp * sp
fills a node, which is why cross-node PP is common even for small pp.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.parallel.dims import ParallelDims
from lightning_sppo.parallel.stages import layers_per_stage

__all__ = ["Layout", "Placement", "StageSpec", "candidate_layouts", "placement", "stage_specs"]


@dataclass(frozen=True, order=True)
class Layout:
    """Sequence, pipeline and data parallel sizes; sp * pp * dp is the world size."""

    sp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.sp * self.pp * self.dp

    def __str__(self) -> str:
        return f"sp={self.sp} pp={self.pp} dp={self.dp}"


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index and layer count; the first holds the embedding, the last the head."""

    index: int
    layers: int
    first: bool
    last: bool


@dataclass(frozen=True)
class Placement:
    """Which of a layout's communication groups cross node boundaries."""

    sp_cross_node: bool
    """Some SP group spans two nodes (its all-to-all runs over the network)."""
    boundary_cross_node: tuple[bool, ...]
    """Per pipeline boundary k -> k+1 (pp - 1 entries): some pair of neighbours sits on different nodes."""
    fsdp_cross_node: bool
    """Some stage's dp x sp group (FSDP all-gather / reduce-scatter) spans nodes."""

    @cached_property
    def pp_cross_node(self) -> bool:
        return any(self.boundary_cross_node)


def placement(layout: Layout, gpus_per_node: int) -> Placement:
    """Where the layout's groups land, from the same rank -> (pp, dp, sp) map the runtime uses."""
    dims = ParallelDims(pp=layout.pp, dp=layout.dp, sp=layout.sp)
    node_of = {dims.coordinates(rank): rank // gpus_per_node for rank in range(dims.world_size)}
    sp_groups: dict[tuple[int, int], set[int]] = {}
    stage_nodes: dict[int, set[int]] = {}
    for (k, j, _), node in node_of.items():
        sp_groups.setdefault((k, j), set()).add(node)
        stage_nodes.setdefault(k, set()).add(node)
    boundaries = tuple(
        any(node_of[(k, j, s)] != node_of[(k + 1, j, s)] for j in range(layout.dp) for s in range(layout.sp))
        for k in range(layout.pp - 1)
    )
    return Placement(
        sp_cross_node=any(len(nodes) > 1 for nodes in sp_groups.values()),
        boundary_cross_node=boundaries,
        fsdp_cross_node=any(len(nodes) > 1 for nodes in stage_nodes.values()),
    )


def stage_specs(config: GPTConfig, pp: int) -> list[StageSpec]:
    """The stages as ``parallel/stages.py`` cuts the model (balanced by compute, head on the last)."""
    counts = layers_per_stage(config, pp)
    return [StageSpec(k, layers, k == 0, k == pp - 1) for k, layers in enumerate(counts)]


def candidate_layouts(config: GPTConfig, world_size: int, gpus_per_node: int) -> list[Layout]:
    """Every (sp, pp, dp) the runtime accepts.

    sp must divide the heads and K/V groups (Ulysses shards heads), and either divide the node size or be a
    multiple of it: an SP group fills part of one node or whole nodes, never straddles a node boundary. SPPO
    (section 6.1) keeps SP inside a node; its own Table 4 runs GPT-65B with SP=16 across two nodes, so the
    planner admits whole-node groups and lets the cost model decide: their all-to-all sends the share bound for
    other nodes over the network (``CostModel``), which is why they rarely win. pp must not exceed the layers.
    """
    layouts = []
    for sp in _divisors(world_size):
        whole_nodes = sp % gpus_per_node == 0
        if (gpus_per_node % sp and not whole_nodes) or config.n_head % sp or config.n_query_groups % sp:
            continue
        for pp in _divisors(world_size // sp):
            if pp <= config.n_layer:
                layouts.append(Layout(sp, pp, world_size // (sp * pp)))
    return layouts


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
