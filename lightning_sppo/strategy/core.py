"""What the Fabric and the Trainer strategies share: the layout, model preparation and the training step.

The strategies own processes, devices, precision and the framework's hooks; this class owns everything
SPPO-specific, so both frameworks train exactly the same way. A step: check the batch, make its plan
(``lightning_sppo.step_plan``), hand the plan to the engine (one device) or the pipeline runtime.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_sppo.attention import KV_GRAD_DTYPES, apply_subsequence_attention, select_kernel
from lightning_sppo.errors import SPPOConfigError, config_errors
from lightning_sppo.model import GPT, GPTConfig
from lightning_sppo.offload import OffloadCallback, Offloader
from lightning_sppo.parallel import ParallelDims, build_device_mesh, layers_per_stage, parallelize_gpt
from lightning_sppo.parallel.fsdp import FSDPOptions
from lightning_sppo.parallel.parallelize import build_stage_shell, materialize, parallelize_layers
from lightning_sppo.parallel.tied import tied_gradients_summed
from lightning_sppo.partition import register_partition_policy
from lightning_sppo.recompute import apply_recompute
from lightning_sppo.runtime import LayerMajorEngine, SubsequenceEngine
from lightning_sppo.runtime.engine import check_batch
from lightning_sppo.runtime.hooks import SubsequenceHooks
from lightning_sppo.runtime.layer_major import LayerGroups
from lightning_sppo.runtime.links import pipeline_links
from lightning_sppo.runtime.pipeline import PipelineGroups, PipelineRuntime
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.step_plan import StepPlan, StepPlans, StepSettings
from lightning_sppo.strategy.autoplan import AutoPlanner
from lightning_sppo.strategy.clipping import clip_grad_norm_
from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.state_gather import object_group

__all__ = ["SPPOCore", "broadcast_object"]


class SPPOCore:
    def __init__(self, config: SPPOConfig, offload: OffloadCallback | None = None) -> None:
        self.config = config
        # The callback owns the offload policy; the strategy builds its hooks once the device is known.
        self.offload = offload if offload is not None else OffloadCallback(config.offload)
        self.hooks: SubsequenceHooks | None = None
        self.engine = _one_device_engine(config)
        self.dims: ParallelDims | None = None
        self.mesh: DeviceMesh | None = None
        self.runtime: PipelineRuntime | None = None
        self.global_rank = 0
        self.world_size = 1
        self.fsdp = FSDPOptions(sync=config.fsdp_sync, offload_to_host=config.model_state == "host")
        """How ``parallelize_gpt`` shards a stage: mixed precision (``set_precision``) and ``fsdp_sync``."""
        self.planner = AutoPlanner(config)
        self.plans: StepPlans | None = None
        """Each batch's plan, made on rank 0 for every rank (built by ``prepare_model``)."""
        self.last_plan: StepPlan | None = None
        """The plan of the latest step (what it ran: its lengths, micro-batches, documents)."""
        self.device = torch.device("cpu")
        """The compute device, set by ``prepare_model``: where collectives of the step run."""
        self._own_group = False
        """Whether this core started the process group (one process with its model state on host)."""

    @classmethod
    def from_settings(cls, offload: str | OffloadCallback, **settings: Any) -> SPPOCore:
        """The strategies' keyword arguments: ``offload`` is a policy name or the callback that owns one."""
        callback = offload if isinstance(offload, OffloadCallback) else None
        return cls(SPPOConfig(offload=callback.offload if callback else offload, **settings), callback)

    # -- layout -----------------------------------------------------------------------------------

    def set_world_size(self, world_size: int, local_processes: int = 1) -> ParallelDims | None:
        """Fix (pp, dp, sp) for ``world_size`` processes; raises before any process starts if they don't fit.

        With ``pipeline_parallel`` or ``sequence_parallel`` None (and several processes), ``setup_layout`` has
        the planner choose when the model is set up; until then ``dims`` is None.
        """
        self.world_size, self.planner.gpus_per_node = world_size, local_processes
        pp, sp = self.config.pipeline_parallel, self.config.sequence_parallel
        dims = ParallelDims.from_world(world_size, pp or 1, sp or 1)  # what is given must divide the world
        self.dims = None if self.config.plans_layout and world_size > 1 else dims
        return self.dims

    def set_precision(self, precision: str) -> None:
        """The strategy's precision setting. Under "bf16-mixed", sharded stages use FSDP2 mixed precision."""
        self.planner.precision = str(precision)
        param_dtype = torch.bfloat16 if self.planner.precision == "bf16-mixed" else None
        self.fsdp = replace(self.fsdp, param_dtype=param_dtype)

    def setup_layout(self, model: nn.Module, device: torch.device) -> None:
        """Before ``prepare_model``: the planner's pipeline_parallel / sequence_parallel where they are unset."""
        if self.dims is None and self.world_size == 1:
            self.dims = ParallelDims(1, 1, 1)
        if self.dims is not None:
            return
        pp, sp = broadcast_object(self.planner.layout(model, device, self.world_size))  # rank 0's choice for all
        self.dims = ParallelDims.from_world(self.world_size, pp, sp)
        self.mesh = build_device_mesh(self.dims, device)

    @property
    def distributed(self) -> bool:
        """Whether the model runs as (sharded) pipeline stages: on several processes, or with its state on host."""
        return self.dims is not None and (self.dims.world_size > 1 or self.host_state)

    @property
    def layer_order(self) -> bool:
        """``order="layer"``: each layer runs over the whole sequence before the next (``runtime.layer_major``), on
        one device or as one stage sharded over dp x sp."""
        return self.config.order == "layer"

    @property
    def host_state(self) -> bool:
        """``model_state="host"``: FSDP2 keeps parameters, gradients and optimizer state in host memory, so even
        one device runs as a stage sharded over a process group of one."""
        return self.config.model_state == "host"

    def start_processes(
        self,
        cluster_environment: Any,
        device: torch.device,
        global_rank: int,
        local_processes: int,
        backend: str | None,
        timeout: timedelta | None,
    ) -> None:
        """Join the default process group, then build the (pp, dp, sp) mesh over it."""
        kwargs: dict[str, Any] = {"timeout": timeout}
        if device.type != "cpu":
            kwargs["device_id"] = device
        backend = backend or _get_default_process_group_backend_for_device(device)
        _init_dist_connection(cluster_environment, backend, **kwargs)
        object_group(timeout)
        self.build_mesh(device, global_rank, local_processes)

    def build_mesh(self, device: torch.device, global_rank: int, local_processes: int = 1) -> DeviceMesh:
        self.global_rank = global_rank
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Processes on one machine share its cores; oversubscribed threads slow every rank down.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_processes))
        if self.dims is None:  # the planner picks the layout when the model is set up (setup_layout)
            return None
        self.mesh = build_device_mesh(self.dims, device)
        return self.mesh

    def sampler_kwargs(self) -> dict[str, int]:
        """Shard data over dp only: the pp and sp ranks of one dp group must see the same batch."""
        if self.dims is None:
            raise RuntimeError(
                "pipeline_parallel / sequence_parallel are unset: the planner chooses them when the model is set up,"
                " and data parallel is what they leave. Set up the model before the dataloaders, or set both sizes."
            )
        if not self.distributed:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.dims.dp, "rank": self.dims.coordinates(self.global_rank)[1]}

    # -- model ------------------------------------------------------------------------------------

    def setup_model(self, model: nn.Module, device: torch.device, precision: str) -> nn.Module:
        """Both strategies' set-up of the model: the planner's sizes where unset, then ``prepare_model``."""
        self.set_precision(precision)
        with config_errors():  # the layout against the model: stages, layers_per_stage, heads and sp
            self.setup_layout(model, device)
            return self.prepare_model(model, device)

    def prepare_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """On one device: the model with subsequence attention. On several: this rank's (sharded) stage."""
        self.device = device
        if self.config.layers_per_stage is not None and isinstance(getattr(model, "config", None), GPTConfig):
            pp = self.dims.pp if self.dims is not None else 1
            layers_per_stage(model.config, pp, self.config.layers_per_stage)  # checked on one device too
        if not self.distributed and self.config.num_microbatches > 1:
            raise SPPOConfigError(
                f"num_microbatches={self.config.num_microbatches} pipelines micro-batches through several devices;"
                " one device runs the whole batch at once: set num_microbatches to 1 (and lower the batch size, with"
                " gradient accumulation, for less memory per step)."
            )
        self._build_offloader(device)
        self._build_plans()
        if self.host_state and self.mesh is None:
            self._join_alone(device)
        if not self.distributed:
            apply_subsequence_attention(model, select_kernel(self.config.attention, device))
            apply_recompute(model, "none" if self.layer_order else self.config.recompute)  # the engine recomputes
            return materialize(model, device)
        if self.layer_order:  # one stage, FSDP2 over dp x sp; the engine runs it (and exchanges for Ulysses)
            stage = parallelize_layers(
                model, self.dims, self.mesh, device, attention=self.config.attention,
                loss_chunk_tokens=self.config.loss_chunk_tokens, fsdp=self.fsdp,
            )  # fmt: skip
            self.engine.groups = self._layer_groups()
            return stage
        stage = parallelize_gpt(
            model,
            self.dims,
            self.mesh,
            device,
            attention=self.config.attention,
            layers=self.config.layers_per_stage,
            loss_chunk_tokens=self.config.loss_chunk_tokens,
            fsdp=self.fsdp,
            recompute=self.config.recompute,
        )
        self.runtime = PipelineRuntime(
            stage, self._groups(), self.config.schedule, hooks=self.hooks,
            build_shell=self._shell_builder(stage.model.config, device),
            kv_grad_dtype=KV_GRAD_DTYPES[self.config.kv_grad_dtype], shared_hooks=self._shared_hooks(device),
            recompute=self.config.recompute, device=device,
        )  # fmt: skip
        return stage

    def _join_alone(self, device: torch.device) -> None:
        """One process with its model state on host: a process group of one (unless one is running), for FSDP2."""
        if not dist.is_initialized():
            kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
            backend = _get_default_process_group_backend_for_device(device)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
            self._own_group = True
        self.build_mesh(device, dist.get_rank())

    def _shared_hooks(self, device: torch.device) -> Offloader | None:
        """With offloading on, the "sppo" schedule's shared units offload all they save (a second, "full" offloader:
        the adaptive rule paces a stage's own subsequences, not the shares of other stages' units it computes)."""
        if self.config.schedule != "sppo" or not isinstance(self.hooks, Offloader):
            return None
        return Offloader("full", device, min_bytes=self.hooks.min_bytes)

    def _shell_builder(self, model_config: GPTConfig, device: torch.device) -> Callable[[int], StageModule]:
        """Builds any stage on the meta device for the "sppo" schedule's shared units (weights stream in per piece)."""
        config = self.config

        def build(stage: int) -> StageModule:
            with torch.device("meta"):
                model = GPT(model_config)
            sp_group = self.mesh.get_group("sp") if self.dims.sp > 1 else None
            return build_stage_shell(
                model, stage, self.dims, device, sp_group,
                attention=config.attention, layers=config.layers_per_stage, loss_chunk_tokens=config.loss_chunk_tokens,
            )  # fmt: skip

        return build

    def _build_offloader(self, device: torch.device) -> None:
        """Level-2 activations of each subsequence go to host memory per the offload policy (none: no hooks). The
        layer-major engine keeps its own checkpoints (its ``offload``), without hooks."""
        if self.layer_order:
            return
        self.hooks = self.offload.build(device)
        self.engine.hooks = self.hooks
        if self.hooks is not None and self.config.partition == "adaptive":
            register_partition_policy("adaptive", self.hooks.partition)  # lengths from measured costs

    def _layer_groups(self) -> LayerGroups:
        """The layer order's process groups: sp (Ulysses), dp (the targets' count), and every rank (the loss)."""
        dims = self.dims
        return LayerGroups(
            sequence=self.mesh.get_group("sp") if dims.sp > 1 else None,
            data=self.mesh.get_group("dp") if dims.dp > 1 else None,
            loss=dist.group.WORLD if dims.world_size > 1 else None,
        )

    def _build_plans(self) -> None:
        """What every step's plan follows: the settings, the layout, the planner under "auto", the offloader's costs."""
        config, dims = self.config, self.dims or ParallelDims(1, 1, 1)
        settings = StepSettings(
            order=config.order, num_subsequences=config.num_subsequences, partition=config.partition or "length",
            granularity=math.lcm(config.granularity, dims.sp), num_microbatches=config.num_microbatches,
            sequence_parallel=dims.sp, kv_device_tokens=config.kv_device_tokens, kv_chunk_tokens=config.kv_chunk_tokens,
        )  # fmt: skip
        settled = self.hooks.partition_settled if isinstance(self.hooks, Offloader) else None
        self.plans = StepPlans(settings, dims, self.planner if config.num_subsequences == "auto" else None, settled)

    def _groups(self) -> PipelineGroups:
        dims = self.dims
        pp_rank, dp_rank, sp_rank = dims.coordinates(self.global_rank)
        column = [(stage * dims.dp + dp_rank) * dims.sp + sp_rank for stage in range(dims.pp)]
        columns = [
            [(stage * dims.dp + dp) * dims.sp + sp for stage in range(dims.pp)]
            for dp in range(dims.dp)
            for sp in range(dims.sp)
        ]
        return PipelineGroups(
            pp=dims.pp,
            sp=dims.sp,
            pp_rank=pp_rank,
            sp_rank=sp_rank,
            pp_global_ranks=column,
            dp_group=self.mesh.get_group("dp") if dims.dp > 1 else None,
            world_group=None,
            sp_group=self.mesh.get_group("sp") if dims.sp > 1 else None,
            columns=columns,
            links=pipeline_links(columns, self.global_rank),  # every rank creates all of them, in one order
        )

    # -- the step ---------------------------------------------------------------------------------

    def forward_backward(
        self,
        module: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        backward: Callable[[Tensor], None] | None = None,
        forward_context: Callable = nullcontext,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Forward and backward of every subsequence (and micro-batch) as the batch's plan says; returns the detached
        mean loss. ``document_ids`` [B, S]: packed documents (``lightning_sppo.documents``), best given on the CPU
        (the structure is derived there once and its ``starts`` copied to the batch's device)."""
        with config_errors():  # a batch the layout cannot split (micro-batches, sp, block_size, document_ids)
            model, input_ids, targets, plan = self._plan(module, input_ids, targets, document_ids, "forward_backward")
            if self.runtime is None:
                return self.engine.forward_backward(
                    model, input_ids, targets, plan=plan, backward=backward, forward_context=forward_context
                )
            with tied_gradients_summed(module):  # a tied embedding's two pipeline copies get the plain gradient
                return self.runtime.step(input_ids, targets, plan, backward=backward, forward_context=forward_context)

    def evaluate(
        self,
        module: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        forward_context: Callable = nullcontext,
        document_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Forward-only pass of every subsequence (and micro-batch), through the layout that trains:
        ``(sum of the token losses, valid targets)`` over the global batch, fp32 and the same on every rank.
        ``document_ids`` as in ``forward_backward``."""
        with config_errors():
            model, input_ids, targets, plan = self._plan(module, input_ids, targets, document_ids, "evaluate")
            if self.runtime is None:
                return self.engine.evaluate(model, input_ids, targets, plan=plan, forward_context=forward_context)
            return self.runtime.evaluate(input_ids, targets, plan, forward_context=forward_context)

    def _plan(
        self, module: nn.Module, input_ids: Tensor, targets: Tensor, document_ids: Tensor | None, call: str
    ) -> tuple[nn.Module, Tensor, Tensor, StepPlan]:
        """The model the step runs (a stage's, for the layer order on a sharded stage), the batch on the device,
        checked, and its plan. Every rank checks the same batch, so all raise together instead of one failing inside
        a kernel while the others wait."""
        if self.runtime is not None and not isinstance(module, StageModule):
            raise TypeError(
                f"On several devices {call} takes the stage returned by setup, got {type(module).__name__}."
            )
        model = module.model if isinstance(module, StageModule) else module
        input_ids, targets = (x.to(self.device) if isinstance(x, Tensor) else x for x in (input_ids, targets))
        check_batch(model, input_ids, targets, document_ids, token_ids=True)  # a TypeError for what is no tensor
        self.last_plan = self.plans.plan(model, input_ids, document_ids)
        return model, input_ids, targets, self.last_plan

    def clip_gradients(self, parameters, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> Tensor:
        """Clip by the norm of all gradients of the model, across every stage and shard."""
        return clip_grad_norm_(
            parameters, max_norm, norm_type, error_if_nonfinite, distributed=self.distributed, device=self.device
        )

    def teardown(self) -> None:
        self.engine.release()
        if self.runtime is not None:
            self.runtime.free_memory()
        if self.offload.offloader is not None:
            self.offload.offloader.release()
        shared = self.runtime.shared if self.runtime is not None else None
        if shared is not None and isinstance(shared.hooks, Offloader):
            shared.hooks.release()
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False


def _one_device_engine(config: SPPOConfig) -> SubsequenceEngine | LayerMajorEngine:
    """The engine that runs a step on one device, in the config's ``order`` (each step's plan says the rest)."""
    if config.order == "layer":
        return LayerMajorEngine(
            attention=config.attention, loss_chunk_tokens=config.loss_chunk_tokens, recompute=config.recompute,
            offload=config.offload,
        )  # fmt: skip
    return SubsequenceEngine(
        attention=config.attention, loss_chunk_tokens=config.loss_chunk_tokens,
        kv_grad_dtype=KV_GRAD_DTYPES[config.kv_grad_dtype],
    )  # fmt: skip


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (itself when no process group is running)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]
