"""Recompute in backward what is cheaper to recompute than to keep (activation checkpointing per block).

Per token a block saves for backward about 4.5 MB in an 8B model; recompute keeps far less and runs the block's
forward again in its backward:

``"full"``       keeps the block's input and the subsequence's RoPE tables; the attention forward runs again too,
                 over the same prefix of the K/V cache (the K/V themselves are kept there already, level 1).
``"selective"``  keeps, besides, the attention core's output and log-sum-exp, the one part that costs more to run
                 again than to keep: norms, projections, RoPE and the MLP are recomputed, the attention kernel is not.

What is kept is saved through ``ctx.save_for_backward`` of one autograd Function per block call (the reentrant
style), so the offloader's ``saved_tensors_hooks`` see it and send a share alpha of it to host memory like any
other activation: recompute and offload stack. (``torch.utils.checkpoint``'s non-reentrant mode would pack the kept
tensors with its own hooks, out of the offloader's sight.) In backward the block runs again under the forward's
autocast state, the attention core replays instead of writing its cache again (``AttentionReplay``), and one
nested ``torch.autograd.backward`` gives the input gradient and accumulates the weight gradients where they
always go (FSDP2's post-backward hook sees them as usual). Without grad (evaluation) the block runs as is.

The block's forward is replaced on the instance, so the model's classes and parameter names stay those of the
plain model, and ``fully_shard`` applied later still wraps the call: FSDP2 unshards before this forward, and its
pre-backward hook on the block's output runs before this backward.

The "sppo" schedule's shared units run on meta shells whose weights stream in one piece at a time
(``runtime.streaming``); ``recompute_shared_block`` recomputes such a block with the same Function. Its weights are
the piece's streamed leaves (back on the device when the block's backward runs: ``runtime.streaming``'s boundary
brings them first), its attention is the unit's group attention (``parallel.multiplex.UnitAttention``), which is told
it is replayed: under "selective" it returns the output it kept instead of attending again, under "full" the whole
group attends again (every member recomputes the same block in the same backward, so the exchanges pair up). The
nested backward accumulates the weights' gradients where the stream's hooks send them to the owner.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_sppo.attention.kv_cache import KVCache
from lightning_sppo.attention.subsequence import AttentionReplay, SubsequenceAttention
from lightning_sppo.documents import Documents
from lightning_sppo.model.gpt import Block

__all__ = ["RECOMPUTE_MODES", "RecomputeMode", "ReplayableAttention", "apply_recompute", "recompute_shared_block"]

RecomputeMode = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)


def apply_recompute(model: nn.Module, mode: RecomputeMode) -> nn.Module:
    """Make every block of ``model`` recompute per ``mode`` in backward; returns ``model``.

    Idempotent; ``"none"`` restores the plain forward. Apply it before ``fully_shard`` or after, either works.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"Unknown recompute={mode!r}; choose one of {list(RECOMPUTE_MODES)}.")
    for block in (m for m in model.modules() if isinstance(m, Block)):
        block.__dict__.pop("forward", None)  # back to the class's forward
        block.__dict__.pop("recompute", None)
        if mode != "none":
            block.recompute = mode
            block.forward = types.MethodType(_recomputing_forward, block)
    return model


def _recomputing_forward(
    block: Block, x: Tensor, cos: Tensor, sin: Tensor, offset: int = 0, documents: Documents | None = None
) -> Tensor:
    call = _BlockCall(block, offset, documents, tuple(core.cache for core in _cores(block)))
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in block.parameters())):
        return call.run(x, cos, sin)  # nothing to differentiate: nothing to keep either
    return _RecomputeBlock.apply(call, x, cos, sin)


def _cores(block: nn.Module) -> list[SubsequenceAttention]:
    """The block's subsequence cores (inside Ulysses' wrapper, where there is one); looked up per call."""
    return [m for m in block.modules() if isinstance(m, SubsequenceAttention)]


@dataclass(frozen=True)
class _BlockCall:
    """One call of a block: what its forward takes besides the tensors the Function keeps, and the caches its cores
    had (in a pipeline with several micro-batches in flight, another micro-batch's may be bound at its backward)."""

    block: Block
    offset: int
    documents: Documents | None
    caches: tuple[KVCache | None, ...]

    @property
    def keeps_attention(self) -> bool:
        return self.block.recompute == "selective"

    def cores(self) -> list[SubsequenceAttention]:
        return _cores(self.block)

    def run(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The plain block forward (the class's, which FSDP2's subclass inherits)."""
        return type(self.block).forward(self.block, x, cos, sin, self.offset, self.documents)

    def replaying(self, replays: list[AttentionReplay]):
        return _replay(self.cores(), replays, list(self.caches))


class ReplayableAttention(Protocol):
    """A shared unit's attention that a recomputing block can replay (``parallel.multiplex.UnitAttention``)."""

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, kernel: Any, documents: Documents | None = None,
        replay: AttentionReplay | None = None,
    ) -> Tensor: ...  # fmt: skip


