"""The correctness half of ``gpu_suite.py``: GPU paths against float64 and against each other.

* kernels: output, log-sum-exp and dq/dk/dv of the kernel ``attention="auto"`` picks, against float64 dense
  attention (GQA and MHA, fp32 and bf16, square causal and rectangular; 100 queries hit the memory-efficient
  kernel's 32-row log-sum-exp padding), and uneven subsequences over one K/V cache; on CUDA the same in bf16 for
  every other backend that can run (ATen's flash op, cuDNN attention, flash-attn), or an n/a check saying why not;
* no call of the O(S x S_k) reference kernel on CUDA;
* the engine against the plain model, in fp32 and under bf16 autocast;
* packed documents: the engine with ``document_ids`` against every document trained alone (fp32, and bf16 within
  twice the plain model's own bf16 error), with a negative control that drops the documents;
* offload "full" and "adaptive" bit-identical to "none" with every side-stream copy delayed, and a negative
  control in which the compute stream no longer waits for a copy before it reads the copy's data or lets go of its
  source (CUDA only: CPU copies are synchronous). The control cannot tear an index: it sends only floating-point
  tensors (a torn integer reaching an index kernel fires a device-side assert, which poisons the CUDA context for the
  rest of the process, as on the first H100 run), and it still waits before freeing a buffer a copy writes into (a
  late restore into memory already reused could tear any tensor). The suite runs it last all the same.

Every check that cannot run raises nothing: it becomes a failed ``Check`` naming the error, so a GPU run always
writes its report. Shared step helpers (``batch``, ``autocast``, ``synchronize``, ``release_memory``) live here
and are used by the timing half too.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from offload_bench import plain_loss_fn
from torch import Tensor

from lightning_sppo.attention import (
    AttentionKernel,
    KVCache,
    ReferenceKernel,
    SDPAKernel,
    select_kernel,
    subsequence_attention,
)
from lightning_sppo.attention.kernels import NO_CUDNN_PROBE, cudnn_status, flash_attn_status
from lightning_sppo.documents import Documents
from lightning_sppo.loss import chunked_cross_entropy
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT
from lightning_sppo.offload import OffloadCosts, Offloader
from lightning_sppo.offload import offloader as offloader_module
from lightning_sppo.offload.streams import CudaCopies
from lightning_sppo.partition import spans as to_spans
from lightning_sppo.runtime import LayerMajorEngine, SubsequenceEngine

__all__ = [
    "Check",
    "CheckSizes",
    "autocast",
    "batch",
    "check_offload_negative_control",
    "floating_only_sends",
    "release_memory",
    "run_checks",
    "synchronize",
]


@dataclass(frozen=True)
class CheckSizes:
    model: str = "small"
    """GPTConfig name for the engine and offload checks (GQA)."""
    seq_len: int = 4096
    subsequences: int = 4
    head_size: int = 64
    """Head size of the kernel checks."""


# -- step helpers ----------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device, host: bool = True) -> None:
    """Return the last run's memory before the next one (CUDA; on CPU nothing waits for it). ``host=False`` keeps the
    pinned host blocks PyTorch caches, for the next run to reuse (pinning is a one-time cost of a real run)."""
    if device.type == "cuda":
        gc.collect()  # ~0.4 s with lightning's objects alive: worth it only where memory is scarce
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks save_on_cpu left cached
        if host and host_empty_cache is not None:
            host_empty_cache()


def batch(config: GPTConfig, seq_len: int, device: torch.device, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, (1, seq_len + 1), generator=gen).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def autocast(device: torch.device, dtype: torch.dtype | None) -> Callable[[], Any]:
    return partial(torch.autocast, device.type, dtype=dtype) if dtype is not None else nullcontext


def rel_error(got: Tensor, want: Tensor) -> float:
    """||got - want|| / ||want|| in float64 (absolute where the reference is below 1e-12)."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-12)).item()


# -- checks ------------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    passed: bool | None
    """None: not applicable on this device (``detail`` says why)."""
    value: float | None = None
    limit: float | None = None
    detail: str = ""


def dense_fp64(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """Float64 attention with bottom-right causal alignment: out [B, H, Sq, Dh] and lse [B, H, Sq]."""
    q, k, v = q.double(), k.double(), v.double()
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        visible = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + sk - sq
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1) @ v, scores.logsumexp(-1)


