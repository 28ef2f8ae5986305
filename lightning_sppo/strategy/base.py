"""What the Fabric and the Trainer strategies share on Lightning's side, over one ``SPPOCore``: the settings, the
processes (world ranks, launcher, process group and mesh), the data shards and the collectives both frameworks
name alike. Each strategy keeps what its own base class needs: devices, precision, the step's framework hooks
(backward, precision context), clipping and checkpoints.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_sppo.errors import config_errors
from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.core import SPPOCore, broadcast_object

__all__ = ["SPPOStrategyBase"]


class SPPOStrategyBase:
    """Mixed in before the framework's strategy class, whose ``parallel_devices``, ``cluster_environment``,
    ``global_rank``, ``local_rank``, ``node_rank`` and ``root_device`` it uses."""

    core: SPPOCore
    _launcher_class: type
    """The framework's script launcher: it starts the other processes unless the cluster does."""

    def _build_core(self, arguments: dict[str, Any]) -> None:
        """The core from the constructor's keyword arguments (its ``locals()``: one per ``SPPOConfig`` field, where
        ``offload`` may be a callback), and the process group's ``process_group_backend`` and ``timeout``."""
        settings = {field.name: arguments[field.name] for field in fields(SPPOConfig) if field.name != "offload"}
        with config_errors():  # our settings checks: one-line errors on the command line
            self.core = SPPOCore.from_settings(arguments["offload"], **settings)
        self._process_group_backend, self._timeout = arguments["process_group_backend"], arguments["timeout"]
        self._num_nodes = 1

    @property
    def config(self) -> SPPOConfig:
        return self.core.config

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self) -> bool:
        """Several processes, or one whose model state lives on host (a sharded stage in a process group of one)."""
        return self.num_processes * self.num_nodes > 1 or self.core.host_state

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Shard data over dp only: the pp and sp ranks of one dp group must see the same batch."""
        return self.core.sampler_kwargs()

    def set_world_ranks(self) -> None:
        """Global rank and world size into the cluster environment, and the rank for rank-zero-only logging.
        The frameworks' connectors call it before launch (Fabric's as ``_set_world_ranks``); so does the set-up."""
        environment = self.cluster_environment
        if environment is not None:
            environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    _set_world_ranks = set_world_ranks

    @override
    def _configure_launcher(self) -> None:
        """Check the world size before any process starts, then start the processes with the framework's launcher
        unless the cluster does."""
        world_size = self.num_processes * self.num_nodes
        with config_errors():  # the layout against the world size
            self.core.set_world_size(world_size, self.num_processes)
        if world_size > 1 and not self.cluster_environment.creates_processes_externally:
            self._launcher = self._launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        """World ranks, then on several processes the process group and the device mesh."""
        super().setup_environment()
        self.set_world_ranks()
        if self.is_distributed:
            self.core.start_processes(
                self.cluster_environment, self.root_device, self.global_rank, self.num_processes,
                self._process_group_backend, self._timeout,
            )  # fmt: skip

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)
