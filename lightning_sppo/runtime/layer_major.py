"""One batch through the model layer by layer: each layer runs over the whole sequence, chunk by chunk, before the
next one starts (FPDT's order; one pipeline stage), on one device or on several with Ulysses sequence parallelism.

Why: in the subsequence order (``runtime.engine``) every layer's K/V and fp32 dK/dV live from a subsequence's forward
until the step's backward reaches it: 12 d_kv bytes per token and layer, for the whole sequence. Here a layer's K/V
exist only while that layer runs (in its forward, and again, recomputed, in its backward), and its attention
backward takes the K/V chunk by chunk (``attention.chunk_major``), so the device holds one chunk's dK/dV. What the
forward keeps per layer and chunk is the layer's input (``recompute="full"``) and, with ``"selective"``, the
attention output and its log-sum-exp too, so the attention kernel never runs twice. What is kept can go to host
memory (``offload="full"``): every layer's but the last, copied while the forward goes on and brought back chunk by
chunk as the layer above's backward lets go of its own chunks (the device holds one layer's and a chunk).

One step:

1. forward, without a graph: embed every chunk; for each layer, every chunk in order through the block (the core
   writes the chunk's K/V to the layer's cache and attends to the cached prefix), keeping its checkpoint;
2. each chunk's loss, with a graph, and its backward: the gradient of the last hidden states;
3. for each layer, last first:
   a. every chunk in order through the block again, with a graph: the core writes the recomputed K/V to the cache,
      keeps q and hands the block its kept attention output (``"full"``: attends again) as a leaf; the backward of
      the block's output gives that leaf's gradient and the residual's share of the input gradient;
   b. the chunk-major attention backward; as each chunk's dq, dk, dv are final, the projection, q/k norms and RoPE
      of its tokens run again with a graph and take them back to the block's input; its checkpoints are dropped and
      the same chunk of the layer below starts coming back from host;
4. the embedding's backward.

Every recomputed tensor is computed by the same ops from the same inputs as in the forward, and the attention
gradients are exact (``attention.chunk_major``), so the gradients are the plain model's to float rounding.

On several processes (``LayerGroups``): every chunk is split over the sequence-parallel ranks, c/P consecutive
tokens each, and attention runs head-sharded between all-to-alls (``runtime.layer_pass``); the loss of each rank's
tokens is divided by the global batch's valid targets (counted over the data-parallel group), and the step's loss is
summed over every rank that holds a share. The gradients each rank leaves are its share: ``shards`` (FSDP2 over
dp x sp, ``parallel.fsdp_layers``) sums them. ``recompute`` is "selective" or "full" (the order exists to keep per
layer and chunk what a layer needs, and only that).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sppo.attention import (
    KVCache,
    SubsequenceAttention,
    apply_subsequence_attention,
    select_kernel,
    subsequence_cores,
)
from lightning_sppo.attention.chunk_major import chunk_major_backward
from lightning_sppo.attention.kernels import accumulation_dtype
from lightning_sppo.attention.kv_spill import DEFAULT_KV_CHUNK_TOKENS, KVSpill
from lightning_sppo.documents import Documents
from lightning_sppo.loss import chunked_cross_entropy
from lightning_sppo.model.gpt import Block, rope_cos_sin, rope_cos_sin_at
from lightning_sppo.parallel.fsdp_layers import ROOT, LayerShards
from lightning_sppo.runtime.engine import check_batch, count_targets
from lightning_sppo.runtime.layer_pass import ChunkSpans, LayerPass
from lightning_sppo.step_plan import StepPlan, StepSettings, plan_batch

if TYPE_CHECKING:
    from lightning_sppo.offload.streams import CopyEngine, CopyTicket
    from lightning_sppo.offload.units import SavedRef, SavedUnit

__all__ = ["LAYER_MAJOR_OFFLOADS", "LAYER_MAJOR_RECOMPUTE", "BytesMeter", "LayerGroups", "LayerMajorEngine"]

LAYER_MAJOR_RECOMPUTE = ("selective", "full")
LAYER_MAJOR_OFFLOADS = ("none", "full")


class BytesMeter:
    """Bytes of the device tensors it is told of, while they live, and their peak (weak references: a tensor
    counts until it is freed)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._storages: set[int] = set()

    def hold(self, tensor: Tensor) -> Tensor:
        """Count ``tensor``'s storage until ``tensor`` is freed (give the one handle the owner keeps: a view keeps
        its base, and so the storage, alive)."""
        nbytes = tensor.untyped_storage().nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, nbytes)
        return tensor

    def hold_storage(self, tensor: Tensor) -> Tensor:
        """Count ``tensor``'s storage until the storage itself is freed, whatever tensors view it (a detached view
        keeps the storage, not its base tensor, alive); a storage already counted counts once."""
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key not in self._storages:
            self._storages.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free_storage, key, nbytes)  # a storage keeps its Python object
        return tensor

    def reset(self) -> None:
        self.peak = self.live

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def _free_storage(self, key: int, nbytes: int) -> None:
        self._storages.discard(key)
        self.live -= nbytes