def _reference_grads(q, k, v, dout, causal) -> list[Tensor]:
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, _ = dense_fp64(*leaves, causal)
    out.backward(dout.double())
    return [x.grad for x in leaves]


@contextmanager
def reference_kernel_calls() -> Iterator[list[int]]:
    """Counts ReferenceKernel.forward/backward calls made inside."""
    calls = [0]
    forward, backward = ReferenceKernel.forward, ReferenceKernel.backward

    def counted(fn):
        return lambda *args, **kwargs: calls.__setitem__(0, calls[0] + 1) or fn(*args, **kwargs)

    ReferenceKernel.forward, ReferenceKernel.backward = counted(forward), counted(backward)
    try:
        yield calls
    finally:
        ReferenceKernel.forward, ReferenceKernel.backward = forward, backward


LIMITS = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
"""Relative error against float64 (METHOD.md): fp32 arithmetic lands far under 1e-3 (TF32 near 3e-4),
bf16 operands between 1e-3 and 1e-2."""

KERNEL_CASES = [(True, 100, 100, 8, 2), (False, 100, 300, 8, 2), (False, 128, 64, 8, 8), (True, 64, 64, 4, 4)]
"""(causal, Sq, Sk, H, G): 100 queries are not a multiple of the memory-efficient kernel's 32-row tile."""


def kernel_backends(device: torch.device) -> tuple[list[tuple[AttentionKernel, tuple[torch.dtype, ...]]], list[Check]]:
    """The kernels to check on ``device`` with the dtypes each runs itself: what ``attention="auto"`` picks (fp32 and
    bf16), and on CUDA every other backend that can run here (bf16; their fp32 is the ``sdpa`` route): ATen's flash
    op (``sdpa``), cuDNN attention (``cudnn``), flash-attn. A backend that cannot run is an n/a check saying why."""
    auto = select_kernel("auto", device)
    backends, absent = [(auto, tuple(LIMITS))], []
    if device.type != "cuda":
        return backends, absent
    backends.append((SDPAKernel(), (torch.bfloat16,)))
    why = cudnn_status(device)
    if why is None or why.startswith("PyTorch's SDPA does not pick it"):  # runnable: check it even where not picked
        try:
            backends.append((select_kernel("cudnn", device), (torch.bfloat16,)))
        except ValueError as error:
            absent.append(Check("kernel cudnn can run", False, detail=str(error)))
    else:  # disagreeing with the flash op is a failure to look at; no CUDA device or no torch support is not
        absent.append(Check("kernel cudnn can run", False if why.startswith(NO_CUDNN_PROBE) else None, detail=why))
    if flash_attn_status() is None:
        backends.append((select_kernel("flash_attn", device), (torch.bfloat16,)))
    named = {kernel.name: (kernel, dtypes) for kernel, dtypes in reversed(backends)}  # auto's entry wins
    return [named[name] for name in dict.fromkeys(k.name for k, _ in backends)], absent


def check_kernels(device: torch.device, sizes: CheckSizes) -> list[Check]:
    backends, checks = kernel_backends(device)
    for kernel, dtypes in backends:
        checks += _check_kernel(kernel, dtypes, device, sizes.head_size)
    return checks


def _check_kernel(kernel: AttentionKernel, dtypes, device: torch.device, dh: int) -> list[Check]:
    checks = []
    for dtype in dtypes:
        worst = {"out": 0.0, "lse": 0.0, "grads": 0.0}
        for causal, sq, sk, heads, groups in KERNEL_CASES:
            q = torch.randn(2, heads, sq, dh, device=device, dtype=dtype)
            k, v = (torch.randn(2, groups, sk, dh, device=device, dtype=dtype) for _ in range(2))
            out, lse = kernel.forward(q, k, v, causal, 1 / math.sqrt(dh))
            ref, ref_lse = dense_fp64(q, k, v, causal)
            dout = torch.randn_like(out)
            grads = kernel.backward(dout, q, k, v, out, lse, causal, 1 / math.sqrt(dh))
            worst["out"] = max(worst["out"], rel_error(out, ref))
            worst["lse"] = max(worst["lse"], rel_error(lse, ref_lse))
            for got, want in zip(grads, _reference_grads(q, k, v, dout, causal), strict=True):
                err = rel_error(got, want) if got.shape == want.shape else math.inf  # dK/dV per K/V group
                worst["grads"] = max(worst["grads"], err)
        for what, value in worst.items():
            lim = LIMITS[torch.float32] if what == "lse" else LIMITS[dtype]  # lse is fp32 for every input dtype
            checks.append(Check(f"kernel {kernel.name} {what} {_name(dtype)} (GQA and MHA)", value <= lim, value, lim))
    return checks


