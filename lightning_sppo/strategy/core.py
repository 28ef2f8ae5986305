"""What the Fabric and the Trainer strategies share: the layout, model preparation and the training step.

The strategies own processes, devices, precision and the framework's hooks; this class owns everything
SPPO-specific, so both frameworks train exactly the same way.
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
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_sppo.attention import KV_GRAD_DTYPES, apply_subsequence_attention, select_kernel
from lightning_sppo.documents import Documents
from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.model import GPT, GPTConfig
from lightning_sppo.offload import OffloadCallback, Offloader
from lightning_sppo.parallel import ParallelDims, build_device_mesh, layers_per_stage, parallelize_gpt
from lightning_sppo.parallel.fsdp import FSDPOptions
from lightning_sppo.parallel.parallelize import build_stage_shell, materialize, parallelize_layers
from lightning_sppo.parallel.tied import tied_gradients_summed
from lightning_sppo.partition import (
    DOCUMENT_AWARE_POLICIES,
    auto_num_subsequences,
    register_partition_policy,
    spans,
    split_sequence,
)
from lightning_sppo.recompute import apply_recompute
from lightning_sppo.runtime import LayerMajorEngine, SubsequenceEngine
from lightning_sppo.runtime.engine import check_batch, check_token_ids
from lightning_sppo.runtime.hooks import SubsequenceHooks
from lightning_sppo.runtime.layer_major import LayerGroups
from lightning_sppo.runtime.links import pipeline_links
from lightning_sppo.runtime.pipeline import PipelineGroups, PipelineRuntime
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.strategy.autoplan import AutoPlanner
from lightning_sppo.strategy.clipping import clip_grad_norm_
from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.lengths import LengthChoice, SharedLengths
from lightning_sppo.strategy.state_gather import object_group

__all__ = ["SPPOCore", "assign_world_ranks", "broadcast_object", "configure_launcher", "join_processes"]


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
        self.lengths = SharedLengths()
        """Subsequence lengths chosen on rank 0 for every rank (several processes)."""
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
        self.engine.granularity = math.lcm(self.config.granularity, sp)
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
            kv_device_tokens=self.config.kv_device_tokens, kv_chunk_tokens=self.config.kv_chunk_tokens,
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
        """Forward and backward of every subsequence (and micro-batch); returns the detached mean loss.

        ``document_ids`` [B, S]: packed documents (``lightning_sppo.documents``), best given on the CPU (the
        structure is derived there once and its ``starts`` copied to the batch's device)."""
        if self.runtime is None:
            module = module.model if isinstance(module, StageModule) else module  # order="layer" on a stage
            # Before the planner, in the caller's terms; the engine checks document_ids itself (a synchronisation).
            _check_step_batch(module, input_ids, targets)
            if self.config.num_subsequences == "auto":
                self._plan_engine(module, input_ids)
            return self.engine.forward_backward(
                module, input_ids, targets, document_ids, backward=backward, forward_context=forward_context
            )
        if not isinstance(module, StageModule):
            raise TypeError(
                f"On several devices forward_backward takes the stage returned by setup, got {type(module).__name__}."
            )
        _check_step_batch(module.model, input_ids, targets, document_ids)
        documents = None if document_ids is None else Documents.from_ids(document_ids, input_ids.device)
        spans = self._spans(module, input_ids, documents)
        with tied_gradients_summed(module):  # a tied embedding's two pipeline copies get the plain gradient
            return self.runtime.step(
                input_ids,
                targets,
                spans,
                num_microbatches=self.config.num_microbatches,
                backward=backward,
                forward_context=forward_context,
                documents=documents,
            )

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
        if self.runtime is None:
            module = module.model if isinstance(module, StageModule) else module  # order="layer" on a stage
            _check_step_batch(module, input_ids, targets)  # document_ids: checked by the engine
            if self.config.num_subsequences == "auto":
                self._plan_engine(module, input_ids)
            return self.engine.evaluate(module, input_ids, targets, document_ids, forward_context=forward_context)
        if not isinstance(module, StageModule):
            raise TypeError(
                f"On several devices evaluate takes the stage returned by setup, got {type(module).__name__}."
            )
        _check_step_batch(module.model, input_ids, targets, document_ids)
        documents = None if document_ids is None else Documents.from_ids(document_ids, input_ids.device)
        return self.runtime.evaluate(
            input_ids,
            targets,
            self._spans(module, input_ids, documents),
            num_microbatches=self.config.num_microbatches,
            forward_context=forward_context,
            documents=documents,
        )

    def _plan_engine(self, model: nn.Module, input_ids: Tensor) -> None:
        """On one device, ``num_subsequences="auto"``: the engine cuts this batch as the planner says."""
        batch, seq_len = input_ids.shape
        if self.layer_order:
            self.engine.num_subsequences = auto_num_subsequences(seq_len, self.engine.granularity, LAYER_CHUNK_TOKENS)
            return
        dims = self.dims or ParallelDims(1, 1, 1)
        n, policy, granularity = self.planner.subsequences(
            model, seq_len, batch, dims, input_ids.device, self.config.boundary_granularity
        )
        self.engine.num_subsequences, self.engine.partition, self.engine.granularity = n, policy, granularity

    def _spans(self, stage: StageModule, input_ids: Tensor, documents: Documents | None) -> list[tuple[int, int]]:
        """Rank 0's lengths for this batch: per batch shape, or, when they follow the documents, per batch."""
        batch, seq_len = input_ids.shape
        m, sp = self.config.num_microbatches, self.dims.sp
        if batch % m:
            raise ValueError(
                f"The batch of {batch} sequences does not split into num_microbatches={m};"
                " use a batch size that is a multiple of it."
            )
        if seq_len % sp:
            raise ValueError(
                f"With sequence_parallel={sp} every subsequence is split over {sp} ranks: the sequence length"
                f" {seq_len} must be a multiple of {sp}."
            )
        shape = (seq_len, batch // m)
        lengths = self.lengths.decide(
            shape,
            lambda: self._choose_lengths(stage.model, *shape, input_ids.device, documents),
            input_ids.device,
            documents=documents is not None,
        )
        self.engine.last_lengths = lengths
        return spans(lengths)

    def _choose_lengths(
        self, model: nn.Module, seq_len: int, batch: int, device: torch.device, documents: Documents | None = None
    ) -> LengthChoice:
        """This rank's lengths for a micro-batch of ``batch`` x ``seq_len``; on several ranks only rank 0 asks.

        With ``documents`` (this rank's batch: on rank 0, the first dp group's), "flops" and "adaptive" follow
        where the documents start, so the choice holds for this batch only; every rank takes rank 0's."""
        if self.config.num_subsequences == "auto":
            n, policy, granularity = self.planner.subsequences(
                model, seq_len, batch, self.dims, device, self.engine.granularity
            )
        else:
            n, policy, granularity = self.config.num_subsequences, self.engine.partition, self.engine.granularity
        lengths = split_sequence(seq_len, n, policy, granularity=granularity, config=model.config, documents=documents)
        if documents is not None and policy in DOCUMENT_AWARE_POLICIES:
            return LengthChoice(lengths, final=False)  # the next batch's documents cut it differently
        # "adaptive" follows the offloader's costs until it has fixed its lengths for this shape.
        final = policy != "adaptive" or not isinstance(self.hooks, Offloader)
        return LengthChoice(lengths, final or self.hooks.partition_settled(seq_len, n, granularity))

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


LAYER_CHUNK_TOKENS = 16384
"""Tokens per chunk of order="layer" under num_subsequences="auto": long enough for the kernels' efficiency."""


def _one_device_engine(config: SPPOConfig) -> SubsequenceEngine | LayerMajorEngine:
    """The engine that runs a step on one device, in the config's ``order``."""
    if config.order == "layer":
        return LayerMajorEngine(
            num_subsequences=1 if config.num_subsequences == "auto" else config.num_subsequences,
            partition=config.partition or "length",
            attention=config.attention,
            loss_chunk_tokens=config.loss_chunk_tokens,
            granularity=config.boundary_granularity,
            recompute=config.recompute,
            offload=config.offload,
            kv_device_tokens=config.kv_device_tokens,
            kv_chunk_tokens=config.kv_chunk_tokens,
        )
    return SubsequenceEngine(
        num_subsequences=config.num_subsequences,
        partition=config.partition or "length",
        attention=config.attention,
        loss_chunk_tokens=config.loss_chunk_tokens,
        granularity=config.boundary_granularity,
        kv_grad_dtype=KV_GRAD_DTYPES[config.kv_grad_dtype],
        kv_device_tokens=config.kv_device_tokens,
        kv_chunk_tokens=config.kv_chunk_tokens,
    )


def assign_world_ranks(strategy: Any) -> None:
    """Global rank and world size into the cluster environment, and the rank for rank-zero-only logging.

    ``strategy`` is either strategy: both have ``cluster_environment``, ``node_rank``, ``local_rank``,
    ``num_processes``, ``num_nodes`` and ``global_rank``.
    """
    environment = strategy.cluster_environment
    if environment is not None:
        environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = strategy.global_rank


def configure_launcher(strategy: Any, launcher: type) -> None:
    """Both strategies' ``_configure_launcher``: check the world size before any process starts, then start the
    processes with the framework's script ``launcher`` unless the cluster does."""
    world_size = strategy.num_processes * strategy.num_nodes
    strategy.core.set_world_size(world_size, strategy.num_processes)
    if world_size > 1 and not strategy.cluster_environment.creates_processes_externally:
        strategy._launcher = launcher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)


def join_processes(strategy: Any) -> None:
    """What both strategies' ``setup_environment`` adds: world ranks, then on several processes the process
    group and the device mesh."""
    assign_world_ranks(strategy)
    if strategy.is_distributed:
        strategy.core.start_processes(
            strategy.cluster_environment,
            strategy.root_device,
            strategy.global_rank,
            strategy.num_processes,
            strategy._process_group_backend,
            strategy._timeout,
        )


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (itself when no process group is running)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def _check_step_batch(model: nn.Module, input_ids: Tensor, targets: Tensor, document_ids: Tensor | None = None) -> None:
    """The batch's shapes and types, then its ids against the vocabulary (every rank checks the same batch, so
    all raise together instead of one failing inside a kernel while the others wait)."""
    check_batch(model, input_ids, targets, document_ids)
    check_token_ids(model.config.vocab_size, input_ids, targets)