def recompute_shared_block(
    mode: RecomputeMode, block: Block, weights: Mapping[str, Tensor], x: Tensor, cos: Tensor, sin: Tensor, offset: int,
    documents: Documents | None, attention: Sequence[ReplayableAttention],
) -> Tensor:  # fmt: skip
    """A shell block of a shared unit (module docstring), recomputed per ``mode`` in backward: ``weights`` by name in
    ``block`` (the piece's streamed leaves), ``attention`` the unit's attention of each of its cores, ``offset``
    this rank's first token. Without grad, or under "none", the block simply runs."""
    call = _SharedBlockCall(block, weights, offset, documents, tuple(attention), mode)
    if mode == "none" or not torch.is_grad_enabled():
        with call.replaying([None] * len(call.attention)):
            return call.run(x, cos, sin)
    return _RecomputeBlock.apply(call, x, cos, sin)


@dataclass(frozen=True)
class _SharedBlockCall:
    """One call of a shared unit's shell block: its streamed weights, and its cores attending with the group."""

    block: Block
    weights: Mapping[str, Tensor]
    offset: int
    documents: Documents | None
    attention: tuple[ReplayableAttention, ...]
    mode: RecomputeMode

    @property
    def keeps_attention(self) -> bool:
        return self.mode == "selective"

    def cores(self) -> list[SubsequenceAttention]:
        return _cores(self.block)

    def run(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return functional_call(self.block, dict(self.weights), (x, cos, sin, self.offset, self.documents))

    @contextmanager
    def replaying(self, replays: list[AttentionReplay | None]) -> Iterator[None]:
        """Each core attends with the group, told it is replayed (or not, without a replay), for this call only."""
        cores = self.cores()
        for core, attention, replay in zip(cores, self.attention, replays, strict=True):
            core.shared = attention if replay is None else _Replayed(attention, replay)
        try:
            yield
        finally:
            for core in cores:
                core.shared = None


@dataclass(frozen=True)
class _Replayed:
    """A shared attention with the replay its recomputing block gives it (the core itself never replays)."""

    attention: ReplayableAttention
    replay: AttentionReplay

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kernel: Any, documents: Documents | None = None) -> Tensor:
        return self.attention.attend(q, k, v, kernel, documents, replay=self.replay)


@contextmanager
def _replay(
    cores: list[SubsequenceAttention], replays: list[AttentionReplay], caches: list[KVCache | None] | None = None
) -> Iterator[None]:
    """Each core runs with its replay set and, given ``caches``, with the cache it had in forward bound again (in a
    pipeline with several micro-batches in flight, another micro-batch's caches may be bound when this runs)."""
    bound = [core.cache for core in cores]
    for core, replay, cache in zip(cores, replays, caches or bound, strict=True):
        if core.replay is not None:
            raise RuntimeError("A block's attention core is already replaying: blocks do not nest.")
        core.replay, core.cache = replay, cache
    try:
        yield
    finally:
        for core, cache in zip(cores, bound, strict=True):
            core.replay, core.cache = None, cache


class _RecomputeBlock(torch.autograd.Function):
    """A block whose backward runs its forward again from what ``forward`` kept (module docstring)."""

    @staticmethod
    def forward(ctx: Any, call: _BlockCall, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        replays = [AttentionReplay(keep=call.keeps_attention) for _ in call.cores()]
        with call.replaying(replays):
            y = call.run(x, cos, sin)  # autograd is off inside a Function's forward: nothing is saved
        kept = [replay.kept for replay in replays]
        ctx.has_kept = [k is not None for k in kept]
        ctx.save_for_backward(x, cos, sin, *(t for pair in kept if pair is not None for t in pair))
        ctx.call = call
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, cos, sin, replays = _restored(ctx)
        call, (device, dtype, enabled) = ctx.call, ctx.autocast
        x = x.detach().requires_grad_(ctx.needs_input_grad[1])
        autocast = torch.autocast(device, dtype, enabled=enabled, cache_enabled=False)
        with torch.enable_grad(), autocast, call.replaying(replays):
            y = call.run(x, cos, sin)
        torch.autograd.backward(y, dy)
        return None, x.grad if x.requires_grad else None, None, None


def _restored(ctx: Any) -> tuple[Tensor, Tensor, Tensor, list[AttentionReplay]]:
    """What ``_RecomputeBlock.forward`` kept: the block's input, RoPE tables, and each core's replay."""
    x, cos, sin, *flat = ctx.saved_tensors
    kept = iter(zip(flat[0::2], flat[1::2], strict=True))
    return x, cos, sin, [AttentionReplay(replaying=True, kept=next(kept) if has else None) for has in ctx.has_kept]