def check_subsequence_attention(device: torch.device, sizes: CheckSizes) -> list[Check]:
    """Uneven subsequences over one K/V cache, backward last first: out and dq/dk/dv against dense fp64, for every
    backend ``kernel_backends`` lists (the prefix calls are rectangular, their partial results merged)."""
    backends, _ = kernel_backends(device)
    return [check for kernel, dtypes in backends for check in _check_subsequences(kernel, dtypes, device, sizes)]


def _check_subsequences(kernel: AttentionKernel, dtypes, device: torch.device, sizes: CheckSizes) -> list[Check]:
    checks, lengths = [], [100, 120, 80]
    for dtype in dtypes:
        limit = LIMITS[dtype]
        shape = (1, 8, sum(lengths), sizes.head_size)
        leaves = [torch.randn(shape[0], n, *shape[2:], device=device, dtype=dtype).requires_grad_() for n in (8, 2, 2)]
        cache, outs = KVCache(shape[2], last_offset=to_spans(lengths)[-1][0]), []
        for off, n in to_spans(lengths):
            outs.append(subsequence_attention(*(x[:, :, off : off + n] for x in leaves), cache, off, kernel))
        dout = torch.randn(shape, device=device, dtype=dtype)
        for (off, n), out in reversed(list(zip(to_spans(lengths), outs, strict=True))):
            out.backward(dout[:, :, off : off + n])
        ref, _ = dense_fp64(*leaves, True)
        err = max(rel_error(torch.cat([o.detach() for o in outs], 2), ref), *(
            rel_error(x.grad, g) for x, g in zip(leaves, _reference_grads(*leaves, dout, True), strict=True)))  # fmt: skip
        name = f"subsequence attention {lengths} {_name(dtype)} {kernel.name} (out, dq, dk, dv)"
        checks.append(Check(name, err <= limit, err, limit))
    return checks


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def engine_and_plain(config: GPTConfig, device: torch.device, seq_len: int, n: int, dtype: torch.dtype | None):
    """Loss and gradients of the plain model and of the engine (flops partition), from the same weights."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    ids, targets = batch(config, seq_len, device)
    with autocast(device, dtype)():
        loss = plain_loss_fn(model, ids, targets)
    loss.backward()
    plain = (loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    engine = SubsequenceEngine(n, "flops", attention="auto")
    loss = engine.forward_backward(model, ids, targets, forward_context=autocast(device, dtype))
    result = (loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()})
    engine.release()
    return plain, result


def check_engine(device: torch.device, sizes: CheckSizes) -> list[Check]:
    """fp32: engine = plain within LIMITS. bf16: the engine's error against fp32 is at most twice the plain model's."""
    config = GPTConfig.from_name(sizes.model)
    args = (config, device, sizes.seq_len, sizes.subsequences)
    with full_fp32_matmuls():
        (truth_loss, truth), (loss, grads) = engine_and_plain(*args, None)
        (plain_loss, plain_grads), (bf16_loss, bf16_grads) = engine_and_plain(*args, torch.bfloat16)
    fp32_err = max(abs(loss - truth_loss) / abs(truth_loss), *(rel_error(grads[k], g) for k, g in truth.items()))
    plain_err = max(abs(plain_loss - truth_loss) / abs(truth_loss), *(rel_error(plain_grads[k], g) for k, g in truth.items()))  # fmt: skip
    bf16_err = max(abs(bf16_loss - truth_loss) / abs(truth_loss), *(rel_error(bf16_grads[k], g) for k, g in truth.items()))  # fmt: skip
    bf16_limit, fp32_limit = 2 * plain_err + 1e-3, LIMITS[torch.float32]
    where = f"{config.name}, S={sizes.seq_len}, N={sizes.subsequences}, flops partition"
    return [
        Check(
            f"engine = plain model, fp32 ({where})",
            fp32_err <= fp32_limit,
            fp32_err,
            fp32_limit,
            "loss and every gradient",
        ),  # fmt: skip
        Check(
            f"engine = plain model, bf16 autocast ({where})",
            bf16_err <= bf16_limit,
            bf16_err,
            bf16_limit,
            f"error against fp32; the plain model's own bf16 error is {plain_err:.3g}",
        ),  # fmt: skip
    ]


def layer_order_grads(config: GPTConfig, device: torch.device, seq_len: int, dtype: torch.dtype | None, **engine):
    """Loss and gradients of the layer-major engine (``order="layer"``) from the check's weights."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    ids, targets = batch(config, seq_len, device)
    runner = LayerMajorEngine(attention="auto", **engine)
    loss = runner.forward_backward(model, ids, targets, forward_context=autocast(device, dtype))
    synchronize(device)
    result = (loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()})
    runner.release()
    return result


