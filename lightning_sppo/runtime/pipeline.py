"""Executes a lowered pipeline schedule on one rank: per-subsequence compute, P2P, gradient sync.

The schedule (``lightning_sppo.schedule``) is data: per rank, a list of F/B compute actions plus the
SEND/RECV actions lowering added. This runtime interprets exactly that list, for the step its ``StepPlan`` describes
(``lightning_sppo.step_plan``: subsequences, micro-batches, documents, K/V spill). Subsequence lengths differ,
so the shape of every message is derived from the plan, never from a first message. ``evaluate``
interprets the lowered ``forward_only`` schedule the same way, without autograd.

Messages travel on one 2-rank process group per stage pair and direction (``links.py`` says why NCCL needs
that): each group carries one direction in schedule order, so receives can be posted ahead of the sends
before them (``recv_lookahead``) without tags. A sent tensor is kept until its send completes (checked after
every action), not until the step ends: input gradients of a whole sequence would otherwise pile up.

Packed documents travel as one ``Documents`` per step (the dp rank's batch, the same on every pp and sp rank of
it), cut into one per micro-batch; every forward of a micro-batch's units gets its own.

Shape legend: B micro-batch size, c tokens of one subsequence on this SP rank, D hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sppo.attention import subsequence_cores
from lightning_sppo.documents import Documents
from lightning_sppo.parallel.fsdp import activation_dtype, fsdp_modules, set_last_backward
from lightning_sppo.parallel.multiplex import block_lengths
from lightning_sppo.recompute import RecomputeMode
from lightning_sppo.runtime.caches import CachePool
from lightning_sppo.runtime.engine import count_targets
from lightning_sppo.runtime.hooks import SubsequenceHooks, SubsequenceKey
from lightning_sppo.runtime.links import Link
from lightning_sppo.runtime.multiplexed import SharedUnits
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.schedule import Action, Op, build_schedule, dry_run, forward_only, lower
from lightning_sppo.step_plan import StepPlan

__all__ = ["PipelineGroups", "PipelineRuntime"]


@dataclass(frozen=True)
class PipelineGroups:
    """The process groups one rank talks to, and its coordinates."""

    pp: int
    sp: int
    pp_rank: int
    sp_rank: int
    pp_global_ranks: list[int]  # global rank of each stage in my (dp, sp) column
    dp_group: dist.ProcessGroup | None  # for the target count
    world_group: dist.ProcessGroup | None  # for the loss
    sp_group: dist.ProcessGroup | None = None  # my stage's SP ranks (None without SP)
    columns: list[list[int]] = field(default_factory=list)  # pp_global_ranks of every (dp, sp) column
    links: dict[Link, dist.ProcessGroup] = field(default_factory=dict)  # my column's messages (pipeline_links)


@dataclass
class _Step:
    input_ids: Tensor
    targets: Tensor
    plan: StepPlan
    normalizer: Tensor
    inputs: dict[SubsequenceKey, Tensor] = field(default_factory=dict)
    outputs: dict[SubsequenceKey, Tensor] = field(default_factory=dict)
    grads: dict[SubsequenceKey, Tensor] = field(default_factory=dict)
    losses: list[Tensor] = field(default_factory=list)
    sends: list[tuple[dist.Work, Tensor]] = field(default_factory=list)  # in flight: kept until completed
    receives: list[Action] = field(default_factory=list)  # this rank's RECV actions, in order
    posted: dict[Action, tuple[dist.Work, Tensor]] = field(default_factory=dict)
    next_receive: int = 0  # index into ``receives`` of the next one to post
    microbatch_documents: list[Documents | None] = field(default_factory=list)  # per micro-batch, or [None]s
    local: list[tuple[int, int]] = field(default_factory=list)  # this SP rank's share of each subsequence

    @property
    def batch(self) -> int:
        """Rows of one micro-batch."""
        return self.input_ids.shape[0] // self.plan.num_microbatches

    def rows(self, microbatch: int) -> slice:
        return slice(microbatch * self.batch, (microbatch + 1) * self.batch)

    def documents(self, microbatch: int) -> Documents | None:
        """The packed documents of a micro-batch's rows (None without documents)."""
        return self.microbatch_documents[microbatch]


