"""The Trainer strategy "sppo": the same SPPO core as the Fabric strategy, behind Lightning's Trainer hooks.

The LightningModule keeps its GPT in ``self.model`` and trains with manual optimisation: its
``training_step`` calls ``self.trainer.strategy.forward_backward(self.model, input_ids, targets)`` and
steps the optimizer (see ``lightning_sppo.training.GPTPretraining``).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sppo.errors import config_errors
from lightning_sppo.offload import OffloadCallback
from lightning_sppo.parallel.fsdp import FSDPSync
from lightning_sppo.quiet import ignore_leafspec_deprecation
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.strategy import checkpoint as ckpt
from lightning_sppo.strategy.base import SPPOStrategyBase
from lightning_sppo.strategy.checkpoint_checks import trainer_entries_problem
from lightning_sppo.strategy.safe_load import DataOnlyCheckpointIO, check_weights_only, unreadable

__all__ = ["SPPOTrainerStrategy"]


class SPPOTrainerStrategy(SPPOStrategyBase, ParallelStrategy):
    """SPPO for ``Trainer(strategy="sppo")``; takes the keyword arguments of ``SPPOConfig``. What it shares with the
    Fabric strategy lives in ``SPPOStrategyBase`` and ``SPPOCore``.

    ``offload`` may also be an ``OffloadCallback``; give the same object to ``Trainer(callbacks=...)`` so it
    logs ``offload/*`` after every batch.

    Registered as "sppo" in the Trainer's strategy registry on ``import lightning_sppo``. On several devices
    ``trainer.fit`` checkpoints are folders (torch.distributed.checkpoint) keyed by plain GPT names.
    """

    strategy_name = "sppo"

    def __init__(
        self,
        num_subsequences: int | Literal["auto"] = "auto",
        partition: str | None = None,
        offload: str | OffloadCallback = "none",
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
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._build_core(locals())

    _launcher_class = _SubprocessScriptLauncher

    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank] if self.parallel_devices else torch.device("cpu")

    @override
    def setup(self, trainer: Any) -> None:
        """Cut and shard the LightningModule's ``model`` into this rank's stage, then build the optimizers."""
        ignore_leafspec_deprecation()  # Lightning's fit loop (after this) would print torch's deprecation per rank
        self.accelerator.setup(trainer)
        pl_module = self.lightning_module
        if not isinstance(getattr(pl_module, "model", None), Module):
            raise TypeError(
                f"SPPOTrainerStrategy trains the GPT in `{type(pl_module).__name__}.model`; assign a"
                " lightning_sppo.GPT to self.model in __init__ or configure_model()."
            )
        if not isinstance(pl_module.model, StageModule):  # not already prepared (a second fit)
            pl_module.model = self.core.setup_model(pl_module.model, self.root_device, self.precision_plugin.precision)
        if not self.is_distributed:
            pl_module.to(self.root_device)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.core.host_state:  # host state: the step is on CPU
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Everything to the device but a batch's ``document_ids``: the strategy derives the documents' structure on
        the host (a copy back from the GPU would wait for the device every step). Here rather than in the
        LightningModule, whose ``transfer_batch_to_device`` Lightning warns about when a DataModule is passed."""
        if isinstance(batch, dict) and "document_ids" in batch:
            rest = super().batch_to_device(
                {k: v for k, v in batch.items() if k != "document_ids"}, device, dataloader_idx
            )
            return rest | {"document_ids": batch["document_ids"]}
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def model_to_device(self) -> None:
        if not self.is_distributed:
            self.lightning_module.to(self.root_device)

    def forward_backward(
        self, model: Module, input_ids: Tensor, targets: Tensor, document_ids: Tensor | None = None
    ) -> Tensor:
        """Forward and backward of every subsequence of the batch; returns the detached mean loss.
        ``document_ids`` [B, S]: packed documents, each attended and positioned alone (see the Fabric strategy)."""
        return self.core.forward_backward(
            model, input_ids, targets, lambda loss: self.backward(loss, None), self.precision_plugin.forward_context,
            document_ids,
        )  # fmt: skip

    def evaluate(
        self, model: Module, input_ids: Tensor, targets: Tensor, document_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Forward-only pass of every subsequence: ``(sum of the token losses, valid targets)`` over the global
        batch (all data-parallel ranks), fp32 and the same on every rank. Their ratio is the mean loss."""
        return self.core.evaluate(model, input_ids, targets, self.precision_plugin.forward_context, document_ids)

    def clip_gradients(
        self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = True
    ) -> Tensor:
        """Clip by the norm of all gradients of the model, across every stage and shard; returns the norm."""
        self.precision_plugin.unscale_gradients(optimizer)
        return self.core.clip_gradients(self.lightning_module.parameters(), max_norm, norm_type, error_if_nonfinite)

    # -- collectives ------------------------------------------------------------------------------

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # Lightning's default would be TorchCheckpointIO: read data only instead (a wrapping IO, e.g. async, keeps the
        # inner IO it was given; its setter sets only a missing one).
        if self._checkpoint_io is None:
            self._checkpoint_io = DataOnlyCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = DataOnlyCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage (and its shards) must exist before weights are loaded into it

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self.is_distributed  # on several devices load_checkpoint restores them

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self.is_distributed else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {} if self.is_distributed else super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        path = Path(self.broadcast(str(filepath)))
        if not self.is_distributed:
            if checkpoint.get("optimizer_states"):  # names for a resume on several devices (states by name)
                model = self._plain_model()
                names = [ckpt.optimizer_parameter_names(model, opt) for opt in self.optimizers]
                checkpoint = checkpoint | {ckpt.PARAMETER_NAMES: names}
            if self.is_global_zero:
                ckpt.atomic_torch_save(checkpoint, path)
            return
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        optimizers = {f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)}
        stage = self.lightning_module.model
        ckpt.save_stage(path, "model", stage, optimizers, rest, self.config.save_distributed_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        check_weights_only(weights_only)  # a checkpoint is data (safe_load): every read below goes through it
        path = Path(self.broadcast(str(checkpoint_path)))
        return _lightning_entries_checked(path, self._load(path, weights_only))

    def _load(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        if not self.is_distributed:
            if path.is_dir():  # saved on several devices (or with model_state=host): a folder
                with config_errors():
                    return self._from_several_devices(path, ckpt.read_on_one_process(path))
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
            if isinstance(checkpoint, dict) and "state_dict" not in checkpoint:  # the single file of several devices
                with config_errors():
                    return self._from_several_devices(path, checkpoint)
            return checkpoint
        optimizers = {f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)}
        with config_errors():  # a checkpoint of another model
            return ckpt.load_stage(path, "model", self.lightning_module.model, optimizers)

    def _plain_model(self) -> Module | None:
        model = getattr(self.lightning_module, "model", None)
        return model.model if isinstance(model, StageModule) else model

    def _from_several_devices(self, path: Path, saved: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint of several devices (plain GPT names; optimizer states by name) in Lightning's format of one
        device: the module's ``state_dict`` and ``optimizer_states`` keyed by index, for Lightning to restore."""
        model = saved.get("model")
        if not isinstance(model, dict):
            raise ckpt.CheckpointMismatchError(
                f"The checkpoint {path} holds no 'model' entry, so it has no model to load."
            )
        keys = [f"optimizer_{i}" for i in range(len(self.optimizers))]
        rest = {k: v for k, v in saved.items() if k != "model" and k not in keys}
        states = []
        for key, optimizer in zip(keys, self.optimizers, strict=True):
            if not isinstance(saved.get(key), dict):
                raise ckpt.CheckpointMismatchError(
                    f"The checkpoint {path} holds no {key!r} state (saved without its optimizer?), so training cannot"
                    " resume from it; start a new run from its weights with --model.init_from."
                )
            states.append(ckpt.indexed_optimizer_state(path, key, saved[key], optimizer, self._plain_model()))
        return rest | {"state_dict": {f"model.{k}": v for k, v in model.items()}, "optimizer_states": states}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self.is_distributed:
            model = self._plain_model()
            state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
            where = Path(str(self.lightning_module.trainer.ckpt_path))
            ckpt.check_whole_model(where, state, model, strict, "state_dict", checkpoint.get(ckpt.MODEL_CONFIG))
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            ckpt.remove_path(Path(filepath))

    @override
    def teardown(self) -> None:
        self.core.teardown()
        module = self.lightning_module
        # A set-up that failed before the stage was allocated leaves the model on the meta device; Lightning's
        # teardown would move it to the CPU and replace the set-up error with "Cannot copy out of meta tensor".
        unallocated = module is not None and any(p.is_meta for p in module.parameters())
        if unallocated:
            self._lightning_module = None
        try:
            super().teardown()
        finally:
            if unallocated:
                self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("sppo", cls, description="Sequence pipeline parallel offloading", override=True)


def _lightning_entries_checked(path: Path, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` once Lightning's entries in it are of Lightning's types: else one line naming the file (a
    damaged or forged file would stop Lightning's restore with a traceback)."""
    if (problem := trainer_entries_problem(checkpoint)) is not None:
        raise unreadable(str(path), problem)
    return checkpoint


SPPOTrainerStrategy.register_strategies(StrategyRegistry)