def check_layer_order(device: torch.device, sizes: CheckSizes, delay_ms: float) -> list[Check]:
    """The layer order: fp32 equal to the plain model; bf16 within twice the plain model's own bf16 error; and with
    its checkpoints and most K/V on host, gradients bit-identical whether every copy is delayed or not (a missing
    wait would read a buffer before its copy lands)."""
    config, S, n = GPTConfig.from_name(sizes.model), sizes.seq_len, sizes.subsequences
    where = f"{config.name}, S={S}, {n} chunks, recompute=selective"
    with full_fp32_matmuls():
        (truth_loss, truth), _ = engine_and_plain(config, device, S, 1, None)
        (plain_loss, plain_grads), _ = engine_and_plain(config, device, S, 1, torch.bfloat16)
        loss, grads = layer_order_grads(config, device, S, None, num_subsequences=n)
        bf16_loss, bf16_grads = layer_order_grads(config, device, S, torch.bfloat16, num_subsequences=n)

    def error(got_loss, got):
        return max(abs(got_loss - truth_loss) / abs(truth_loss), *(rel_error(got[k], g) for k, g in truth.items()))

    plain_err = error(plain_loss, plain_grads)
    bf16_limit = 2 * plain_err + 1e-3
    checks = [
        Check(f"layer order = plain model, fp32 ({where})", error(loss, grads) <= LIMITS[torch.float32],
              error(loss, grads), LIMITS[torch.float32], "loss and every gradient"),
        Check(f"layer order = plain model, bf16 autocast ({where})", error(bf16_loss, bf16_grads) <= bf16_limit,
              error(bf16_loss, bf16_grads), bf16_limit, f"the plain model's own bf16 error is {plain_err:.3g}"),
    ]  # fmt: skip
    on_host = dict(num_subsequences=n, offload="full", kv_device_tokens=S // 4, kv_chunk_tokens=max(1, S // 16))
    with deterministic(False):
        _, prompt = layer_order_grads(config, device, S, torch.bfloat16, **on_host)
        _, again = layer_order_grads(config, device, S, torch.bfloat16, **on_host)
        with delayed_copies(device, delay_ms) as delayed:
            _, late = layer_order_grads(config, device, S, torch.bfloat16, **on_host)
    noise = _max_abs_diff(prompt, again)
    diff, limit = _max_abs_diff(prompt, late), 4 * noise
    detail = f"copies delayed {delay_ms:g} ms each" if delayed else "CPU: copies are synchronous, no delay"
    checks.append(Check("layer order: checkpoints and 3/4 of the K/V on host, gradients unchanged by late copies",
                        diff <= limit, diff, limit, f"{detail}; run-to-run difference {noise:.3g}"))  # fmt: skip
    release_memory(device)
    return checks


DOCUMENT_SHARES = (0.3, 0.0, 0.05, 0.4)
"""Documents as shares of the sequence (0.0: a one-token document), the rest one last document: the first crosses
a subsequence boundary at every N the suite uses."""


def document_ids(seq_len: int, device: torch.device) -> Tensor:
    lengths = [max(1, int(share * seq_len)) for share in DOCUMENT_SHARES]
    lengths.append(seq_len - sum(lengths))
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0).to(device)