class PipelineRuntime:
    """Runs one step of a stage: forward/backward of every (micro-batch, subsequence) as scheduled.

    With the "sppo" schedule, ``build_shell(stage)`` must build any stage's ``StageModule`` on the meta device:
    this rank runs its share of that stage's shared units on it, streaming the weights piece by piece from the
    stage's rank (``SharedUnits``). Shared units are not offloaded (``hooks`` see only the units a stage runs
    alone; ``shared_hooks``, when given, see the shared units this rank takes part in: the strategy passes a second
    offloader, policy "full", whenever offloading is on). ``kv_grad_dtype``: the dK/dV accumulators' dtype (None: fp32).
    The K/V caches spill to host as each step's plan says (``CachePool.use_spill``). ``recv_lookahead``: how many receives
    are posted ahead of the RECV actions that need them (0: each at its action). ``recompute``: what the shared units'
    blocks recompute (the stage's own blocks got theirs from ``parallelize_gpt``). ``device``: where the stage computes
    (None: where its parameters are; with model state on host they are in host memory, and the strategy passes it).
    """

    def __init__(
        self,
        stage: StageModule,
        groups: PipelineGroups,
        schedule: str = "seq1f1b",
        hooks: SubsequenceHooks | None = None,
        recv_lookahead: int = 2,
        build_shell: Callable[[int], StageModule] | None = None,
        kv_grad_dtype: torch.dtype | None = None,
        shared_hooks: SubsequenceHooks | None = None,
        recompute: RecomputeMode = "none",
        device: torch.device | None = None,
    ) -> None:
        self.stage = stage
        self.device = device
        self.groups = groups
        self.schedule = schedule
        self.hooks = hooks
        self.recv_lookahead = recv_lookahead
        self.pool = CachePool(subsequence_cores(stage), kv_grad_dtype)
        self._sharded = bool(fsdp_modules(stage))
        self._lowered: dict[tuple[int, int], list[Action]] = {}
        self.shared: SharedUnits | None = None
        missing = [link for link in _neighbour_links(groups) if link not in groups.links]
        if missing:
            raise ValueError(
                f"Stage {groups.pp_rank} of {groups.pp} needs a process group for each direction to its neighbours;"
                f" PipelineGroups.links lacks {missing}. Build them with lightning_sppo.runtime.links.pipeline_links."
            )
        if schedule == "sppo" and groups.pp > 1:
            if build_shell is None:
                raise ValueError('schedule="sppo" needs build_shell: helpers run other stages\' shared units.')
            self.shared = SharedUnits(
                stage, self.pool, groups, build_shell, lambda: self._dtype, shared_hooks, recompute, self._device
            )

    # -- schedule ---------------------------------------------------------------------------------

    def actions(self, num_subsequences: int, num_microbatches: int, evaluation: bool = False) -> list[Action]:
        """This rank's lowered action list, checked for deadlock once per shape (before any communication).

        ``evaluation``: the forward-only schedule, whatever schedule trains.
        """
        key = (num_subsequences, num_microbatches, evaluation)
        if key not in self._lowered:
            if evaluation:
                schedule = forward_only(self.groups.pp, num_subsequences, num_microbatches)
            else:
                schedule = build_schedule(self.schedule, self.groups.pp, num_subsequences, num_microbatches)
            lowered = lower(schedule)
            dry_run(lowered)
            self._lowered[key] = lowered[self.groups.pp_rank]
        return self._lowered[key]

    # -- one step ---------------------------------------------------------------------------------

    def step(
        self,
        input_ids: Tensor,
        targets: Tensor,
        plan: StepPlan,
        backward: Callable[[Tensor], None] | None = None,
        forward_context: Callable = nullcontext,
    ) -> Tensor:
        """One optimizer step's forward and backward, as ``plan`` says. ``input_ids``/``targets`` [B, S] are this dp
        rank's batch (the same on every pp and sp rank). Returns the detached global mean loss on every rank."""
        step = self._begin(input_ids, targets, plan, self._normalizer(targets))
        spans = plan.spans
        actions = self.actions(len(spans), plan.num_microbatches)
        me = self.groups.pp_rank
        # FSDP's last backward on this rank: shared units run on the stage's shell, outside FSDP.
        last_backward = max((i for i, a in enumerate(actions) if a.op == Op.B and a.stage is None), default=-1)
        releases = _last_backwards(actions, me)
        for action in actions:  # every rank checks the same, before any communication
            if action.multiplexed:
                block_lengths(spans[action.subsequence][1] // self.groups.sp, len(action.group))
        if self.shared is not None:
            self.shared.begin_step(spans)
        if self.hooks is not None:
            self.hooks.begin_step(spans)
        step.receives = [a for a in actions if a.op in (Op.RECV_F, Op.RECV_B)]
        try:
            # One precision context around the whole interleaved F/B list: autocast keeps one low-precision
            # copy of each weight while it is open (per-F contexts would keep one per subsequence alive).
            with forward_context():
                for position, action in enumerate(actions):
                    self._post_receives(step)
                    if action.op == Op.B and not action.multiplexed and self._sharded:
                        set_last_backward(self.stage, position == last_backward)
                    if action.multiplexed:
                        self._run_shared(step, action, backward)
                    else:
                        self._run(step, action, backward)
                    if self.shared is not None and action.op.is_compute:
                        self.shared.after_action()
                    if position in releases:
                        self._release(*releases[position])
                    # Drop delivered sends at once (NCCL's works say so; gloo's only once waited on).
                    step.sends = [(work, tensor) for work, tensor in step.sends if not work.is_completed()]
            for work, _ in step.sends:  # the rest must stay alive until delivered
                work.wait()
            if self.shared is not None:
                self.shared.end_step()
        finally:
            self.pool.unbind()
            if self.hooks is not None:
                self.hooks.end_step()
            if self.shared is not None:
                self.shared.close()
        return self._global_loss(step)

    def evaluate(
        self, input_ids: Tensor, targets: Tensor, plan: StepPlan, forward_context: Callable = nullcontext
    ) -> tuple[Tensor, Tensor]:
        """Forward-only pass of this dp rank's batch through the pipeline: ``(sum of the token losses, valid
        targets)`` over the global batch, fp32 and the same on every rank.

        No autograd graph, no dK/dV buffers, nothing saved for backward, no offload; the K/V caches fill
        subsequence by subsequence as in training, and a micro-batch's caches are reused by the next one.
        """
        # Every token's loss counts once: normalizer 1, and the sum is divided by the global count outside.
        step = self._begin(input_ids, targets, plan, torch.ones((), device=self._device))
        actions = self.actions(len(plan.lengths), plan.num_microbatches, evaluation=True)
        step.receives = [a for a in actions if a.op == Op.RECV_F]
        try:
            # inference_mode(False): K/V buffers allocated under Lightning's inference mode would be inference
            # tensors that the next training step cannot write into.
            with torch.inference_mode(False), torch.no_grad(), forward_context():
                for action in actions:
                    self._post_receives(step)
                    self._run_forward_only(step, action)
                    step.sends = [(work, tensor) for work, tensor in step.sends if not work.is_completed()]
            for work, _ in step.sends:  # the rest must stay alive until delivered
                work.wait()
        finally:
            self.pool.unbind()
            if self._sharded:  # under fsdp_sync="step" the forwards left the stage's weights gathered
                for module in fsdp_modules(self.stage):
                    module.reshard()
        return self._global_loss(step), self._target_count(targets)

    def _run_forward_only(self, step: _Step, action: Action) -> None:
        """One action of the forward-only schedule; inputs and outputs are dropped as soon as they are used."""
        key = (action.microbatch, action.subsequence)
        if action.op == Op.RECV_F:
            self._run(step, action, None)  # the training receive: the message lands in step.inputs
        elif action.op == Op.SEND_F:
            self._send(step, step.outputs.pop(key), action)
        else:
            rows, cols, offset = self._local_slice(step, key)
            x = step.inputs.pop(key) if key in step.inputs else step.input_ids[rows, cols]
            self.pool.bind(action.microbatch)
            targets = step.targets[rows, cols] if self.stage.is_last else None
            out = self.stage(x, offset, targets, step.normalizer, step.documents(action.microbatch))
            if self.stage.is_last:
                step.losses.append(out)
            else:
                step.outputs[key] = out
            if action.subsequence == len(step.plan.lengths) - 1:
                self.pool.release(action.microbatch)

    def _run(self, step: _Step, action: Action, backward) -> None:
        key = (action.microbatch, action.subsequence)
        if action.op == Op.F:
            self._forward(step, key)
        elif action.op == Op.B:
            self._backward(step, key, backward)
        elif action.op in (Op.SEND_F, Op.SEND_B):
            tensor = step.outputs[key].detach() if action.op == Op.SEND_F else step.inputs.pop(key).grad
            self._send(step, tensor, action)
        else:
            while action not in step.posted:  # with recv_lookahead=0 nothing is posted ahead
                self._post_next_receive(step)
            work, buffer = step.posted.pop(action)
            work.wait()
            if action.op == Op.RECV_F:
                step.inputs[key] = buffer.requires_grad_()
            else:
                step.grads[key] = buffer

    def _run_shared(self, step: _Step, action: Action, backward) -> None:
        if action.op == Op.F:
            self.shared.forward(step, action)
        else:
            self.shared.backward(step, action, backward)

    def _release(self, stage: int, microbatch: int) -> None:
        """The micro-batch's last backward with ``stage``'s weights ran here: its caches may be reused (helpers
        of other stages hold no caches)."""
        if stage == self.groups.pp_rank:
            self.pool.release(microbatch)

    def _forward(self, step: _Step, key: SubsequenceKey) -> None:
        mb, sub = key
        rows, cols, offset = self._local_slice(step, key)
        x = step.inputs.get(key)
        if x is None:  # first stage: token ids
            x = step.input_ids[rows, cols]
            step.inputs[key] = x
        self.pool.bind(mb)
        targets = step.targets[rows, cols] if self.stage.is_last else None
        with self.hooks.forward_context(key) if self.hooks else nullcontext():
            out = self.stage(x, offset, targets, step.normalizer, step.documents(mb))
        if self.hooks:
            self.hooks.after_forward(key)
        step.outputs[key] = out
        if self.stage.is_last:
            step.losses.append(out.detach())

    def _backward(self, step: _Step, key: SubsequenceKey, backward) -> None:
        if self.hooks:
            self.hooks.before_backward(key)
        out = step.outputs.pop(key)
        if self.stage.is_last:
            (backward or Tensor.backward)(out)
        else:
            torch.autograd.backward(out, grad_tensors=step.grads.pop(key))
        if self.hooks:
            self.hooks.after_backward(key)
        if self.stage.is_first:  # token ids: nothing to send back
            del step.inputs[key]

    # -- communication ----------------------------------------------------------------------------

    def _post_receives(self, step: _Step) -> None:
        """Keep up to ``recv_lookahead`` receives posted ahead, so messages land while we compute.

        Safe under NCCL because each direction has its own group: a receive posted early waits only for
        sends of its own direction, which its peer issues in the same (schedule) order.
        """
        while step.next_receive < len(step.receives) and len(step.posted) < self.recv_lookahead:
            self._post_next_receive(step)

    def _post_next_receive(self, step: _Step) -> None:
        action = step.receives[step.next_receive]
        buffer = torch.empty(self._message_shape(step, action), dtype=self._dtype, device=self._device)
        peer = self.groups.pp_global_ranks[action.peer]
        group = self.groups.links[(action.peer, self.groups.pp_rank)]
        step.posted[action] = (dist.irecv(buffer, src=peer, group=group), buffer)
        step.next_receive += 1

    def _send(self, step: _Step, tensor: Tensor, action: Action) -> None:
        expected = self._message_shape(step, action)
        if tuple(tensor.shape) != expected or tensor.dtype != self._dtype:
            raise RuntimeError(
                f"Stage {self.groups.pp_rank} would send {tuple(tensor.shape)} {tensor.dtype} for {action},"
                f" but its peer expects {expected} {self._dtype}."
            )
        tensor = tensor.contiguous()
        peer = self.groups.pp_global_ranks[action.peer]
        group = self.groups.links[(self.groups.pp_rank, action.peer)]
        step.sends.append((dist.isend(tensor, dst=peer, group=group), tensor))

    def _message_shape(self, step: _Step, action: Action) -> tuple[int, int, int]:
        return step.batch, step.plan.lengths[action.subsequence] // self.groups.sp, self.stage.model.config.n_embd

    @property
    def _dtype(self) -> torch.dtype:
        # The residual stream keeps the (gathered) weights' dtype: autocast only lowers matmul outputs.
        return activation_dtype(self.stage)

    @property
    def _device(self) -> torch.device:
        return self.device or next(p for p in self.stage.parameters()).device

    # -- bookkeeping ------------------------------------------------------------------------------

    def _local_slice(self, step: _Step, key: SubsequenceKey) -> tuple[slice, slice, int]:
        """Rows of the micro-batch, and this SP rank's contiguous chunk of the subsequence (and its offset)."""
        mb, sub = key
        start, length = step.local[sub]
        return step.rows(mb), slice(start, start + length), start

    def _begin(self, input_ids: Tensor, targets: Tensor, plan: StepPlan, normalizer: Tensor) -> _Step:
        """The step's state, each micro-batch's documents, and the K/V caches spilled and reset as ``plan`` says."""
        plan.check(input_ids, "subsequence")
        step = _Step(input_ids, targets, plan, normalizer, local=plan.shard(self.groups.sp, self.groups.sp_rank))
        documents, m = plan.documents, plan.num_microbatches
        step.microbatch_documents = [None if documents is None else documents.rows(step.rows(mb)) for mb in range(m)]
        self.pool.use_spill(*plan.spill)
        self.pool.begin_step(plan.seq_len)  # head-sharded under SP, but every token of the sequence
        return step

    def _normalizer(self, targets: Tensor) -> Tensor:
        return self._target_count(targets).clamp(min=1)

    def _target_count(self, targets: Tensor) -> Tensor:
        """Valid targets of the whole global batch: every dp rank's batch counted once."""
        count = count_targets(targets)
        if self.groups.dp_group is not None:
            dist.all_reduce(count, group=self.groups.dp_group)
        return count

    def _global_loss(self, step: _Step) -> Tensor:
        """Sum of every last-stage rank's loss shares (the global mean loss), the same on every rank."""
        local = torch.stack(step.losses).sum() if step.losses else torch.zeros((), device=self._device)
        local = local.to(torch.float32)
        if dist.is_initialized():
            dist.all_reduce(local, group=self.groups.world_group)
        return local

    def free_memory(self) -> None:
        self.pool.free_memory()


def _neighbour_links(groups: PipelineGroups) -> list[Link]:
    """The directions a stage sends or receives on: to and from each neighbour."""
    me = groups.pp_rank
    return [(a, b) for n in (me - 1, me + 1) if 0 <= n < groups.pp for a, b in ((me, n), (n, me))]


def _last_backwards(actions: list[Action], rank: int) -> dict[int, tuple[int, int]]:
    """position -> (stage, micro-batch) for each micro-batch's last backward with each stage's weights."""
    last: dict[tuple[int, int], int] = {}
    for position, action in enumerate(actions):
        if action.op == Op.B:
            last[(action.owner(rank), action.microbatch)] = position
    return {position: unit for unit, position in last.items()}
