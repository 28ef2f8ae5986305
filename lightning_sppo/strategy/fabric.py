"""The Fabric strategy "sppo": owns processes, devices and precision; delegates the step to the runtime.

Usage::

    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=4), accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(model, optimizer)
    loss = fabric.strategy.forward_backward(model, input_ids, targets)
    optimizer.step()

On several devices the same code runs on every rank (``fabric.launch()``, torchrun or SLURM):
``pipeline_parallel`` and ``sequence_parallel`` set the layout (or, left None, the planner does), data
parallel is the rest of the world.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _Stateful, _validate_keys_for_strict_loading
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _all_gather_ddp_if_available,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.types import _PATH
from lightning.fabric.wrappers import _FabricModule
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sppo.errors import SPPOConfigError, config_errors
from lightning_sppo.model import GPTConfig
from lightning_sppo.offload import OffloadCallback
from lightning_sppo.parallel import ParallelDims
from lightning_sppo.parallel.fsdp import FSDPSync
from lightning_sppo.runtime import LayerMajorEngine, SubsequenceEngine
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.strategy import checkpoint
from lightning_sppo.strategy.base import SPPOStrategyBase
from lightning_sppo.strategy.safe_load import DataOnlyCheckpointIO, check_weights_only, load_file

__all__ = ["SPPOStrategy"]

OffloadName = Literal["none", "full", "adaptive"]
PartitionName = Literal["length", "flops", "adaptive"]


class SPPOStrategy(SPPOStrategyBase, SingleDeviceStrategy):
    """Sequence pipeline parallel offloading (SPPO) for long-sequence training.

    Subclasses Fabric's single-device strategy so that ``devices=1`` needs no ``fabric.launch()``; with
    more devices it starts processes, builds the (pp, dp, sp) DeviceMesh and pipelines like a parallel one
    (``SPPOStrategyBase``, shared with the Trainer's strategy).

    Takes the settings of ``SPPOConfig`` as keyword arguments, each documented there; ``offload`` may also be an
    ``OffloadCallback`` (pass it to Fabric's callbacks as well to log its per-step numbers with
    ``fabric.call("on_offload_step", fabric=fabric)``). Beyond them:

    Args:
        process_group_backend: ``"nccl"``, ``"gloo"``; default by device.
        timeout: process group timeout.
        device: the device when the strategy is used without Fabric's ``accelerator``/``devices``.
    """

    def __init__(
        self,
        num_subsequences: int | Literal["auto"] = "auto",
        partition: PartitionName | None = None,
        offload: OffloadName | OffloadCallback = "none",
        attention: str = "auto",
        kv_grad_dtype: str = "fp32",
        recompute: str = "none",
        kv_device_tokens: int | None = None,
        kv_chunk_tokens: int = 16384,
        model_state: str = "device",
        order: str = "subsequence",
        loss_chunk_tokens: int | None = None,
        granularity: int = 1,
        pipeline_parallel: int | None = 1,
        sequence_parallel: int | None = 1,
        fsdp_sync: FSDPSync = "step",
        planner_profile: str | None = None,
        num_microbatches: int = 1,
        schedule: str = "seq1f1b",
        layers_per_stage: list[int] | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        device: str | torch.device = "cpu",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        # Strategy.__init__, not SingleDeviceStrategy's: ranks and world size come from the cluster environment.
        super(SingleDeviceStrategy, self).__init__(
            accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision
        )
        self._build_core(locals())
        self._root_device = torch.device(device)
        self._parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment

    _launcher_class = _SubprocessScriptLauncher

    # -- layout -----------------------------------------------------------------------------------

    @property
    def engine(self) -> SubsequenceEngine | LayerMajorEngine:
        """The one-device engine (``core.last_plan`` says how the latest step was cut)."""
        return self.core.engine

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices Fabric's ``accelerator``/``devices`` selected (Fabric's connector fills this in)."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._parallel_devices = devices

    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.cluster_environment else 0

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self.cluster_environment else 0

    @property
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self.cluster_environment else 0

    @property
    def world_size(self) -> int:
        return self.cluster_environment.world_size() if self.cluster_environment else 1

    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def dims(self) -> ParallelDims:
        """(pp, dp, sp) sizes; data parallel is what pipeline and sequence parallelism leave of the world."""
        dims = self.core.dims or self.core.set_world_size(self.num_processes * self.num_nodes, self.num_processes)
        if dims is None:
            raise RuntimeError(
                "pipeline_parallel / sequence_parallel are unset: the planner chooses them in fabric.setup(model)."
            )
        return dims

    @property
    def device_mesh(self) -> DeviceMesh:
        if self.core.mesh is None:
            raise RuntimeError("The device mesh exists once the processes have started (after fabric.launch()).")
        return self.core.mesh

    @property
    @override
    def root_device(self) -> torch.device:
        return self._parallel_devices[self.local_rank] if self._parallel_devices else self._root_device

    # -- model and optimizers ---------------------------------------------------------------------

    @override
    def setup_module(self, module: Module) -> Module:
        return self.core.setup_model(module, self.root_device, self.precision.precision)

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None):
        """Optimizers built on the plain model are re-pointed at the parameters this stage kept (sharded)."""
        names: dict[int, list[str]] = {}  # a tied weight has two names; a pipeline stage may keep either
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        module = self.setup_module(module)
        if isinstance(module, StageModule):
            kept = dict(module.model.named_parameters())
            for optimizer in optimizers:
                _rebind_optimizer(optimizer, names, kept)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def module_to_device(self, module: Module) -> None:
        # A stage is placed (and sharded) by setup_module, and so is a model still on the meta device.
        if not isinstance(module, StageModule) and not any(p.is_meta for p in module.parameters()):
            module.to(self.root_device)

    # -- the training step ------------------------------------------------------------------------

    def forward_backward(
        self, model: Module, input_ids: Tensor, targets: Tensor, document_ids: Tensor | None = None
    ) -> Tensor:
        """Forward and backward of every subsequence of the batch; returns the detached mean loss.

        Gradients are left in the parameters' ``.grad`` (accumulated, as with ``loss.backward()``); call
        ``optimizer.step()`` next. ``targets`` has the shape of ``input_ids``; -100 is ignored. On several
        ranks, every pp and sp rank of a data-parallel group passes the same batch. ``document_ids`` [B, S]
        (integer, non-decreasing along each row) marks packed documents: each token attends only to its own
        document and positions restart per document, as if every document were trained alone.
        """
        module = model._forward_module if isinstance(model, _FabricModule) else model
        return self.core.forward_backward(
            module, input_ids, targets, lambda loss: self.backward(loss, module), self.precision.forward_context,
            document_ids,
        )  # fmt: skip

    def evaluate(
        self, model: Module, input_ids: Tensor, targets: Tensor, document_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Forward-only pass of every subsequence: ``(sum of the token losses, valid targets)`` over the global
        batch (all data-parallel ranks), fp32 and the same on every rank. Their ratio is the mean loss.

        No gradients and no saved activations: a sequence is evaluated in the memory of one subsequence.
        ``document_ids`` as in ``forward_backward``.
        """
        module = model._forward_module if isinstance(model, _FabricModule) else model
        return self.core.evaluate(module, input_ids, targets, self.precision.forward_context, document_ids)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm of all gradients of the model, across every stage and shard."""
        self.precision.unscale_gradients(optimizer)
        return self.core.clip_gradients(module.parameters(), max_norm, norm_type, error_if_nonfinite)

    # -- collectives ------------------------------------------------------------------------------

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:  # Lightning's default would be TorchCheckpointIO: read data only instead
            self._checkpoint_io = DataOnlyCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @override
    def save_checkpoint(
        self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None, filter: Any = None
    ) -> None:
        if not self.is_distributed:
            if storage_options is not None:
                return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            if self.is_global_zero:
                converted = _optimizers_by_name(state, self._convert_stateful_objects_in_state(state, filter or {}))
                checkpoint.atomic_torch_save(converted | _model_config(state), Path(path))
            return None
        if storage_options is not None or filter is not None:
            raise TypeError("SPPOStrategy.save_checkpoint takes no storage_options or filter on several devices.")
        checkpoint.save_checkpoint(Path(self.broadcast(str(path))), state, self.config.save_distributed_checkpoint)

    @override
    def load_checkpoint(
        self, path: _PATH, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        check_weights_only(weights_only)  # a checkpoint is data (safe_load): every read below goes through it
        if isinstance(state, Module) and _called_by_fabric_load():
            raise SPPOConfigError(
                f"fabric.load({str(path)!r}, module): Fabric loads into a dict of the objects saved, e.g."
                " fabric.load(path, {'model': module, 'optimizer': optimizer}); fabric.load_raw(path, module) loads the"
                " module's weights alone."
            )
        if not self.is_distributed:
            if isinstance(state, Module):  # fabric.load_raw(path, module): the module's entry of any checkpoint
                with config_errors():
                    return self._load_module_alone(Path(path), state, strict, weights_only)
            if isinstance(state, dict) and state:  # a folder, and optimizer states saved by name (any layout)
                with config_errors():
                    return self._load_one_device(Path(path), state, strict, weights_only)
            if not state and Path(path).is_dir():  # the whole checkpoint, as Fabric returns a file's
                return checkpoint.read_on_one_process(Path(path))
            _check_one_device_load(Path(path), state, strict)
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not any(isinstance(v, StageModule) for v in state.values()):
            raise ValueError(
                "On several devices SPPOStrategy loads into a state dict holding the model, e.g."
                " fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        with config_errors():  # a checkpoint of another model
            return checkpoint.load_checkpoint(Path(self.broadcast(str(path))), state, strict=strict)

    def _load_one_device(
        self, path: Path, state: dict[str, Any], strict: bool, weights_only: bool | None
    ) -> dict[str, Any]:
        """Fabric's load of ``state`` on one device, from a checkpoint of any layout: a folder of several devices is
        read here, and optimizer states saved by parameter name are matched to this optimizer's parameters by name."""
        if path.is_dir():
            saved = checkpoint.read_on_one_process(path)
        else:
            saved = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        model = _plain_gpt(state)
        keys = [k for k, v in state.items() if isinstance(v, Module)]
        if model is not None and len(keys) == 1 and isinstance(saved, dict) and keys[0] in saved:
            config = saved.get(checkpoint.MODEL_CONFIG)
            checkpoint.check_whole_model(path, saved[keys[0]], model, strict, keys[0], config)
        for key, optimizer in state.items():
            if isinstance(optimizer, Optimizer) and model is not None and _by_name(saved.get(key)):
                saved[key] = checkpoint.indexed_optimizer_state(path, key, saved[key], optimizer, model)
        _validate_keys_for_strict_loading(state.keys(), saved.keys(), strict=strict)
        for name, obj in state.copy().items():  # as Fabric's own load
            if name not in saved:
                continue
            if isinstance(obj, Module):
                self.load_module_state_dict(module=obj, state_dict=saved.pop(name), strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(saved.pop(name))
            else:
                state[name] = saved.pop(name)
        return saved

    def _load_module_alone(self, path: Path, module: Module, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """``fabric.load_raw(path, module)`` on one device. Lightning's convention is a file of the module's state dict
        alone; a checkpoint of this strategy (a folder of several devices, or a file) holds it under the name it was
        saved with, found here by its keys. Returns the checkpoint's other entries."""
        if path.is_dir():
            saved = checkpoint.read_on_one_process(path)
        else:
            saved = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        key, weights = _module_entry(path, saved, module)
        if key is not None:
            checkpoint.check_whole_model(path, weights, module, strict, key, saved.get(checkpoint.MODEL_CONFIG))
        self.load_module_state_dict(module=module, state_dict=weights, strict=strict)
        return {} if key is None else {k: v for k, v in saved.items() if k != key}

    @override
    def teardown(self) -> None:
        self.core.teardown()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("sppo", cls, description="Sequence pipeline parallel offloading", override=True)


def _model_config(state: dict[str, Any]) -> dict[str, Any]:
    """``{"model_config": ...}`` for the one GPT of a checkpoint state (as the several-device formats record it):
    the architecture travels with the weights, so ``sppo-export`` and a load's errors need nothing else."""
    configs = [v.config.to_dict() for v in state.values() if isinstance(getattr(v, "config", None), GPTConfig)]
    return {checkpoint.MODEL_CONFIG: configs[0]} if len(configs) == 1 else {}


def _plain_gpt(state: dict[str, Any]) -> Module | None:
    """The one GPT of a checkpoint state (inside a stage, if it is one), or None."""
    models = [v.model if isinstance(v, StageModule) else v for v in state.values() if isinstance(v, Module)]
    models = [m for m in models if isinstance(getattr(m, "config", None), GPTConfig)]
    return models[0] if len(models) == 1 else None


def _optimizers_by_name(state: dict[str, Any], converted: dict[str, Any]) -> dict[str, Any]:
    """One device's optimizer states keyed by the GPT's parameter names, as several devices save them: a load on
    any layout finds each parameter's state by name (torch's ``load_state_dict`` matches by position either way)."""
    model = _plain_gpt(state)
    if model is None:
        return converted
    for key, optimizer in state.items():
        entry = converted.get(key)
        if not isinstance(optimizer, Optimizer) or not isinstance(entry, dict) or "param_groups" not in entry:
            continue
        names = checkpoint.optimizer_parameter_names(model, optimizer)
        if all(names) and len(set(names)) == len(names):
            converted[key] = checkpoint.named_optimizer_state(entry, names)
    return converted


def _by_name(entry: Any) -> bool:
    """Whether a saved optimizer state is keyed by parameter name (or, from a folder, has no parameter lists)."""
    if not isinstance(entry, dict) or "state" not in entry:
        return False
    groups = entry.get("param_groups", [])
    keys = [*entry["state"], *(p for g in groups for p in g.get("params", []))]
    return any(isinstance(k, str) for k in keys) or any("params" not in g for g in groups)


def _called_by_fabric_load() -> bool:
    """Whether ``load_checkpoint`` was called by ``Fabric.load``, which takes a dict of objects only: given a bare
    module it hands it on, and after the load fails in its own loop over the dict (Lightning 2.6: "'GPT' object has
    no attribute 'keys'"). ``Fabric.load_raw`` makes the same call with a module, and is the one that takes one."""
    caller = sys._getframe(2)  # 0: this function, 1: load_checkpoint, 2: its caller
    return caller.f_code.co_name == "load" and caller.f_globals.get("__name__") == "lightning.fabric.fabric"


def _module_entry(path: Path, saved: Any, module: Module) -> tuple[str | None, dict[str, Any]]:
    """(None, the state dict) for a file that is one; else the one entry of ``saved`` that is a state dict sharing
    keys with ``module``'s; else one line saying how to load the checkpoint."""
    if not isinstance(saved, dict):
        raise ValueError(
            f"fabric.load({str(path)!r}, module): the file holds a {type(saved).__name__}, not a state dict."
        )
    if saved and all(isinstance(value, Tensor) for value in saved.values()):
        return None, saved
    keys = set(module.state_dict())
    entries = [
        name
        for name, value in saved.items()
        if isinstance(value, dict)
        and value
        and all(isinstance(t, Tensor) for t in value.values())
        and keys & set(value)
    ]
    if len(entries) != 1:
        found = f"entries {sorted(saved)}" if entries == [] else f"several model states {sorted(entries)}"
        raise ValueError(
            f"fabric.load({str(path)!r}, module): the checkpoint holds {found}, so the module's state cannot be told;"
            " load it by the name it was saved with, e.g. fabric.load(path, {'model': module})."
        )
    return entries[0], saved[entries[0]]


def _check_one_device_load(path: Path, state: Any, strict: bool) -> None:
    """A checkpoint of another architecture: one line (``CheckpointMismatchError``) instead of torch's list."""
    models = {k: v for k, v in state.items() if isinstance(getattr(v, "config", None), GPTConfig)} if isinstance(
        state, dict) else {}  # fmt: skip
    if len(models) != 1 or not checkpoint.is_complete(path) or path.is_dir():
        return
    saved = load_file(path, mmap=True)  # only the keys' shapes are read
    ((key, model),) = models.items()
    if isinstance(saved, dict) and key in saved:
        checkpoint.check_whole_model(path, saved[key], model, strict, key, saved.get(checkpoint.MODEL_CONFIG))


def _rebind_optimizer(optimizer: Optimizer, names: dict[int, list[str]], kept: dict[str, torch.nn.Parameter]) -> None:
    if optimizer.state:
        raise RuntimeError(
            "The optimizer already has state; create it before its first step, or after fabric.setup_module()."
        )
    for group in optimizer.param_groups:
        owned = ([kept[n] for n in names.get(id(p), []) if n in kept][:1] for p in group["params"])
        group["params"] = [param for found in owned for param in found]


SPPOStrategy.register_strategies(STRATEGY_REGISTRY)