def documents_alone(model: GPT, ids: Tensor, targets: Tensor, docs: Tensor, dtype: torch.dtype | None):
    """The independent reference: every document of the row through the plain model on its own."""
    model.zero_grad(set_to_none=True)
    with autocast(ids.device, dtype)():
        loss = sum(
            chunked_cross_entropy(model.hidden_states(ids[:, docs[0] == d]), model.lm_head.weight, targets[:, docs[0] == d], targets.numel())
            for d in docs[0].unique_consecutive()
        )  # fmt: skip
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _engine_documents(model, ids, targets, docs, sizes, dtype):
    model.zero_grad(set_to_none=True)
    engine = SubsequenceEngine(sizes.subsequences, "flops", attention="auto")
    loss = engine.forward_backward(model, ids, targets, docs, forward_context=autocast(ids.device, dtype))
    engine.release()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _error(result, truth) -> float:
    (loss, grads), (truth_loss, truth_grads) = result, truth
    return max(abs(loss - truth_loss) / abs(truth_loss), *(rel_error(grads[k], g) for k, g in truth_grads.items()))


def check_documents(device: torch.device, sizes: CheckSizes) -> list[Check]:
    """The engine on packed documents (varlen kernels) against each document alone; negative control: no mask."""
    config = GPTConfig.from_name(sizes.model)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    ids, targets = batch(config, sizes.seq_len, device)
    docs = document_ids(sizes.seq_len, device)
    where = f"{config.name}, S={sizes.seq_len}, N={sizes.subsequences}, {docs.unique().numel()} documents"
    with full_fp32_matmuls():
        truth = documents_alone(model, ids, targets, docs, None)
        fp32_err = _error(_engine_documents(model, ids, targets, docs, sizes, None), truth)
        unmasked_err = _error(_engine_documents(model, ids, targets, None, sizes, None), truth)
        model.zero_grad(set_to_none=True)
        documents = Documents.from_ids(docs.cpu(), device)
        with autocast(device, torch.bfloat16)():
            hidden = model.hidden_states(ids, documents=documents)
            plain = chunked_cross_entropy(hidden, model.lm_head.weight, targets, targets.numel())
        plain.backward()
        plain_err = _error((plain.item(), {n: p.grad.clone() for n, p in model.named_parameters()}), truth)
        bf16_err = _error(_engine_documents(model, ids, targets, docs, sizes, torch.bfloat16), truth)
    fp32_limit, bf16_limit = LIMITS[torch.float32], 2 * plain_err + 1e-3
    return [
        Check(f"engine with documents = documents alone, fp32 ({where})", fp32_err <= fp32_limit, fp32_err, fp32_limit),
        Check(
            f"engine with documents, bf16 autocast ({where})",
            bf16_err <= bf16_limit,
            bf16_err,
            bf16_limit,
            f"error against fp32 alone; the plain model's own bf16 error is {plain_err:.3g}",
        ),  # fmt: skip
        Check(
            "negative control: the same engine without documents differs from documents alone",
            unmasked_err > 10 * fp32_limit,
            unmasked_err,
            10 * fp32_limit,
            "passes when the error EXCEEDS the limit",
        ),  # fmt: skip
    ]