@dataclass(frozen=True)
class LayerGroups:
    """The process groups a step of the layer order talks to on several processes (None: alone on that axis)."""

    sequence: dist.ProcessGroup | None = None
    """Ulysses sequence parallelism: the ranks that split every chunk's tokens (and the heads around attention)."""
    data: dist.ProcessGroup | None = None
    """The ranks whose batches make up the global batch: the valid targets are counted over them."""
    loss: dist.ProcessGroup | None = None
    """Every rank that holds a share of the loss (dp x sp): the step's loss and an evaluation's sum add up over it."""

    @property
    def sequence_ranks(self) -> int:
        return 1 if self.sequence is None else dist.get_world_size(self.sequence)

    @property
    def sequence_rank(self) -> int:
        return 0 if self.sequence is None else dist.get_rank(self.sequence)


class LayerMajorEngine:
    """Runs forward and backward of a ``lightning_sppo.GPT`` layer by layer over N chunks (module docstring).

    A step runs on the ``plan`` it is given (its chunks, K/V spill and documents); ``num_subsequences``, ``partition``,
    ``granularity`` and the spill make the plan of a step given none (``plan``).

    Args:
        num_subsequences: N, the chunks each layer runs the sequence in, or ``"auto"``: chunks of at most 16K tokens per
            sequence-parallel rank.
        partition: how the chunks are cut (``lightning_sppo.partition``; any policy is exact, "length" is natural:
            nothing here needs balanced chunks).
        attention: kernel backend (``select_kernel``).
        granularity: chunk boundaries fall on multiples of this (and of the sequence-parallel ranks).
        loss_chunk_tokens: tokens per loss chunk (``chunked_cross_entropy``).
        recompute: "selective" (keep each layer's input, attention output and log-sum-exp) or "full" (the input).
        offload: "none" (what is kept stays on the device) or "full" (every layer's but the last goes to host).
        kv_device_tokens: tokens of the running layer's K/V kept on the device, the rest in host memory and
            streamed back in chunks of ``kv_chunk_tokens`` (None: all on the device).
        groups: the process groups of a run on several processes (None: one process).
    """

    def __init__(
        self,
        num_subsequences: int | Literal["auto"] = 1,
        partition: str = "length",
        attention: str = "auto",
        granularity: int = 1,
        loss_chunk_tokens: int | None = None,
        recompute: Literal["selective", "full"] = "selective",
        offload: Literal["none", "full"] = "none",
        kv_device_tokens: int | None = None,
        kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS,
        groups: LayerGroups | None = None,
    ) -> None:
        if recompute not in LAYER_MAJOR_RECOMPUTE:
            raise ValueError(
                f"order='layer' recomputes each layer in its backward: recompute must be one of"
                f" {list(LAYER_MAJOR_RECOMPUTE)}, got recompute={recompute!r}."
            )
        if offload not in LAYER_MAJOR_OFFLOADS:
            raise ValueError(
                f"order='layer' sends whole layers' checkpoints to host: offload must be one of"
                f" {list(LAYER_MAJOR_OFFLOADS)}, got offload={offload!r}."
            )
        self.settings = StepSettings(
            order="layer", num_subsequences=num_subsequences, partition=partition, granularity=granularity,
            kv_device_tokens=kv_device_tokens, kv_chunk_tokens=kv_chunk_tokens,
        )  # fmt: skip
        self.attention = attention
        self.loss_chunk_tokens = loss_chunk_tokens
        self.recompute = recompute
        self.offload = offload
        self.groups = groups or LayerGroups()
        self.meter = BytesMeter()
        """K/V and dK/dV bytes on the device (the layer's cache, chunks fetched from host, dK/dV accumulators)."""
        self._cache: KVCache | None = None
        self._checkpoints: _Checkpoints | None = None

    def plan(self, input_ids: Tensor, config, document_ids: Tensor | Documents | None = None) -> StepPlan:
        """The plan of a batch run without one: this engine's settings (``lightning_sppo.step_plan.plan_batch``)."""
        return plan_batch(self._own_settings(), config, input_ids, document_ids)

    def _own_settings(self) -> StepSettings:
        """The settings of a step given no plan: chunks split evenly over this engine's sequence-parallel ranks."""
        sp = self.groups.sequence_ranks
        return replace(self.settings, sequence_parallel=sp, granularity=math.lcm(self.settings.granularity, sp))

    # -- the step -------------------------------------------------------------------------------------

    def forward_backward(
        self,
        model: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        document_ids: Tensor | Documents | None = None,
        *,
        plan: StepPlan | None = None,
        backward: Callable[[Tensor], None] | None = None,
        forward_context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> Tensor:
        """Forward and backward of the whole batch, layer by layer; gradients land in ``.grad``. Returns the detached
        mean loss (of the global batch, on every rank). ``backward`` runs each chunk's loss backward (a framework's,
        e.g. ``fabric.backward``); ``plan`` as in ``SubsequenceEngine.forward_backward``. On several processes every
        sequence-parallel rank passes the same batch and the same plan."""
        step = self._begin(model, input_ids, targets, document_ids, plan, forward_context)
        self.meter.reset()
        checkpoints = self._checkpoints_for(input_ids.device)
        checkpoints.begin(len(step.blocks), host=self.offload == "full")
        shards = step.shards
        try:
            with torch.no_grad(), forward_context():
                hidden = self._forward(step, checkpoints)
            shards.gather(ROOT)  # prefetched during the last layer's forward
            shards.prefetch(len(step.blocks) - 1)
            loss, grads = self._loss_backward(step, hidden, backward)
            shards.reduce(ROOT)  # the final norm's and the head's gradients
            del hidden
            for layer in reversed(range(len(step.blocks))):
                # The layer below comes back chunk by chunk as this one's chunk-major loop lets go of its own.
                shards.gather(layer)
                shards.prefetch(layer - 1 if layer > 0 else ROOT)
                grads = self._layer_backward(step, layer, grads, checkpoints)
                shards.reduce(layer)  # once per layer: every chunk's gradients summed on the gathered weights
            shards.gather(ROOT)
            for (offset, length), grad in zip(step.chunks.local, grads, strict=True):
                with forward_context():
                    embedded = step.model.wte(step.input_ids[:, offset : offset + length])
                torch.autograd.backward(embedded, grad)
            shards.reduce(ROOT)  # the embedding's gradients
            shards.end(backward=True)
            return self._sum(loss, self.groups.loss)
        except BaseException:
            shards.abort()
            raise
        finally:
            checkpoints.end()
            self._unbind(step)

    def evaluate(
        self,
        model: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        document_ids: Tensor | Documents | None = None,
        *,
        plan: StepPlan | None = None,
        forward_context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> tuple[Tensor, Tensor]:
        """Forward only, layer by layer: ``(sum of the token losses, number of valid targets)`` of the global batch,
        fp32 scalars (the same on every rank)."""
        with torch.inference_mode(False), torch.no_grad():
            step = self._begin(model, input_ids, targets, document_ids, plan, forward_context, training=False)
            try:
                with forward_context():
                    hidden = self._forward(step, None)
                    step.shards.gather(ROOT)
                    total = sum(self._chunk_loss(step, i, h).float() for i, h in enumerate(hidden))
                step.shards.end(backward=False)
            except BaseException:
                step.shards.abort()
                raise
            finally:
                self._unbind(step)
            return self._sum(total, self.groups.loss), self._sum(count_targets(targets), self.groups.data)

    def cache_nbytes(self) -> int:
        """Device bytes the K/V cache holds between steps (the running layer's device part)."""
        return self._cache.nbytes() if self._cache is not None else 0

    def cache_peak_nbytes(self) -> int:
        """The most K/V and dK/dV bytes on the device at once during the last step (``meter``)."""
        return self.meter.peak

    def cache_host_nbytes(self) -> int:
        """Host bytes of the running layer's spilled K/V (``kv_device_tokens``)."""
        return self._cache.host_nbytes() if self._cache is not None else 0

    def kept_nbytes(self) -> int:
        """Bytes the last step's forward kept for its backward (every layer and chunk; on host with offload)."""
        return self._checkpoints.kept_bytes if self._checkpoints is not None else 0

    def kept_host_nbytes(self) -> int:
        """Of those, the bytes in host memory."""
        return self._checkpoints.pool.used_bytes if self._checkpoints is not None else 0

    def release(self) -> None:
        """Free the K/V cache and the host buffers (allocated again by the next step)."""
        if self._cache is not None:
            self._cache.release()
            if self._cache.spill is not None:
                self._cache.spill.release()
        if self._checkpoints is not None:
            self._checkpoints.release()

    # -- phases ---------------------------------------------------------------------------------------

    def _begin(
        self, model, input_ids, targets, document_ids, plan: StepPlan | None, forward_context, training: bool = True
    ) -> _Step:
        check_batch(model, input_ids, targets, document_ids)
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        for block in blocks:
            if "forward" in block.__dict__:
                raise ValueError(
                    "order='layer' recomputes blocks itself: build the model without apply_recompute (the strategy's"
                    f" recompute={self.recompute!r} setting is what the layer-major engine uses)."
                )
        ranks = self.groups.sequence_ranks
        if input_ids.shape[1] % ranks:
            raise ValueError(
                f"With sequence_parallel={ranks} every chunk is split over {ranks} ranks: the sequence length"
                f" {input_ids.shape[1]} must be a multiple of {ranks}."
            )
        plan = plan_batch(self._own_settings(), model.config, input_ids, document_ids, plan)
        cores = subsequence_cores(model) or apply_subsequence_attention(
            model, select_kernel(self.attention, input_ids.device)
        )
        self._build_cache(plan)
        # Training divides each token's loss by the global batch's valid targets; evaluation sums them.
        normalizer = (
            self._sum(count_targets(targets), self.groups.data).clamp(min=1)
            if training
            else torch.ones((), device=input_ids.device)
        )
        chunks = ChunkSpans(tuple(plan.spans), ranks, self.groups.sequence_rank)
        shards = LayerShards(model, blocks)
        shards.begin()
        return _Step(
            model, blocks, cores, input_ids, targets, chunks, normalizer, plan.documents, shards, forward_context
        )

    def _forward(self, step: _Step, checkpoints: _Checkpoints | None) -> list[Tensor]:
        """Every layer over every chunk, without a graph; returns the last hidden states per chunk (this rank's
        tokens of each)."""
        shards = step.shards
        shards.gather(ROOT)
        shards.prefetch(0)
        hidden = [step.model.wte(step.input_ids[:, o : o + s]) for o, s in step.chunks.local]
        shards.release(ROOT)
        keep = checkpoints is not None and self.recompute == "selective"
        for layer, (block, core) in enumerate(zip(step.blocks, step.cores, strict=True)):
            shards.gather(layer)  # once for every chunk of the layer
            shards.prefetch(layer + 1 if layer + 1 < len(step.blocks) else ROOT)  # overlaps this layer's work
            attention = self._bind(step, core, self._pass(step, keep=keep))
            try:
                for i, (offset, length) in enumerate(step.chunks.local):
                    cos, sin = step.rope(offset, length)
                    x = shards.cast(hidden[i])
                    hidden[i] = block.forward(x, cos, sin, offset, step.documents)  # no FSDP hooks: ``shards``
                    if checkpoints is not None:
                        checkpoints.put(layer, i, (x, *attention.outputs.pop(i, ())))
                    del x
            finally:
                core.layer_pass = None
            shards.release(layer)
        return hidden

    def _loss_backward(self, step: _Step, hidden: list[Tensor], backward) -> tuple[Tensor, list[Tensor]]:
        """Each chunk's loss and its backward: (the summed loss, detached; the gradients of the hidden states)."""
        total, grads = torch.zeros((), device=step.input_ids.device), []
        for i, h in enumerate(hidden):
            leaf = h.detach().requires_grad_()
            with step.forward_context():
                loss = self._chunk_loss(step, i, leaf)
            (backward or Tensor.backward)(loss)
            total = total + loss.detach()
            grads.append(leaf.grad)
        return total, grads

    def _chunk_loss(self, step: _Step, index: int, hidden: Tensor) -> Tensor:
        offset, length = step.chunks.local[index]
        model = step.model
        normed = model.norm_f(hidden)
        targets = step.targets[:, offset : offset + length]
        return chunked_cross_entropy(normed, model.lm_head.weight, targets, step.normalizer, self.loss_chunk_tokens)

    def _layer_backward(
        self, step: _Step, layer: int, grads: list[Tensor], checkpoints: _Checkpoints
    ) -> list[Tensor | None]:
        """One layer's backward (module docstring, 3a and 3b); returns the gradients of its inputs."""
        block, core = step.blocks[layer], step.cores[layer]
        local = step.chunks.local
        kept = [checkpoints.get(layer, i) for i in range(len(local))]
        replayed = [pair[1:] for pair in kept] if self.recompute == "selective" else None
        attention = self._bind(step, core, self._pass(step, kept=replayed, replay=True))
        residual: list[Tensor | None] = []
        try:
            for i, (offset, length) in enumerate(local):
                x = kept[i][0].detach().requires_grad_()
                cos, sin = step.rope(offset, length)
                with step.forward_context():
                    y = block.forward(x, cos, sin, offset, step.documents)
                torch.autograd.backward(y, grads[i])
                grads[i] = None
                residual.append(x.grad)
                del x, y
        finally:
            core.layer_pass = None
        inputs: list[Tensor | None] = [None] * len(local)
        groups = block.attn.n_query_groups

        def finish(i: int, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
            dq, dk, dv = attention.gradients_to_sequence(dq, dk, dv, groups)  # this rank's tokens, all heads
            offset, length = local[i]
            x = kept[i][0].detach().requires_grad_()
            cos, sin = step.rope(offset, length)
            with step.forward_context():  # the first half of Block.forward, which the chunk-major loop cut off
                q, k, v = block.attn.heads(block.norm_1(x), cos, sin)
            torch.autograd.backward((q, k, v), (dq, dk, dv))
            inputs[i] = x.grad.add_(residual[i])
            residual[i] = kept[i] = None
            if replayed is not None:
                replayed[i] = None  # the attention's own hold on the kept out and lse
            checkpoints.drop(layer, i)
            # Chunk i of the layer below takes the place chunk i of this one leaves, on the copy stream while the loop
            # goes on: the device holds one layer's checkpoints and a chunk in flight, not two layers.
            checkpoints.prefetch(layer - 1, i)

        chunks = attention.query_chunks()
        keys = self._cache.read_spans(list(step.chunks.spans))
        scale = 1.0 / math.sqrt(block.attn.head_size)
        chunk_major_backward(chunks, lambda j: next(keys), core.kernel, scale, finish, self._accumulator)
        return inputs

    # -- state ----------------------------------------------------------------------------------------

    def _pass(self, step: _Step, **settings) -> LayerPass:
        return LayerPass(self._cache, step.chunks, self.groups.sequence, **settings)

    def _bind(self, step: _Step, core: SubsequenceAttention, attention: LayerPass) -> LayerPass:
        """Bind ``attention`` to ``core`` for one pass over a layer; the cache starts afresh (its allocation kept)."""
        cache = attention.cache
        if cache.spill is not None:  # the host part serves one layer pass at a time
            cache.spill.begin_step()
            cache.drop_host()
        cache.reset(step.input_ids.shape[1])
        core.layer_pass = attention
        return attention

    def _unbind(self, step: _Step) -> None:
        for core in step.cores:
            core.layer_pass = None

    def _build_cache(self, plan: StepPlan) -> None:
        """The one K/V cache every layer pass uses in turn (rebuilt when the plan's spill changes)."""
        if self._cache is None or _spill_settings(self._cache) != plan.spill:
            kv_spill = None if plan.kv_device_tokens is None else KVSpill(plan.kv_device_tokens, plan.kv_chunk_tokens)
            self._cache = KVCache(plan.seq_len, spill=kv_spill)
            self._cache.on_alloc = self.meter.hold

    def _accumulator(self, like: Tensor) -> Tensor:
        return self.meter.hold(torch.zeros(like.shape, dtype=accumulation_dtype(like.dtype), device=like.device))

    def _checkpoints_for(self, device: torch.device) -> _Checkpoints:
        if self._checkpoints is None or self._checkpoints.device != device:
            self._checkpoints = _Checkpoints(device)
        return self._checkpoints

    @staticmethod
    def _sum(value: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        """``value`` (fp32) summed over ``group`` (itself without one)."""
        value = value.detach().to(torch.float32)
        if group is not None:
            dist.all_reduce(value, group=group)
        return value


def _spill_settings(cache: KVCache) -> tuple[int | None, int | None]:
    spill = cache.spill
    return (None, None) if spill is None else (spill.device_tokens, spill.chunk_tokens)


@dataclass(eq=False)
class _Step:
    """One batch's state across the phases of a step."""

    model: nn.Module
    blocks: list[Block]
    cores: list[SubsequenceAttention]
    input_ids: Tensor
    targets: Tensor
    chunks: ChunkSpans
    normalizer: Tensor
    documents: Documents | None
    shards: LayerShards
    forward_context: Callable[[], AbstractContextManager] = nullcontext
    _rope: dict = field(default_factory=dict)

    def rope(self, offset: int, length: int) -> tuple[Tensor, Tensor]:
        """cos/sin of the tokens [offset, offset + length) (positions restart per document)."""
        config, device = self.model.config, self.input_ids.device
        if self.documents is None:
            return rope_cos_sin(config, offset, length, device=device)
        return rope_cos_sin_at(config, self.documents.positions(offset, length))


class _Checkpoints:
    """What the forward keeps per (layer, chunk) for the backward, on the device or in host memory.

    With ``host``, every layer's but the last goes to host (pinned on CUDA) on a side stream as it is kept. In the
    backward a layer's chunks come back one by one (``prefetch(layer, chunk)``) as the layer above lets go of its own
    (the chunk-major loop finishes chunk i of layer l, then chunk i of layer l - 1 starts to arrive), so the device
    holds about one layer's checkpoints and a chunk in flight; ``get`` waits for the chunk's own copy, which the
    layer's replay reads first. A copy's device source lives until the compute stream has waited for it (the next
    ``put`` settles it).

    A round trip restores each tensor's strides: it moves the span of memory the tensor covers, as the offloader
    does (``offload.units.SavedUnit``), so a kept attention output comes back laid out as it left (the last layer's,
    kept on the device, is the kernel's own) and the attention backward sees one layout in every layer.
    """

    def __init__(self, device: torch.device) -> None:
        from lightning_sppo.offload.pool import HostPool  # offload imports the runtime

        self.device = device
        self.copies = self.engine(device)
        self.pool = HostPool(pin_memory=device.type == "cuda", setting="offload='full' (order='layer')")
        self.meter = BytesMeter()
        """Bytes of the kept checkpoints on the device (the last layer's and those brought back from host), while the
        backward still holds them."""
        self._kept: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        self._on_host: dict[tuple[int, int], tuple[SavedRef, ...]] = {}
        self._tickets: dict[tuple[int, int], CopyTicket] = {}
        self._in_flight: list[tuple[CopyTicket, tuple[SavedUnit, ...]]] = []
        self._layers = 0
        self._host = False
        self.kept_bytes = 0
        """Bytes kept by the last step's forward, wherever they went."""

    @staticmethod
    def engine(device: torch.device) -> CopyEngine:
        """The copy engine of a device: a CUDA side stream, or plain copies on CPU (tests swap in their own)."""
        from lightning_sppo.offload.streams import CudaCopies, SyncCopies

        return CudaCopies(device) if device.type == "cuda" else SyncCopies(device)

    def begin(self, layers: int, host: bool) -> None:
        self._layers, self._host = layers, host
        self.pool.reset()
        self.meter.reset()
        self.kept_bytes = 0

    def put(self, layer: int, chunk: int, tensors: tuple[Tensor, ...]) -> None:
        from lightning_sppo.offload.units import SavedUnit  # offload imports the runtime

        self._settle()
        self.kept_bytes += sum(t.nbytes for t in tensors)
        if not self._host or layer == self._layers - 1:  # the last layer's backward comes first: keep it here
            self._kept[(layer, chunk)] = tuple(self.meter.hold_storage(t) for t in tensors)
            return
        units = tuple(SavedUnit(t) for t in tensors)  # each keeps its device memory until the copy is waited for
        refs = tuple(unit.add(t) for unit, t in zip(units, tensors, strict=True))
        for unit in units:
            unit.host = self.pool.take(unit.numel, unit.dtype)
        ticket = self.copies.d2h([(unit.host, unit.device_span()) for unit in units])
        self._in_flight.append((ticket, units))
        self._on_host[(layer, chunk)] = refs

    def prefetch(self, layer: int, chunk: int | None = None) -> None:
        """Start bringing ``layer``'s host-resident ``chunk`` (None: every chunk) back, in one copy per chunk
        (no-op for what is on the device already, or layer < 0)."""
        self._settle()
        keys = [key for key in self._on_host if key[0] == layer and chunk in (None, key[1])]
        for key in keys:
            refs = self._on_host.pop(key)
            pairs = []
            for unit in {id(ref.unit): ref.unit for ref in refs}.values():
                # The span, as it left (same strides); the views below hold it, and the meter counts it, until dropped.
                unit.restored = self.meter.hold_storage(self.copies.empty(unit.numel, unit.dtype))
                pairs.append((unit.restored, unit.host))
            self._kept[key] = tuple(ref.unit.view(ref) for ref in refs)
            self._tickets[key] = self.copies.h2d(pairs)
            for ref in refs:  # a unit and its refs hold each other: only the views may keep the span alive
                ref.unit.clear()

    def get(self, layer: int, chunk: int) -> tuple[Tensor, ...]:
        """Chunk ``chunk`` of ``layer``'s checkpoints, on the device: the compute stream waits for its copy here."""
        key = (layer, chunk)
        if key in self._on_host:  # not prefetched: read out of turn
            self.prefetch(layer, chunk)
        ticket = self._tickets.pop(key, None)
        if ticket is not None:
            self.copies.wait(ticket)
        return self._kept[key]

    def drop(self, layer: int, chunk: int) -> None:
        self._kept.pop((layer, chunk), None)

    def end(self) -> None:
        self._settle()
        for ticket in self._tickets.values():  # a step cut short: no copy may still write a buffer being freed
            self.copies.wait(ticket)
        self._kept.clear()
        self._on_host.clear()
        self._tickets.clear()

    def release(self) -> None:
        self.end()
        self.pool.release()

    def host_nbytes(self) -> int:
        return self.pool.used_bytes

    def _settle(self) -> None:
        for ticket, units in self._in_flight:
            self.copies.wait(ticket)
            for unit in units:
                unit.drop_device()  # the copy is done: the device memory may go
        self._in_flight.clear()
