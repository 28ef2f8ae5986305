"""Shared units of the "sppo" schedule on one rank: multiplexed sequence partitioning at run time.

A shared action (``F0.1[2:2,3]``: stage 2's forward of unit (0, 1), computed by ranks 2 and 3) runs on every rank
of its group at once, on the same column (dp, sp coordinate) of each member's stage. What each member holds, and
what moves between them (``parallel.multiplex`` for attention, ``runtime.streaming`` for weights):

tokens      the owner's SP chunk of the unit (c tokens) is cut into one contiguous block per member (``block_lengths``);
            the owner scatters the blocks' hidden states (or their output gradients) to the members and gathers
            their outputs (or input gradients) back, so the unit enters and leaves the pipeline on the owner as usual
weights     one piece (embedding, block, head) at a time on a meta-device shell of the stage, streamed from the owner
            just before use and freed after it, the next piece prefetched; each piece's weight gradients go back to
            the owner right after the piece's backward and are added to the stage's gradients, sharded or not
attention   Ulysses by K/V group across the group: each member attends all the unit's tokens for its heads, with the
            prefix of its heads streamed from the owner's cache for that layer; with fewer K/V groups than members,
            by query rows too (each member a range of rows of one group); the unit's K/V land in the owner's
            cache, and in backward the owner's dK/dV buffers give and take each member's share
activations each member keeps the saved activations of its block (and of its heads' attention) from forward to
            backward; with offloading on, ``hooks`` (a second offloader, policy "full") send them to host memory
            and bring them back before the unit's backward, prefetching the group's previous unit meanwhile.
            Under ``recompute`` each block keeps only its input (and, "selective", its output and log-sum-exp)
            and runs again in its backward, with the piece's weights back (``lightning_sppo.recompute``)
K/V spill   with ``kv_device_tokens`` set, the owner's prefix reaches the members in chunks of ``kv_chunk_tokens``,
            each read from its cache (a host chunk copied in while the previous one is used) and dropped after
            (``parallel.prefix_stream``); nobody holds a whole layer's prefix
host state  with ``model_state="host"`` the owner's pieces are copied in from its host shards before they travel,
            and the gradients the members send back are added to the host gradients FSDP2 keeps there

So a helper never holds another stage: one piece's weights being computed with and the next one arriving, one
layer's K/V of its heads, and the activations of its own share of the unit.

Packed documents: every member has the micro-batch's documents (the batch is the same on every rank of a dp group).
Its tokens take their RoPE positions from them (restarting at each document), and the unit's attention applies the
rule of a subsequence at the unit's offset (``parallel.multiplex``): within each document, and over the owner's
cached prefix only for rows whose document began before the unit, from that document's start.

Shape legend: B micro-batch rows, c tokens of the unit on one SP rank, b_r member r's tokens of it, D hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_sppo.attention import subsequence_cores
from lightning_sppo.model.gpt import rope_cos_sin, rope_cos_sin_at
from lightning_sppo.parallel.exchange import exchange
from lightning_sppo.parallel.multiplex import UnitAttention, block_lengths
from lightning_sppo.recompute import RecomputeMode, recompute_shared_block
from lightning_sppo.runtime.caches import CachePool
from lightning_sppo.runtime.hooks import SubsequenceHooks
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.runtime.streaming import (
    Chunking,
    PieceInputs,
    PieceStream,
    StagePiece,
    block_tables,
    piece_boundary,
    run_piece,
)
from lightning_sppo.schedule import Action, Op
from lightning_sppo.schedule.msp import sharing_groups

__all__ = ["SharedUnits"]


@dataclass
class _Unit:
    """My share of a shared unit between its forward and its backward: one graph through all its pieces."""

    input: Tensor  # token ids, or hidden states as a leaf that collects their gradient
    output: Tensor  # with the graph (the loss share after the head)


@dataclass(frozen=True)
class _Place:
    """Where my block sits in a shared unit."""

    index: int  # my position in the group
    owner: int  # the stage's rank's position in the group
    offset: int  # o: the unit's first token
    blocks: tuple[int, ...]  # b_r: each member's tokens in each SP chunk
    start: int  # my first token in the sequence

    @property
    def length(self) -> int:
        return self.blocks[self.index]


class SharedUnits:
    """The shared actions of one rank: stage shells, their weight streams, the group process groups, the data moves.

    ``build_shell(stage)`` returns that stage's ``StageModule`` on the meta device (subsequence attention and
    Ulysses applied, no memory). ``groups`` is the runtime's ``PipelineGroups``; ``pool`` the K/V caches of this
    rank's own stage (its spill, if any, decides how the owner's prefix travels); ``activation_dtype()`` the dtype of
    the hidden states between stages (what the runtime sends), which the shells compute in. ``hooks`` see every shared
    unit this rank takes part in, keyed ``(stage * M + micro-batch, subsequence)`` so that one stage's consecutive units
    of a micro-batch are neighbours (the offloader prefetches the previous one during a backward). ``recompute``: what
    the shells' blocks recompute in backward (``lightning_sppo.recompute``), as the stage's own blocks do. ``device``:
    where the units compute (the stage's parameters may live in host memory, ``model_state="host"``).
    """

    def __init__(
        self,
        stage: StageModule,
        pool: CachePool,
        groups,
        build_shell: Callable[[int], StageModule],
        activation_dtype: Callable[[], torch.dtype],
        hooks: SubsequenceHooks | None = None,
        recompute: RecomputeMode = "none",
        device: torch.device | None = None,
    ) -> None:
        self.stage, self.pool, self.groups, self.activation_dtype = stage, pool, groups, activation_dtype
        self.hooks, self.recompute = hooks, recompute
        self.device = device or next(stage.parameters()).device
        me, pp = groups.pp_rank, groups.pp
        self.process_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        # Every process creates every group, once, in the same order (stage 0's Left is the last stage's Right).
        for ranks in dict.fromkeys(ranks for _, ranks in sharing_groups(pp)):
            columns = [[column[r] for r in ranks] for column in groups.columns]
            mine, _ = dist.new_subgroups_by_enumeration(columns, group_desc="sppo_sharing")
            if me in ranks:
                self.process_groups[ranks] = mine
        chunking = _chunking(stage, groups)
        device, dtype = self.device, activation_dtype()
        own = dict(stage.named_parameters())
        helped = sorted({s for s, ranks in sharing_groups(pp) if me in ranks})
        self.streams = {
            s: PieceStream(build_shell(s), dtype, device, chunking, own if s == me else None) for s in helped
        }
        self._units: dict[Action, _Unit] = {}

    # -- per step ---------------------------------------------------------------------------------

    def begin_step(self, spans: list[tuple[int, int]]) -> None:
        self._units.clear()
        if self.hooks is not None:
            self.hooks.begin_step(spans)

    def end_step(self) -> None:
        """After the step's last action: every shared unit ran its backward."""
        if self._units:
            raise RuntimeError(f"Shared units without their backward at the end of the step: {sorted(self._units)}.")

    def after_action(self) -> None:
        """Any action ended: the device copies of a shared unit's finished offload can go (the offloader would keep
        them until its next shared unit, which may be far away)."""
        release = getattr(self.hooks, "release_copies", None)
        if release is not None:
            release()

    def close(self) -> None:
        """The step is over (also after an exception): release the hooks' per-step state."""
        self._units.clear()
        if self.hooks is not None:
            self.hooks.end_step()

    # -- actions ----------------------------------------------------------------------------------

    def forward(self, step, action: Action) -> None:
        """My block of a shared forward; the stage's rank ends with the unit's output chunk in ``step.outputs``."""
        stream, group, owner = self._stream(action)
        shell = stream.shell
        place = self._place(step, action)
        x = self._block_input(step, action, place)
        cores = subsequence_cores(shell)
        caches = self._owner_caches(action)
        device_tokens, chunk_tokens = self.pool.settings()
        spill = None if device_tokens is None else (device_tokens, chunk_tokens)
        attention = {
            id(core): UnitAttention(
                group,
                place.index,
                place.owner,
                place.offset,
                place.blocks,
                self.groups.sp,
                caches[layer] if caches else None,
                self.pool.grad_dtype,
                spill,
            )  # fmt: skip
            for layer, core in enumerate(cores)
        }
        inputs = self._piece_inputs(step, action, place)
        key = self._key(step, action)
        with self.hooks.forward_context(key) if self.hooks else nullcontext():
            hidden = self._forward_pieces(stream, group, owner, x, inputs, attention)
        if self.hooks:
            self.hooks.after_forward(key)
        self._units[action] = _Unit(x, hidden)
        if shell.is_last:
            step.losses.append(hidden.detach())
        else:
            whole = self._collect(step, action, place, hidden.detach())
            if whole is not None:
                step.outputs[action.unit] = whole

    def _forward_pieces(
        self, stream: PieceStream, group: dist.ProcessGroup, owner: int, x: Tensor, inputs: PieceInputs,
        attention: dict[int, UnitAttention],
    ) -> Tensor:  # fmt: skip
        """Each piece with its weights streamed in (the next one arriving meanwhile), one graph through all of them
        (so their inputs are ordinary activations, offloadable); returns the last piece's output."""
        stream.fetch(0, group, owner)
        hidden = x
        with _uncached_autocast(self._device):
            for index, piece in enumerate(stream.pieces):
                hidden = self._forward_piece(stream, group, owner, index, piece, hidden, inputs, attention)
        return hidden

    def _forward_piece(
        self, stream: PieceStream, group: dist.ProcessGroup, owner: int, index: int, piece: StagePiece, hidden: Tensor,
        inputs: PieceInputs, attention: dict[int, UnitAttention],
    ) -> Tensor:  # fmt: skip
        """One piece: wait for its weights, start the next piece's, compute, free the weights."""
        weights = stream.weights(index)
        if index + 1 < len(stream.pieces):
            stream.fetch(index + 1, group, owner)  # arrives while this piece computes
        if piece.kind == "block":  # its cores attend with the group (and the block may recompute in backward)
            shares = [attention[id(core)] for core in subsequence_cores(piece.module)]
            cos, sin = block_tables(hidden, inputs)
            out = recompute_shared_block(
                self.recompute, piece.module, weights, hidden, cos, sin, inputs.start, inputs.documents, shares
            )
        else:
            out = run_piece(piece, weights, hidden, inputs)
        del weights
        stream.release(index)
        return piece_boundary(out, stream, index)

    def backward(self, step, action: Action, backward: Callable[[Tensor], None] | None) -> None:
        """My block of a shared backward; the stage's rank ends with the input gradient chunk to send back."""
        stream, group, owner = self._stream(action)
        shell = stream.shell
        unit = self._units.pop(action._replace(op=Op.F))
        place = self._place(step, action)
        is_owner = action.stage == self.groups.pp_rank
        grad = None
        if not shell.is_last:
            grad = self._spread(step, action, place, step.grads.pop(action.unit) if is_owner else None)
        key = self._key(step, action)
        if self.hooks:
            self.hooks.before_backward(key)
        # One backward through every piece: each boundary brings its piece's weights back just before the piece's
        # backward, and each piece's weight gradient leaves for the owner as soon as it is complete.
        stream.begin_backward(group, owner)
        if grad is None:
            (backward or Tensor.backward)(unit.output)  # the loss share
        else:
            torch.autograd.backward(unit.output, grad_tensors=grad)
        stream.end_backward()
        grad = unit.input.grad if unit.input.requires_grad else None
        del unit
        if self.hooks:
            self.hooks.after_backward(key)
        if is_owner:
            step.outputs.pop(action.unit, None)
        if not shell.is_first:
            whole = self._collect(step, action, place, grad)
            if whole is not None:
                step.inputs[action.unit].grad = whole

    # -- layout -----------------------------------------------------------------------------------

    def _stream(self, action: Action) -> tuple[PieceStream, dist.ProcessGroup, int]:
        """The stage's stream, the group's process group, and the owner's global rank in my column."""
        return (
            self.streams[action.stage],
            self.process_groups[action.group],
            self.groups.pp_global_ranks[action.stage],
        )

    def _key(self, step, action: Action) -> tuple[int, int]:
        """The unit's key for ``hooks``: one stage's units of one micro-batch are consecutive."""
        return action.stage * step.plan.num_microbatches + action.microbatch, action.subsequence

    def _place(self, step, action: Action) -> _Place:
        offset, length = step.plan.spans[action.subsequence]
        chunk = length // self.groups.sp
        blocks = tuple(block_lengths(chunk, len(action.group)))
        index = action.group.index(self.groups.pp_rank)
        start = offset + self.groups.sp_rank * chunk + sum(blocks[:index])
        return _Place(index, action.group.index(action.stage), offset, blocks, start)

    def _piece_inputs(self, step, action: Action, place: _Place) -> PieceInputs:
        shell = self.streams[action.stage].shell
        rows = step.rows(action.microbatch)
        documents = step.documents(action.microbatch)
        if documents is None:
            cos, sin = rope_cos_sin(shell.model.config, place.start, place.length, device=self._device)
        else:  # positions restart at each document
            cos, sin = rope_cos_sin_at(shell.model.config, documents.positions(place.start, place.length))
        targets = step.targets[rows, place.start : place.start + place.length] if shell.is_last else None
        return PieceInputs(place.start, cos, sin, targets, step.normalizer, shell.loss_chunk_tokens, documents)

    def _owner_caches(self, action: Action) -> list | None:
        """The own stage's caches of the action's micro-batch, per layer (the owner only)."""
        if action.stage != self.groups.pp_rank:
            return None
        self.pool.bind(action.microbatch)
        return [core.cache for core in subsequence_cores(self.stage)]

    # -- data moves -------------------------------------------------------------------------------

    def _block_input(self, step, action: Action, place: _Place) -> Tensor:
        """Token ids of my block (first stage), or its hidden states as a leaf, scattered from the owner."""
        if self.streams[action.stage].shell.is_first:
            return step.input_ids[step.rows(action.microbatch), place.start : place.start + place.length]
        owned = step.inputs[action.unit] if action.stage == self.groups.pp_rank else None
        return self._spread(step, action, place, owned).detach().requires_grad_()

    def _spread(self, step, action: Action, place: _Place, owned: Tensor | None) -> Tensor:
        """The owner's [B, c, D] (None elsewhere) -> my block [B, b_me, D] on every member."""
        sends: list[list[Tensor]] = [[] for _ in place.blocks]
        if owned is not None:
            owned = owned.detach()
            sends = [[block] for block in owned.split(list(place.blocks), dim=1)]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in place.blocks]
        shapes[place.owner] = [(step.batch, place.length, self._width)]
        got = exchange(sends, shapes, self._group(action), self.activation_dtype(), self._device)
        return got[place.owner][0]

    def _collect(self, step, action: Action, place: _Place, piece: Tensor) -> Tensor | None:
        """Every member's [B, b_r, D] -> the unit's [B, c, D] on the owner (None elsewhere)."""
        sends: list[list[Tensor]] = [[] for _ in place.blocks]
        sends[place.owner] = [piece.to(self.activation_dtype())]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in place.blocks]
        if place.index == place.owner:
            shapes = [[(step.batch, b, self._width)] for b in place.blocks]
        got = exchange(sends, shapes, self._group(action), self.activation_dtype(), self._device)
        if place.index != place.owner:
            return None
        return torch.cat([pieces[0] for pieces in got], dim=1)

    def _group(self, action: Action) -> dist.ProcessGroup:
        return self.process_groups[action.group]

    @property
    def _width(self) -> int:
        return self.stage.model.config.n_embd

    @property
    def _device(self) -> torch.device:
        return self.device


