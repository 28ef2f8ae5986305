"""Shared units of the "sppo" schedule on one rank: multiplexed sequence partitioning at run time.

A shared action (``F0.1[2:2,3]``) is run by every rank of its group at once, each on a contiguous block of
the subsequence (``block_lengths``), with the weights of the unit's stage: the stage's own rank uses its
stage, the helpers a replica of it. Data moves only inside the action: the stage's rank holds the unit's
input (received from the previous stage as usual) and hands every member its block; the blocks' outputs
(and in backward their input gradients) come back to it, to be sent on as usual.

Per step, helpers get the stages' current weights (one broadcast per group) and give their gradients back
(one reduce per group, added to the stage's gradients, sharded or not). K/V: every member caches the whole
shared subsequence; a group starting in the middle of a sequence first gets the prefix K/V from the stage's
rank, and gives the prefix dK/dV its queries produced back after its last backward.

Packed documents: every member has the micro-batch's documents (the batch is the same on every rank of a dp
group), so its block at o_r attends by the same rule as a subsequence at o_r would: the prefix part only for
rows whose first document began before o_r, within each document on the diagonal.

Shape legend: B micro-batch rows, L tokens of the subsequence, D hidden size; with SP every member holds
its block's chunk on its SP rank, like the stage's rank holds its chunk of the whole subsequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_sppo.attention import Multiplex, block_lengths, gather_blocks, subsequence_cores
from lightning_sppo.runtime.caches import CachePool
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.schedule import Action, Op
from lightning_sppo.schedule.msp import sharing_groups

__all__ = ["SharedUnits"]


@dataclass
class _Block:
    """My block of a shared unit between its forward and its backward."""

    x: Tensor  # input (token ids, or hidden states as a leaf that collects the input gradient)
    out: Tensor  # output (hidden states, or the loss share on the last stage), with its graph


class SharedUnits:
    """The shared actions of one rank: replicas of the other stages, process groups, and the data moves.

    ``build_replica(stage)`` returns a fresh, unsharded ``StageModule`` of that stage on this device (its
    values are overwritten from the stage's rank at every step). ``groups`` is the runtime's
    ``PipelineGroups``; ``pool`` the K/V caches of this rank's own stage; ``activation_dtype()`` the dtype
    of the hidden states between stages (what the runtime sends).
    """

    def __init__(
        self,
        stage: StageModule,
        pool: CachePool,
        groups,
        build_replica: Callable[[int], StageModule],
        activation_dtype: Callable[[], torch.dtype],
    ) -> None:
        self.stage, self.groups, self.activation_dtype = stage, groups, activation_dtype
        me, pp = groups.pp_rank, groups.pp
        self.process_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        # Every process creates every group, once, in the same order (stage 0's Left is the last stage's Right).
        for ranks in dict.fromkeys(ranks for _, ranks in sharing_groups(pp)):
            columns = [[column[r] for r in ranks] for column in groups.columns]
            mine, _ = dist.new_subgroups_by_enumeration(columns, group_desc="sppo_sharing")
            if me in ranks:
                self.process_groups[ranks] = mine
        self.modules: dict[int, tuple[StageModule, CachePool]] = {me: (stage, pool)}
        for other in range(pp):
            if other != me:
                # Like the stage's gathered weights (FSDP mixed precision computes in its param_dtype).
                replica = build_replica(other).to(dtype=activation_dtype())
                self.modules[other] = (replica, CachePool(subsequence_cores(replica), pool.grad_dtype))
        self._blocks: dict[Action, _Block] = {}

    # -- per step ---------------------------------------------------------------------------------

    def begin_step(self, seq_len: int) -> None:
        """Every replica gets its stage's current weights; caches and gradients start empty."""
        for stage, (module, pool) in self.modules.items():
            if stage != self.groups.pp_rank:
                pool.begin_step(seq_len)
                for p in module.parameters():
                    p.grad = None
        mine = _flat([p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in self.stage.parameters()])
        for stage, ranks in self._my_groups():
            module, _ = self.modules[stage]
            size = sum(p.numel() for p in module.parameters())
            flat = mine if stage == self.groups.pp_rank else mine.new_empty(size)
            dist.broadcast(flat, src=self._global(stage), group=self.process_groups[ranks])
            if stage != self.groups.pp_rank:
                _unflat(flat, [p.data for p in module.parameters()])

    def end_step(self) -> None:
        """Helpers' weight gradients go to the stage's rank and are added to its (possibly sharded) gradients."""
        me = self.groups.pp_rank
        params = list(self.stage.parameters())
        total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
        for stage, ranks in self._my_groups():
            module, _ = self.modules[stage]
            if stage == me:
                flat = torch.zeros_like(total)
            else:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
                flat = _flat(grads).to(torch.float32)
            dist.reduce(flat, dst=self._global(stage), group=self.process_groups[ranks])
            if stage == me:
                total += flat
        _add_gradients(params, total)
        for stage, (_, pool) in self.modules.items():
            if stage != me:
                pool.unbind()

    def _my_groups(self) -> list[tuple[int, tuple[int, ...]]]:
        """(stage, group) pairs this rank belongs to, in one global order."""
        return [(stage, ranks) for stage, ranks in sharing_groups(self.groups.pp) if self.groups.pp_rank in ranks]

    # -- actions ----------------------------------------------------------------------------------

    def forward(self, step, action: Action, shared_before: bool) -> None:
        """My block of a shared forward; the stage's rank ends with the unit's output chunk in ``step.outputs``.

        ``shared_before``: the previous subsequence of this stage and micro-batch was shared by the same group
        (so every member already caches the prefix).
        """
        module, pool = self.modules[action.stage]
        plex, start, chunk = self._layout(step, action)
        rows = step.rows(action.microbatch)
        pool.bind(action.microbatch)
        if plex.sub_offset > 0 and not shared_before:
            self._share_prefix(module, plex, action, step.batch)
        if module.is_first:
            x = step.input_ids[rows, start : start + chunk]
        else:
            whole = self._spread(step, action, step.inputs.get(action.unit))
            x = whole[:, start - plex.sub_offset : start - plex.sub_offset + chunk].detach().requires_grad_()
        targets = step.targets[rows, start : start + chunk] if module.is_last else None
        cores = subsequence_cores(module)
        for core in cores:
            core.multiplex = plex
        try:
            out = module(x, start, targets, step.normalizer, step.documents(action.microbatch))
        finally:
            for core in cores:
                core.multiplex = None
        self._blocks[action] = _Block(x, out)
        if module.is_last:
            step.losses.append(out.detach())
        else:
            whole = self._collect(step, action, plex, out.detach())
            if whole is not None:
                step.outputs[action.unit] = self._my_chunk(whole)

    def backward(self, step, action: Action, shared_before: bool, backward) -> None:
        """My block of a shared backward; the stage's rank ends with the input gradient chunk to send back."""
        module, _ = self.modules[action.stage]
        block = self._blocks.pop(action._replace(op=Op.F))
        owner = action.stage == self.groups.pp_rank
        plex, start, chunk = self._layout(step, action)
        if module.is_last:
            (backward or Tensor.backward)(block.out)
        else:
            whole = self._spread(step, action, step.grads.pop(action.unit) if owner else None)
            grad = whole[:, start - plex.sub_offset : start - plex.sub_offset + chunk]
            torch.autograd.backward(block.out, grad_tensors=grad)
        if owner:
            step.outputs.pop(action.unit, None)
        if not module.is_first:
            whole = self._collect(step, action, plex, block.x.grad)
            if whole is not None:
                step.inputs[action.unit].grad = self._my_chunk(whole)
        if plex.sub_offset > 0 and not shared_before:
            self._return_prefix_grads(module, plex, action)

    def release(self, stage: int, microbatch: int) -> None:
        self.modules[stage][1].release(microbatch)

    # -- layout -----------------------------------------------------------------------------------

    def _layout(self, step, action: Action) -> tuple[Multiplex, int, int]:
        """My block as a ``Multiplex``, and where my SP chunk of it starts and how long it is."""
        offset, length = step.spans[action.subsequence]
        sp = self.groups.sp
        lengths = tuple(block_lengths(length, len(action.group), sp))
        plex = Multiplex(self.process_groups[action.group], action.group.index(self.groups.pp_rank), lengths, offset)
        chunk = lengths[plex.index] // sp
        return plex, plex.offset + self.groups.sp_rank * chunk, chunk

    def _shape(self, step, action: Action) -> tuple[int, int, int]:
        """[B, L, D]: a whole shared subsequence's hidden states (or their gradient)."""
        return step.batch, step.spans[action.subsequence][1], self.stage.model.config.n_embd

    # -- data moves -------------------------------------------------------------------------------

    def _spread(self, step, action: Action, chunk: Tensor | None) -> Tensor:
        """The stage's rank's chunk of a [B, L, D] tensor (None on helpers) -> the whole tensor on every member."""
        owner = action.stage == self.groups.pp_rank
        if owner:
            whole = self._gather_sp(chunk.detach())
        else:
            whole = torch.empty(self._shape(step, action), dtype=self.activation_dtype(), device=_device(self.stage))
        dist.broadcast(whole, src=self._global(action.stage), group=self.process_groups[action.group])
        return whole

    def _collect(self, step, action: Action, plex: Multiplex, piece: Tensor) -> Tensor | None:
        """Every member's [B, c_r, D] piece -> the whole [B, L, D] tensor on the stage's rank (None elsewhere)."""
        sp = self.groups.sp
        piece = piece.to(self.activation_dtype())
        pieces = gather_blocks(piece, [n // sp for n in plex.lengths], plex.group, dim=1)
        if action.stage != self.groups.pp_rank:
            return None
        columns = self._gather_sp(torch.cat(pieces, dim=1), split=[n // sp for n in plex.lengths])
        whole = torch.empty(self._shape(step, action), dtype=piece.dtype, device=piece.device)
        start = 0
        for member, length in enumerate(plex.lengths):
            chunk = length // sp
            for column in range(sp):
                whole[:, start + column * chunk : start + (column + 1) * chunk] = columns[column][member]
            start += length
        return whole

    def _gather_sp(self, x: Tensor, split: Sequence[int] | None = None):
        """Over the stage's SP ranks: without ``split``, the chunks concatenated in token order ([B, L, D]);
        with it, per SP rank the list of its pieces (of the given lengths)."""
        sp_group = self.groups.sp_group
        parts = [x] if sp_group is None else [torch.empty_like(x) for _ in range(self.groups.sp)]
        if sp_group is not None:
            dist.all_gather(parts, x.contiguous(), group=sp_group)
        if split is None:
            return torch.cat(parts, dim=1)
        return [list(part.split(list(split), dim=1)) for part in parts]

    def _my_chunk(self, whole: Tensor) -> Tensor:
        """This SP rank's contiguous chunk of a whole [B, L, D] subsequence tensor."""
        chunk = whole.shape[1] // self.groups.sp
        return whole[:, self.groups.sp_rank * chunk : (self.groups.sp_rank + 1) * chunk].contiguous()

    def _share_prefix(self, module: StageModule, plex: Multiplex, action: Action, rows: int) -> None:
        """The group starts mid-sequence: the stage's rank broadcasts the cached K/V before the subsequence."""
        owner = action.stage == self.groups.pp_rank
        o = plex.sub_offset
        for core in subsequence_cores(module):
            cache = core.cache
            if owner:
                both = torch.stack([cache.k[:, :, :o], cache.v[:, :, :o]])
            else:
                shape = self._kv_shape(module, rows, o)
                both = torch.empty(shape, dtype=_kv_dtype(module), device=_device(module))
            dist.broadcast(both, src=self._global(action.stage), group=plex.group)
            if not owner:
                cache.write(0, both[0], both[1])

    def _return_prefix_grads(self, module: StageModule, plex: Multiplex, action: Action) -> None:
        """After the group's last backward, the dK/dV its queries gave the prefix go to the stage's rank."""
        owner = action.stage == self.groups.pp_rank
        o = plex.sub_offset
        for core in subsequence_cores(module):
            dk, dv = core.cache.grad_buffers()
            both = torch.stack([dk[:, :, :o], dv[:, :, :o]])
            dist.reduce(both, dst=self._global(action.stage), group=plex.group)
            if owner:
                dk[:, :, :o].copy_(both[0])
                dv[:, :, :o].copy_(both[1])
            else:  # handed over: never count them twice
                dk[:, :, :o].zero_()
                dv[:, :, :o].zero_()

    def _kv_shape(self, module: StageModule, rows: int, length: int) -> tuple[int, ...]:
        """[k|v, B, G/sp, length, Dh]: the head-sharded cache layout."""
        config = module.model.config
        return 2, rows, config.n_query_groups // self.groups.sp, length, config.head_size

    def _global(self, stage: int) -> int:
        return self.groups.pp_global_ranks[stage]


def _dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _kv_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype K/V come out in: autocast's, when it is on, else the weights'."""
    device = _device(module).type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else _dtype(module)


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: Tensor, targets: list[Tensor]) -> None:
    start = 0
    for t in targets:
        t.copy_(flat[start : start + t.numel()].view_as(t))
        start += t.numel()


def _add_gradients(params: list[Tensor], total: Tensor) -> None:
    """Add full-size gradients (summed over this rank's helpers) to the stage's gradients.

    Under FSDP every rank of the stage holds helpers' sums for its own (dp, sp) column: sum them over the
    stage's shard group, then keep this rank's shard, as FSDP's reduce-scatter does with its own.
    """
    sharded = [p for p in params if isinstance(p, DTensor)]
    if sharded:
        dist.all_reduce(total, group=sharded[0].device_mesh.get_group())
    start = 0
    for p in params:
        full = total[start : start + p.numel()].view(p.shape).to(p.dtype)
        start += p.numel()
        if isinstance(p, DTensor):
            full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        if p.grad is None:
            p.grad = full.clone()
        else:
            p.grad.add_(full)
