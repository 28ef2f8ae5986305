"""A stage's weights streamed one piece at a time to the members of a shared unit, and their gradients back.

A *piece* is what a shared unit computes with one set of weights: the embedding (first stage), each block, the
final norm with the head (last stage). The members of a unit (the stage's own rank, "the owner", and helpers of
other stages) run it piece by piece on a *shell* of the stage: the stage's modules on the meta device, which hold
no memory. Before a piece runs, its weights arrive in one flat buffer whose storage is freed right after the piece
(``untyped_storage().resize_(0)``, as FSDP2 frees unsharded weights); the piece's parameters are leaves that require
grad and share that storage (``Tensor.set_``), so the unit's graph survives the free: in backward the same weights
arrive again into the same storage, and the saved parameters see them. Each parameter collects its own gradient
(views of one flat leaf would each materialise a piece-sized zero gradient); once every parameter of a piece has
its gradient (post-accumulate hooks), the piece's gradient leaves for the owner.
The next piece's transfer is started before the current one computes (prefetch), in the same order on every
member, so NCCL's one-queue-per-group rule holds.

On the wire the layout is FSDP2's: each parameter cut into W = dp x sp row chunks (``torch.chunk``, padded), the
owner's SP rank j of data-parallel replica d holding chunk k = d sp + j of every parameter. A piece travels as

    owner (d, j)   its chunks (k for every d', gathered over its dp group when dp > 1), cast to the compute dtype
    column (d, j)  broadcast to the unit's group: 1 / sp of the piece per rank (the slow link, prefetched)
    members        all-gather over their own SP group (inside a node), unpack into the piece's natural layout

and a piece's gradient goes back the same way in reverse: every member packs its fp32 gradient, reduce-scatters it
over its SP group, reduces its chunk to the column's owner (asynchronously; waited one piece later), and the owner
reduce-scatters over dp and adds the chunk to its parameters' (sharded) gradients. With dp x sp = 1 the chunk is
the whole piece: one broadcast in, one reduce out. So no rank ever holds another stage: at most the piece it
computes and the next one arriving, and one piece's gradient on its way out.

Shape legend: W = dp x sp chunks; per parameter d0 rows of ``rest`` elements, ch = ceil(d0 / W) rows per chunk;
S elements of one chunk of the whole piece (sum over its parameters of ch x rest).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from lightning_sppo.documents import Documents
from lightning_sppo.loss import chunked_cross_entropy
from lightning_sppo.runtime.stage import StageModule

__all__ = [
    "Chunking",
    "PieceInputs",
    "PieceStream",
    "StagePiece",
    "block_tables",
    "piece_boundary",
    "run_piece",
    "stage_pieces",
]


@dataclass(frozen=True)
class StagePiece:
    """One piece of a stage: which of its modules run, and the parameters they use (names in the stage)."""

    kind: Literal["embedding", "block", "head"]
    module: nn.Module
    """The embedding, the block, or the stage's model (for the head: its final norm and head)."""
    names: tuple[str, ...]
    """Parameter names in the ``StageModule`` (``model.blocks.3.attn.qkv.weight``), in flat-buffer order."""
    local: tuple[str, ...]
    """The same names relative to ``module``."""
    shapes: tuple[torch.Size, ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


def stage_pieces(stage: StageModule) -> list[StagePiece]:
    """The pieces of ``stage`` in forward order: embedding (first stage), blocks, final norm and head (last)."""
    model = stage.model
    pieces = []
    if model.wte is not None:
        pieces.append(_piece("embedding", model.wte, "model.wte."))
    for name, block in model.blocks.items():
        pieces.append(_piece("block", block, f"model.blocks.{name}."))
    if model.lm_head is not None:
        named = [(f"norm_f.{n}", p) for n, p in model.norm_f.named_parameters()]
        named += [(f"lm_head.{n}", p) for n, p in model.lm_head.named_parameters()]
        pieces.append(
            StagePiece(
                "head",
                model,
                tuple(f"model.{n}" for n, _ in named),
                tuple(n for n, _ in named),
                tuple(p.shape for _, p in named),
            )  # fmt: skip
        )
    return pieces


def _piece(kind: Literal["embedding", "block"], module: nn.Module, prefix: str) -> StagePiece:
    named = list(module.named_parameters())
    return StagePiece(
        kind, module, tuple(prefix + n for n, _ in named), tuple(n for n, _ in named), tuple(p.shape for _, p in named)
    )


@dataclass(frozen=True)
class PieceInputs:
    """What a piece needs besides its input and weights: positions of this rank's tokens, and the loss terms."""

    start: int
    """Position of this rank's first token in the sequence (RoPE, and the attention core's offset)."""
    cos: Tensor
    sin: Tensor
    """RoPE tables of this rank's tokens: [n, n_rope], or [B, 1, n, n_rope] with packed documents."""
    targets: Tensor | None = None
    normalizer: Tensor | None = None
    loss_chunk_tokens: int | None = None
    documents: Documents | None = None
    """The micro-batch's packed documents (whole sequence), or None."""


def run_piece(piece: StagePiece, weights: Mapping[str, Tensor], x: Tensor, inputs: PieceInputs) -> Tensor:
    """The piece's forward with ``weights`` (names relative to ``piece.module``), as ``StageModule`` runs it."""
    if piece.kind == "embedding":
        return functional_call(piece.module, dict(weights), (x,))
    if piece.kind == "block":
        cos, sin = block_tables(x, inputs)
        return functional_call(piece.module, dict(weights), (x, cos, sin, inputs.start, inputs.documents))
    norm = {name.removeprefix("norm_f."): w for name, w in weights.items() if name.startswith("norm_f.")}
    hidden = functional_call(piece.module.norm_f, norm, (x,))
    head = weights["lm_head.weight"]
    return chunked_cross_entropy(hidden, head, inputs.targets, inputs.normalizer, inputs.loss_chunk_tokens)


def block_tables(x: Tensor, inputs: PieceInputs) -> tuple[Tensor, Tensor]:
    """RoPE's tables for a block piece: a sharded stage's blocks cast their floating inputs to the gathered weights'
    dtype (FSDP mixed precision); the hidden states already have it, the tables follow them. fp32 and autocast keep
    fp32 tables."""
    return inputs.cos.to(x.dtype), inputs.sin.to(x.dtype)


@dataclass(frozen=True)
class Chunking:
    """How the stage's weights are cut on the wire: FSDP2's W = dp x sp row chunks (1 x 1 when not sharded)."""

    dp: int = 1
    sp: int = 1
    dp_rank: int = 0
    sp_rank: int = 0
    dp_group: dist.ProcessGroup | None = None
    sp_group: dist.ProcessGroup | None = None

    @property
    def chunks(self) -> int:
        return self.dp * self.sp

    @property
    def index(self) -> int:
        """k = d sp + j: this rank's chunk, as FSDP2's flattened (dp, sp) mesh numbers it."""
        return self.dp_rank * self.sp + self.sp_rank


@dataclass
class _Layout:
    """One piece on the wire: per parameter its rows, chunk rows and row size; S elements per chunk."""

    rows: list[int]
    chunk_rows: list[int]
    row_size: list[int]
    offsets: list[int]
    """Where each parameter starts in the natural flat buffer."""

    @property
    def chunk_numel(self) -> int:
        return sum(c * r for c, r in zip(self.chunk_rows, self.row_size, strict=True))

    @classmethod
    def of(cls, shapes: tuple[torch.Size, ...], chunks: int) -> _Layout:
        rows = [shape[0] if len(shape) else 1 for shape in shapes]
        row_size = [math.prod(shape[1:]) if len(shape) else 1 for shape in shapes]
        offsets = [0]
        for r, n in zip(rows, row_size, strict=True):
            offsets.append(offsets[-1] + r * n)
        return cls(rows, [math.ceil(r / chunks) for r in rows], row_size, offsets[:-1])


@dataclass
class _Arrival:
    """A piece's transfer in flight: the broadcast's work and the buffer it lands in."""

    work: dist.Work | None
    buffer: Tensor


@dataclass
class _Outgoing:
    """A piece's gradient chunk on its way to the owner."""

    piece: int
    work: dist.Work | None
    buffer: Tensor


@dataclass
class PieceStream:
    """One stage's pieces on this rank: their flat buffers (storage held only while used) and the transfers.

    ``source``: on the stage's own rank, its parameters by name (FSDP shards or plain tensors), the weights it
    sends and the gradients it receives; None on helpers. ``dtype``: the dtype pieces compute in (the stage's
    activation dtype: FSDP's param_dtype, or the parameters').
    """

    shell: StageModule
    dtype: torch.dtype
    device: torch.device
    chunking: Chunking
    source: dict[str, Tensor] | None = None
    pieces: list[StagePiece] = field(init=False)
    flats: list[Tensor] = field(init=False)
    """Per piece, its buffer (storage held only while the piece is used)."""
    params: list[list[Tensor]] = field(init=False)
    """Per piece, its parameters: leaves that require grad, on the buffer's storage."""
    _layouts: list[_Layout] = field(init=False)
    _arrivals: dict[int, _Arrival] = field(init=False, default_factory=dict)
    _backward: tuple[dist.ProcessGroup, int] | None = field(init=False, default=None)
    _outgoing: _Outgoing | None = field(init=False, default=None)
    _ready: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.pieces = stage_pieces(self.shell)
        self._layouts = [_Layout.of(p.shapes, self.chunking.chunks) for p in self.pieces]
        self.flats, self.params, self._ready = [], [], [0] * len(self.pieces)
        for index, piece in enumerate(self.pieces):
            flat = torch.empty(piece.numel, dtype=self.dtype, device=self.device)
            params, offset = [], 0
            for shape in piece.shapes:
                param = torch.empty(0, dtype=self.dtype, device=self.device)
                param.set_(flat.untyped_storage(), offset, shape, torch.empty(shape, device="meta").stride())
                param.requires_grad_()
                param.register_post_accumulate_grad_hook(functools.partial(self._parameter_ready, index))
                params.append(param)
                offset += math.prod(shape)
            flat.untyped_storage().resize_(0)
            self.flats.append(flat)
            self.params.append(params)
        if self.source is not None:
            missing = [n for p in self.pieces for n in p.names if n not in self.source]
            if missing:
                raise ValueError(f"The stage lacks parameters its shell has: {missing[:3]}.")

    # -- weights in --------------------------------------------------------------------------------

    def fetch(self, index: int, group: dist.ProcessGroup, owner: int) -> None:
        """Start piece ``index``'s transfer from ``owner`` (a global rank) to the members of ``group``."""
        if index in self._arrivals:
            raise RuntimeError(f"Piece {index} is already on its way.")
        layout, chunking = self._layouts[index], self.chunking
        if chunking.chunks == 1:
            buffer = self._restore(index)  # lands in place: the whole piece is one chunk
            if self.source is not None:
                self._copy_owned(index, buffer)
        else:
            slot = chunking.dp * layout.chunk_numel
            if self.source is not None:
                mine = self._owned(index)
                buffer = mine if chunking.dp == 1 else mine.new_empty(slot)
                if chunking.dp > 1:  # every replica's chunk of my SP column: k = d' sp + j for all d'
                    _all_gather(buffer, mine, chunking.dp_group)
            else:
                buffer = torch.empty(slot, dtype=self.dtype, device=self.device)
        # Into the buffer itself when W = 1 (outside autograd; the parameters on its storage have their own version
        # counters, so the graphs that saved them accept the values that arrive for backward).
        with torch.no_grad():
            work = dist.broadcast(buffer, src=owner, group=group, async_op=True)
        self._arrivals[index] = _Arrival(work, buffer)

    def weights(self, index: int) -> dict[str, Tensor]:
        """Wait for piece ``index`` and return its parameters (names relative to the piece's module)."""
        self.restore(index)
        return dict(zip(self.pieces[index].local, self.params[index], strict=True))

    def restore(self, index: int) -> Tensor:
        """Wait for piece ``index`` and put its weights in its flat buffer (for its forward or its backward)."""
        arrival = self._arrivals.pop(index)
        arrival.work.wait()
        flat = self.flats[index]
        if self.chunking.chunks == 1:
            return flat  # the broadcast wrote into it
        chunking, layout = self.chunking, self._layouts[index]
        slot = arrival.buffer.view(chunking.dp, -1)  # [dp, S]: my column's chunks d sp + j for every d
        del arrival
        self._restore(index)
        with torch.no_grad():
            column = 0
            for rows, chunk_rows, row_size, offset in zip(
                layout.rows, layout.chunk_rows, layout.row_size, layout.offsets, strict=True
            ):
                width = chunk_rows * row_size
                mine = slot[:, column : column + width].reshape(-1)  # one parameter at a time: small temporaries
                gathered = mine
                if chunking.sp > 1:
                    gathered = mine.new_empty(chunking.sp * mine.numel())
                    _all_gather(gathered, mine, chunking.sp_group)
                # [sp, dp, ch, rest] as gathered -> rows in chunk order k = d sp + j
                padded = gathered.view(chunking.sp, chunking.dp, chunk_rows, row_size).transpose(0, 1)
                flat[offset : offset + rows * row_size].view(rows, row_size).copy_(padded.reshape(-1, row_size)[:rows])
                column += width
        return flat

    def release(self, index: int) -> None:
        """Free piece ``index``'s weights (graphs keep its parameters, whose storage is now empty)."""
        self.flats[index].untyped_storage().resize_(0)

    def held_storages(self) -> dict[int, int]:
        """Storages this stream holds now (address -> bytes): piece buffers with storage, parameter gradients,
        transfers in flight."""
        tensors = [*self.flats, *(p.grad for params in self.params for p in params)]
        tensors += [a.buffer for a in self._arrivals.values()]
        tensors += [self._outgoing.buffer] if self._outgoing is not None else []
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        return {ptr: n for ptr, n in held.items() if n}

    def held_bytes(self) -> int:
        return sum(self.held_storages().values())

    def _restore(self, index: int) -> Tensor:
        flat = self.flats[index]
        nbytes = flat.numel() * flat.element_size()
        if flat.untyped_storage().nbytes() != nbytes:
            flat.untyped_storage().resize_(nbytes)
        return flat

    def _copy_owned(self, index: int, flat: Tensor) -> None:
        """The owner's whole piece (W = 1) into its flat buffer, in the compute dtype."""
        layout = self._layouts[index]
        with torch.no_grad():
            for name, rows, row_size, offset in zip(
                self.pieces[index].names, layout.rows, layout.row_size, layout.offsets, strict=True
            ):  # a one-rank FSDP mesh (model state on host) holds the whole tensor as its shard
                flat[offset : offset + rows * row_size].copy_(_local(self.source[name]).reshape(-1))

    def _owned(self, index: int) -> Tensor:
        """The owner's chunk k of piece ``index`` [S]: each parameter's FSDP shard, padded to ch rows."""
        layout = self._layouts[index]
        chunk = torch.zeros(layout.chunk_numel, dtype=self.dtype, device=self.device)
        start = 0
        with torch.no_grad():
            for name, chunk_rows, row_size in zip(
                self.pieces[index].names, layout.chunk_rows, layout.row_size, strict=True
            ):
                local = _local(self.source[name]).reshape(-1)
                chunk[start : start + local.numel()] = local
                start += chunk_rows * row_size
        return chunk

    # -- one unit's backward ---------------------------------------------------------------------------

    def begin_backward(self, group: dist.ProcessGroup, owner: int) -> None:
        """A shared unit's backward is about to run: its last piece's weights start on their way back."""
        self._backward = (group, owner)
        self.fetch(len(self.pieces) - 1, group, owner)

    def end_backward(self) -> None:
        """The unit's backward is over: wait for the first piece's gradient to reach the owner."""
        if self._outgoing is not None:
            self.receive_grads(self._outgoing)
        self._backward = self._outgoing = None

    def _parameter_ready(self, index: int, _param: Tensor) -> None:
        """A parameter of piece ``index`` has its gradient; the last one of the piece completes the piece's."""
        self._ready[index] += 1
        if self._ready[index] == len(self.params[index]):
            self._ready[index] = 0
            self._gradient_ready(index)

    def _gradient_ready(self, index: int) -> None:
        """Piece ``index``'s weight gradient is complete (a post-accumulate hook on its flat buffer): free its weights,
        and send the gradient to the owner once the previous piece's has arrived there."""
        if self._backward is None:
            raise RuntimeError(f"Piece {index} of a shared unit got a gradient outside PieceStream.begin_backward.")
        self.release(index)
        if self._outgoing is not None:  # it travelled while this piece's backward ran
            self.receive_grads(self._outgoing)
        self._outgoing = self.send_grads(index, *self._backward)

    # -- gradients out -------------------------------------------------------------------------------

    def send_grads(self, index: int, group: dist.ProcessGroup, owner: int) -> _Outgoing:
        """Start piece ``index``'s weight gradient (this rank's) on its way to ``owner``; frees the gradient."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params[index]]
        for param in self.params[index]:
            param.grad = None
        chunking = self.chunking
        if chunking.chunks == 1:
            buffer = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        else:
            layout = self._layouts[index]
            buffer = torch.empty((chunking.dp, layout.chunk_numel), dtype=torch.float32, device=self.device)
            column = 0
            for grad, rows, chunk_rows, row_size in zip(
                grads, layout.rows, layout.chunk_rows, layout.row_size, strict=True
            ):  # one parameter at a time: small temporaries
                width = chunk_rows * row_size
                padded = grads[0].new_zeros((chunking.chunks * chunk_rows, row_size), dtype=torch.float32)
                padded[:rows] = grad.view(rows, row_size)
                # chunk order k = d sp + j -> [sp, dp, ch x rest]: SP rank j's part is its column's chunks
                by_column = padded.view(chunking.dp, chunking.sp, width).transpose(0, 1).contiguous()
                del padded
                if chunking.sp > 1:
                    part = by_column.new_empty(chunking.dp * width)
                    _reduce_scatter(part, by_column.view(-1), chunking.sp_group)
                else:
                    part = by_column
                buffer[:, column : column + width] = part.view(chunking.dp, width)
                column += width
            buffer = buffer.view(-1)
        del grads
        work = dist.reduce(buffer, dst=owner, group=group, async_op=True)
        return _Outgoing(index, work, buffer)

    def receive_grads(self, outgoing: _Outgoing) -> None:
        """Wait for a gradient chunk to reach the owner; there, add it to the stage's gradients."""
        outgoing.work.wait()
        if self.source is None:
            return
        chunking, layout = self.chunking, self._layouts[outgoing.piece]
        total = outgoing.buffer
        if chunking.dp > 1:
            mine = total.new_empty(layout.chunk_numel)
            _reduce_scatter(mine, total, chunking.dp_group)
            total = mine
        start = 0
        with torch.no_grad():
            for name, chunk_rows, row_size, rows in zip(
                self.pieces[outgoing.piece].names, layout.chunk_rows, layout.row_size, layout.rows, strict=True
            ):
                param = self.source[name]
                if chunking.chunks == 1:
                    numel = rows * row_size
                    _add_grad(param, total[start : start + numel].view(param.shape))
                    start += numel
                    continue
                local_rows = _local(param).shape[0] if param.dim() else 1
                part = total[start : start + chunk_rows * row_size].view(chunk_rows, row_size)[:local_rows]
                _add_grad(param, part.reshape(_local(param).shape))
                start += chunk_rows * row_size


class _Boundary(torch.autograd.Function):
    """Identity after a piece; in backward, before that piece's backward runs, its weights come back and the previous
    piece's start on their way (so each transfer overlaps the backward of the piece after it)."""

    @staticmethod
    def forward(ctx, x: Tensor, stream: PieceStream, index: int) -> Tensor:
        ctx.stream, ctx.index = stream, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        stream, index = ctx.stream, ctx.index
        stream.restore(index)
        if index > 0:
            stream.fetch(index - 1, *stream._backward)
        return grad, None, None


def piece_boundary(x: Tensor, stream: PieceStream, index: int) -> Tensor:
    """``x`` (piece ``index``'s output), marking where that piece's backward starts (``_Boundary``)."""
    return _Boundary.apply(x, stream, index)


def _all_gather(output: Tensor, piece: Tensor, group: dist.ProcessGroup) -> None:
    """``all_gather_single`` (torch >= 2.12), else its older name; looked up per call, so the recorder sees it."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, piece, group=group)


def _reduce_scatter(output: Tensor, whole: Tensor, group: dist.ProcessGroup) -> None:
    """``reduce_scatter_single`` (torch >= 2.12), else its older name (a sum)."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, whole, group=group)


def _local(param: Tensor) -> Tensor:
    """This rank's rows of a parameter: its FSDP shard, or the whole tensor."""
    return param.to_local() if isinstance(param, DTensor) else param


def _add_grad(param: Tensor, local: Tensor) -> None:
    """Add ``local`` (this rank's rows, fp32) to the parameter's gradient, sharded like it (and where it lives: host
    memory under ``model_state="host"``, where FSDP2 keeps the sharded gradients too)."""
    local = local.to(device=_local(param).device, dtype=param.dtype)
    if param.grad is None:
        if isinstance(param, DTensor):
            param.grad = DTensor.from_local(
                local.clone(), param.device_mesh, param.placements, run_check=False, shape=param.shape,
                stride=param.stride(),
            )  # fmt: skip
        else:
            param.grad = local.clone()
    elif isinstance(param.grad, DTensor):
        param.grad.to_local().add_(local)
    else:
        param.grad.add_(local)