@contextmanager
def full_fp32_matmuls() -> Iterator[None]:
    """fp32 matmuls and convolutions in full fp32 (no TF32) for the duration."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@contextmanager
def deterministic(strict: bool) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)``. Strict is what makes PyTorch's flash backward deterministic
    (with ``warn_only`` it stays atomic); an op without a deterministic version then raises, so the caller
    retries with ``strict=False`` and says so."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()  # fmt: skip
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@contextmanager
def delayed_copies(device: torch.device, milliseconds: float) -> Iterator[bool]:
    """Every copy batch on the offloader's side stream starts after a ``torch.cuda._sleep`` on that stream.

    A compute-stream read of a restored buffer, or a reuse of a device buffer, that does not wait for its copy
    then sees stale memory. Yields whether a delay is in place (CPU copies are synchronous: nothing to delay).
    """
    if device.type != "cuda":
        yield False
        return
    clock_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_980_000
    cycles = int(milliseconds * clock_khz)
    copy = CudaCopies._copy

    def delayed(self: CudaCopies, pairs):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(cycles)
        return copy(self, pairs)

    CudaCopies._copy = delayed
    try:
        yield True
    finally:
        CudaCopies._copy = copy


@contextmanager
def reads_unwaited() -> Iterator[None]:
    """Negative control: the compute stream no longer waits for a copy before it reads what the copy brings back, nor
    before it lets go of what a copy still reads; it still waits before freeing a buffer a copy writes into.

    A restore written late into memory the allocator has already handed to another tensor could tear any tensor, an
    index too (a device-side assert, fatal to the CUDA context); a late read tears only the data read, which
    ``floating_only_sends`` keeps to floats."""
    wait, discard = CudaCopies.wait, Offloader._discard
    freeing = [False]

    def wait_only_to_free(self: CudaCopies, ticket):
        return wait(self, ticket) if freeing[0] else None

    def discard_waiting(self: Offloader, step, state) -> None:  # frees the subsequence's buffers, restored ones too
        freeing[0] = True
        try:
            discard(self, step, state)
        finally:
            freeing[0] = False

    CudaCopies.wait, Offloader._discard = wait_only_to_free, discard_waiting
    try:
        yield
    finally:
        CudaCopies.wait, Offloader._discard = wait, discard


@contextmanager
def floating_only_sends() -> Iterator[list[torch.dtype]]:
    """The offloader sends only floating-point units to the host; yields the dtypes of every unit it sends.

    Integer units (token ids, targets, index tensors) stay on the device, so a copy that is read before it lands
    can tear only floats (the negative control's point), never an index (a device-side assert, fatal to the
    CUDA context)."""
    first_fit, sent = offloader_module._first_fit, []

    def floats_only(units, budget):
        chosen = first_fit([u for u in units if u.dtype.is_floating_point], budget)
        sent.extend(u.dtype for u in chosen)
        return chosen

    offloader_module._first_fit = floats_only
    try:
        yield sent
    finally:
        offloader_module._first_fit = first_fit


class _Gradients:
    """Gradients of one bf16 batch of the check model through the engine, under a chosen offload policy."""

    def __init__(self, device: torch.device, sizes: CheckSizes) -> None:
        config = GPTConfig.from_name(sizes.model)
        torch.manual_seed(0)
        self.model, self.device, self.sizes = GPT(config).to(device), device, sizes
        self.ids, self.targets = batch(config, sizes.seq_len, device)

    def __call__(self, offload: str = "none", **options) -> tuple[dict[str, Tensor], Offloader | None]:
        model, device = self.model, self.device
        model.zero_grad(set_to_none=True)
        hooks = Offloader(offload, device, min_bytes=0, **options) if offload != "none" else None
        engine = SubsequenceEngine(self.sizes.subsequences, "flops", attention="auto", hooks=hooks)
        try:
            engine.forward_backward(model, self.ids, self.targets, forward_context=autocast(device, torch.bfloat16))
            synchronize(device)
            return {name: p.grad.clone() for name, p in model.named_parameters()}, hooks
        finally:
            engine.release()
            if hooks is not None:
                hooks.release()


def offload_gradients(device: torch.device, sizes: CheckSizes, delay_ms: float, strict: bool) -> dict[str, Any]:
    """Gradients of one bf16 batch without offload (twice) and with full and adaptive offload, every copy delayed;
    plus the adaptive run's alphas."""
    grads, out = _Gradients(device, sizes), {}
    with deterministic(strict), delayed_copies(device, delay_ms) as out["delayed"]:
        out["none"], _ = grads()
        out["again"], _ = grads()
        out["full"], offloader = grads("full")
        level2 = [s.level2_bytes for s in offloader.last_stats.subsequences]
        # alpha_i = threshold / A_i with the threshold half the mean A_i: a partial offload of most subsequences.
        costs = OffloadCosts(d2h_bytes_per_s=1.0, forward_s=(0.5 * sum(level2) / len(level2),))
        out["adaptive"], offloader = grads("adaptive", costs=costs)
        out["alphas"] = offloader.last_stats.alphas
    del grads
    release_memory(device)
    return out