def _uncached_autocast(device: torch.device):
    """Autocast as the step has it, but without its weight cache: streamed weights are leaves that require grad,
    which autocast would otherwise keep a low-precision copy of until the step's end (a replica of every stage)."""
    if not torch.is_autocast_enabled(device.type):
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type), cache_enabled=False)


def _chunking(stage: StageModule, groups) -> Chunking:
    """How the stage's weights are sharded (FSDP2 over dp x sp, or not): the layout pieces travel in.

    Every stage is built alike, so a helper reads the layout off its own stage.
    """
    sharded = [p for p in stage.parameters() if isinstance(p, DTensor)]
    if not sharded:
        return Chunking()
    dp_group, sp_group = groups.dp_group, groups.sp_group
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    sp = groups.sp
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    chunking = Chunking(dp, sp, dp_rank, groups.sp_rank, dp_group, sp_group)
    mesh = sharded[0].device_mesh
    if mesh.size() != chunking.chunks or mesh.get_local_rank() != chunking.index:
        raise RuntimeError(
            f"The stage is sharded over {mesh.size()} ranks (this one's shard {mesh.get_local_rank()}), but the sppo"
            f" schedule expects FSDP over dp x sp = {chunking.chunks} with shard dp_rank * sp + sp_rank ="
            f" {chunking.index}; build the stage with lightning_sppo.parallel.parallelize_gpt."
        )
    return chunking