def check_offload(device: torch.device, sizes: CheckSizes, delay_ms: float) -> list[Check]:
    mode = "deterministic algorithms"
    try:
        runs = offload_gradients(device, sizes, delay_ms, strict=True)
    except RuntimeError as error:  # an op without a deterministic implementation
        mode = f"deterministic algorithms, warn only ({str(error).splitlines()[0][:120]})"
        runs = offload_gradients(device, sizes, delay_ms, strict=False)
    noise = _max_abs_diff(runs["none"], runs["again"])
    limit = 4 * noise  # 0 when the baseline is deterministic: then bit-identity
    delay = f"copies delayed {delay_ms:g} ms each" if runs["delayed"] else "CPU: copies are synchronous, no delay"
    checks = [
        Check("offload: two runs without offload are bit-identical (baseline)", True if noise == 0 else None, noise,
              0.0, f"{mode}; if not bit-identical, the checks below allow 4x this run-to-run difference"),
    ]  # fmt: skip
    alphas = runs["alphas"]
    for name in ("full", "adaptive"):
        diff = _max_abs_diff(runs["none"], runs[name])
        detail = delay + (f"; alphas {', '.join(f'{a:.2f}' for a in alphas)}" if name == "adaptive" else "")
        checks.append(Check(f"offload={name} gradients bit-identical to none", diff <= limit, diff, limit, detail))
    if not 0.0 < max(alphas[:-1], default=0.0) < 1.0:
        checks.append(Check("offload=adaptive offloads part of a subsequence", False, max(alphas), 1.0, str(alphas)))
    return checks


NEGATIVE_CONTROL = "offload negative control: waits removed change the gradients"


def check_offload_negative_control(device: torch.device, sizes: CheckSizes, delay_ms: float) -> list[Check]:
    """Full offload whose reads no longer wait for their copies (``reads_unwaited``), every copy delayed, must change
    the gradients (else the delay hides nothing and the bit-identity checks prove nothing). Floating-point units only
    are sent (``floating_only_sends``); the suite runs this last all the same. CPU copies are synchronous: n/a."""
    if device.type != "cuda":
        return [Check(NEGATIVE_CONTROL, None, detail="CPU: copies are synchronous, nothing to remove")]
    grads = _Gradients(device, sizes)
    with deterministic(False), delayed_copies(device, delay_ms):
        none, _ = grads()
        again, _ = grads()
        with reads_unwaited(), floating_only_sends() as sent:
            broken, _ = grads("full")
    noise = _max_abs_diff(none, again)
    limit, diff = 4 * noise, _max_abs_diff(none, broken)
    kinds = ", ".join(sorted({_name(d) for d in sent})) or "nothing"
    detail = f"copies delayed {delay_ms:g} ms each; sent {len(sent)} units ({kinds}); fails if the delay hides no missing wait"
    del grads
    release_memory(device)
    return [Check(NEGATIVE_CONTROL, diff > limit and bool(sent), diff, limit, detail)]


def _max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    diff = max((x - b[name]).abs().max().item() for name, x in a.items())
    return diff if math.isfinite(diff) else float("inf")


def run_checks(device: torch.device, sizes: CheckSizes, delay_ms: float) -> list[Check]:
    """Every check, in order; a group that raises is one failed check with the error, and the rest still run."""
    checks: list[Check] = []
    with reference_kernel_calls() as calls:
        for group in (check_kernels, check_subsequence_attention, check_engine, check_documents):
            checks += _guarded(group.__name__, group, device, sizes)
    if device.type == "cuda":
        checks.append(Check("no reference-kernel call on CUDA", calls[0] == 0, float(calls[0]), 0.0))
    else:
        checks.append(Check("no reference-kernel call on CUDA", None, float(calls[0]), detail="CPU run"))
    checks += _guarded("check_layer_order", check_layer_order, device, sizes, delay_ms)
    return checks + _guarded("check_offload", check_offload, device, sizes, delay_ms)


def _guarded(name: str, group: Callable[..., list[Check]], *args) -> list[Check]:
    try:
        return group(*args)
    except Exception as error:  # a GPU run must still write its report: the failure is a result
        release_memory(args[0])
        return [Check(f"{name} ran", False, detail=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")]
