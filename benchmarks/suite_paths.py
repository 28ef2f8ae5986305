"""GPU checks of every memory path against the plain model, not against each other (issue 40 item 2).

Each path trains one batch in bf16 autocast and is compared with the plain full-sequence model trained in fp32 (full
fp32 matmuls, no TF32) from the same weights: the loss and every gradient, the attention projection's gradient cut
into its q, k and v rows (at initialisation the v rows dominate the fused ``qkv`` gradient, and a wrong dq or dk would
hide in it). The bar is the plain model's own bf16 error against the same fp32 reference: a path passes when its
error is at most ``K_PLAIN`` times that. Paths (``PATHS``): the subsequence order and the layer order; offload
none/adaptive/full; recompute none/selective/full; K/V spilled to host and streamed back in chunks; packed documents;
GQA, MQA and MHA. The decisive one is the layer order with ``offload="full"`` and selective recompute: its attention
output comes back from host for every layer but the last (``reviews/gpu-readiness.md`` item 1).

Every check records the attention kernel that ran, from the profiler's kernel names (``suite_profiler``).

Negative control: the decisive path with a stride-blind attention backward (every call reads the attention output's
memory in the other dense layout, BHSD as BSHD or back: what a kernel graph cached under a key without strides would
do) must fail the same bar.

Run alone, or as the GPU suite's child process (a device-side assert in here, e.g. a torn index after an offload
race, poisons only this process's CUDA context)::

    python benchmarks/suite_paths.py --device cpu --tiny --seeds 0 1 2     # the paths' errors over the plain model's
    python benchmarks/suite_paths.py --device cuda --out checks.jsonl       # what the decisive preset runs

``--out`` gets one JSON line per check as soon as it is done (the parent reads them while this runs). Also run here,
first: the kernels against float64, subsequence attention, and the engine, documents, layer order and offload checks
of ``gpu_checks.py``; last, its offload negative control (floating-point payloads only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from gpu_checks import (
    CheckSizes,
    autocast,
    batch,
    check_offload_negative_control,
    document_ids,
    full_fp32_matmuls,
    rel_error,
    release_memory,
    run_checks,
    synchronize,
)
from suite_profiler import profiled
from suite_state import first_line
from torch import Tensor

from lightning_sppo.attention import select_kernel
from lightning_sppo.documents import Documents
from lightning_sppo.loss import chunked_cross_entropy
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT
from lightning_sppo.offload import OffloadCosts, Offloader
from lightning_sppo.recompute import apply_recompute
from lightning_sppo.runtime import LayerMajorEngine, SubsequenceEngine

__all__ = [
    "DECISIVE_PATH",
    "ENDED",
    "K_PLAIN",
    "PATHS",
    "TINY",
    "MemoryPath",
    "PathSizes",
    "path_checks",
    "stride_blind",
]

K_PLAIN = 3.0
"""A path's bf16 error may be at most this many times the plain model's own bf16 error (both against fp32).

Why 3: on CPU (``python benchmarks/suite_paths.py --device cpu --tiny --seeds 0 1 2``: 3 layers, S=256, GQA/MQA/MHA,
with and without documents) every correct path lands at 0.77-1.05x the plain model's error (the same bf16 roundings in
another order, attention partials merged in fp32), and the negative control, a wrong attention-output layout in the
backward, at 69-82x. 3 leaves about 3x headroom over the worst correct path (a GPU's kernels round differently) and
over 20x under the layout bug."""

GROUPS = {"GQA": 2, "MQA": 1, "MHA": None}
"""K/V groups of each attention variant (None: one per head)."""


@dataclass(frozen=True)
class PathSizes:
    """The check model: full width of nothing real, but the head size gpt-1b runs (cuDNN takes it on Hopper)."""

    seq_len: int = 4096
    chunks: int = 4
    """Subsequences (subsequence order) or chunks (layer order)."""
    n_layer: int = 3
    """At least 3: the layer order keeps every layer's checkpoints on host but the last's."""
    n_embd: int = 512
    n_head: int = 4
    head_size: int = 128
    vocab_size: int = 512

    def config(self, variant: str) -> GPTConfig:
        groups = GROUPS[variant] or self.n_head
        return GPTConfig(name=f"check-{variant.lower()}", block_size=self.seq_len, vocab_size=self.vocab_size,
                         n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head, n_query_groups=groups,
                         head_size=self.head_size)  # fmt: skip


TINY = PathSizes(seq_len=256, n_embd=64, n_head=4, head_size=16, vocab_size=256)


@dataclass(frozen=True)
class MemoryPath:
    """One way a step keeps, moves and recomputes what its backward needs."""

    order: str
    offload: str = "none"
    recompute: str = "none"
    spill: bool = False
    """K/V of earlier subsequences or chunks on host (a quarter kept on the device), streamed back in 16 chunks."""
    documents: bool = False
    variant: str = "GQA"

    @property
    def name(self) -> str:
        parts = [f"{self.order} order", self.variant, f"offload {self.offload}", f"recompute {self.recompute}"]
        parts += ["K/V spilled and streamed"] * self.spill + ["packed documents"] * self.documents
        return ", ".join(parts)


DECISIVE_PATH = MemoryPath("layer", "full", "selective")
PATHS = (
    MemoryPath("subsequence"),
    MemoryPath("subsequence", "full", "selective"),
    MemoryPath("subsequence", "adaptive", "full"),
    MemoryPath("subsequence", "full", "selective", spill=True),
    MemoryPath("subsequence", "adaptive", "selective", documents=True),
    MemoryPath("subsequence", "full", "selective", variant="MQA"),
    MemoryPath("subsequence", "none", "full", variant="MHA"),
    MemoryPath("layer", "none", "selective"),
    DECISIVE_PATH,
    MemoryPath("layer", "full", "full"),
    MemoryPath("layer", "full", "selective", spill=True),
    MemoryPath("layer", "full", "selective", documents=True),
    MemoryPath("layer", "full", "selective", variant="MQA"),
    MemoryPath("layer", "full", "full", variant="MHA"),
)
"""Every axis value in both orders (the layer order recomputes, "selective" or "full", and offloads all or nothing);
the paths without offload first, so that one that breaks the CUDA context leaves the others' results."""

Result = tuple[float, dict[str, Tensor]]


# -- the runs --------------------------------------------------------------------------------------------------


class _Bench:
    """One model and batch per (variant, documents), with its fp32 truth and the plain model's bf16 error."""

    def __init__(self, sizes: PathSizes, device: torch.device, seed: int) -> None:
        self.sizes, self.device, self.seed = sizes, device, seed
        self._held: dict[tuple[str, bool], dict[str, Any]] = {}

    def get(self, variant: str, documents: bool) -> dict[str, Any]:
        key = (variant, documents)
        if key not in self._held:
            self._held[key] = self._build(variant, documents)
        return self._held[key]

    def _build(self, variant: str, documents: bool) -> dict[str, Any]:
        config, device = self.sizes.config(variant), self.device
        torch.manual_seed(self.seed)
        model = GPT(config).to(device)
        ids, targets = batch(config, self.sizes.seq_len, device, seed=self.seed)
        docs = document_ids(self.sizes.seq_len, device) if documents else None
        with full_fp32_matmuls():
            truth = _plain(model, ids, targets, docs, None)
        plain, record = profiled(lambda: _plain(model, ids, targets, docs, torch.bfloat16), device)
        error, worst = path_error(plain, truth, config)
        return {"model": model, "ids": ids, "targets": targets, "docs": docs, "truth": truth, "plain_error": error,
                "plain_worst": worst, "plain_attention": record.label}  # fmt: skip


def _grads(model: GPT) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _plain(model: GPT, ids: Tensor, targets: Tensor, docs: Tensor | None, dtype: torch.dtype | None) -> Result:
    model.zero_grad(set_to_none=True)
    documents = Documents.from_ids(docs.cpu(), ids.device) if docs is not None else None
    with autocast(ids.device, dtype)():
        hidden = model.hidden_states(ids, documents=documents)
        loss = chunked_cross_entropy(hidden, model.lm_head.weight, targets, targets.numel())
    loss.backward()
    synchronize(ids.device)
    return loss.item(), _grads(model)


def run_path(
    path: MemoryPath, sizes: PathSizes, model: GPT, ids: Tensor, targets: Tensor, docs: Tensor | None
) -> Result:
    """One bf16 step of ``path``: the loss and every gradient."""
    device, n, seq_len = ids.device, sizes.chunks, sizes.seq_len
    spill = dict(kv_device_tokens=seq_len // 4, kv_chunk_tokens=max(1, seq_len // 16)) if path.spill else {}
    if path.order == "layer":
        engine = LayerMajorEngine(n, attention="auto", recompute=path.recompute, offload=path.offload, **spill)
        return _step(engine, None, model, ids, targets, docs)
    hooks = None
    if path.offload != "none":
        options = (
            {"costs": _partial_costs(path, sizes, model, ids, targets, docs)} if path.offload == "adaptive" else {}
        )
        hooks = Offloader(path.offload, device, min_bytes=0, **options)
    apply_recompute(model, path.recompute)
    try:
        return _step(SubsequenceEngine(n, "flops", attention="auto", hooks=hooks, **spill), hooks, model, ids, targets,
                     docs)  # fmt: skip
    finally:
        apply_recompute(model, "none")


def _step(
    engine: Any, hooks: Offloader | None, model: GPT, ids: Tensor, targets: Tensor, docs: Tensor | None
) -> Result:
    model.zero_grad(set_to_none=True)
    try:
        loss = engine.forward_backward(model, ids, targets, docs, forward_context=autocast(ids.device, torch.bfloat16))
        synchronize(ids.device)
        return loss.item(), _grads(model)
    finally:
        engine.release()
        if hooks is not None:
            hooks.release()


def _partial_costs(path: MemoryPath, sizes: PathSizes, model, ids, targets, docs) -> OffloadCosts:
    """Costs under which "adaptive" offloads part of most subsequences: one full-offload step measures each
    subsequence's bytes, and the threshold is half their mean (alpha_i = threshold / A_i)."""
    hooks = Offloader("full", ids.device, min_bytes=0)
    engine = SubsequenceEngine(sizes.chunks, "flops", attention="auto", hooks=hooks)
    apply_recompute(model, path.recompute)
    model.zero_grad(set_to_none=True)
    level2 = []
    try:
        engine.forward_backward(model, ids, targets, docs, forward_context=autocast(ids.device, torch.bfloat16))
        level2 = [s.level2_bytes for s in hooks.last_stats.subsequences]
    finally:
        engine.release()
        hooks.release()
    return OffloadCosts(d2h_bytes_per_s=1.0, forward_s=(max(1.0, 0.5 * sum(level2) / max(1, len(level2))),))


def gradient_pieces(grads: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Every gradient, the attention projection's cut into its q, k and v rows."""
    H, G, Dh = config.n_head, config.n_query_groups, config.head_size
    out = {}
    for name, grad in grads.items():
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            for part, piece in zip("qkv", grad.split((H * Dh, G * Dh, G * Dh)), strict=True):
                out[f"{name}[{part}]"] = piece
        else:
            out[name] = grad
    return out


def path_error(result: Result, truth: Result, config: GPTConfig) -> tuple[float, str]:
    """The largest relative error of the loss and of every gradient piece against ``truth``, and whose it is."""
    (loss, grads), (truth_loss, truth_grads) = result, truth
    got, want = gradient_pieces(grads, config), gradient_pieces(truth_grads, config)
    errors = {"loss": abs(loss - truth_loss) / abs(truth_loss)}
    errors |= {name: rel_error(got[name], g) for name, g in want.items()}
    worst = max(errors, key=lambda name: errors[name])
    return errors[worst], worst


# -- the stride-blind negative control -------------------------------------------------------------------


def other_layout(x: Tensor) -> Tensor:
    """``x`` [B, H, S, Dh] read from its memory with the strides of the other dense layout (BHSD as BSHD, or back):
    what a kernel replaying a graph built for another layout reads."""
    B, H, S, Dh = x.shape
    bhsd, bshd = (H * S * Dh, S * Dh, Dh, 1), (S * H * Dh, Dh, H * Dh, 1)
    dense = x if x.stride() in (bhsd, bshd) else x.contiguous()
    return torch.as_strided(dense, dense.shape, bshd if dense.stride() == bhsd else bhsd)


@contextmanager
def stride_blind(device: torch.device) -> Iterator[list[int]]:
    """The attention backend ``attention="auto"`` picks on ``device`` reads every attention output in the other
    layout in its backward; yields the number of calls so affected."""
    cls = type(select_kernel("auto", device))
    backward, calls = cls.backward, [0]

    def blind(self, dout, q, k, v, out, *args, **kwargs):
        calls[0] += 1
        return backward(self, dout, q, k, v, other_layout(out), *args, **kwargs)

    cls.backward = blind
    try:
        yield calls
    finally:
        cls.backward = backward


# -- the checks ------------------------------------------------------------------------------------------


def path_checks(device: torch.device, sizes: PathSizes, seed: int = 0) -> Iterator[dict[str, Any]]:
    """The plain model's own bf16 error per model (the bar: it must be bf16's, 1e-4 to 2e-2), every path against the
    plain model, then the negative control; each a check dict as soon as it is done."""
    bench, seen = _Bench(sizes, device, seed), set()
    for path in (*PATHS, None):
        started = time.monotonic()
        spec = path or DECISIVE_PATH
        held = bench.get(spec.variant, spec.documents)
        if (spec.variant, spec.documents) not in seen:
            seen.add((spec.variant, spec.documents))
            yield _bar_check(spec, sizes, held)
        args = (sizes, held["model"], held["ids"], held["targets"], held["docs"])
        if path is None:
            with stride_blind(device) as calls:
                result, record = profiled(partial(run_path, DECISIVE_PATH, *args), device)
            yield _negative(sizes, held, result, record, calls[0], time.monotonic() - started)
        else:
            result, record = profiled(partial(run_path, path, *args), device)
            yield _path_check(path, sizes, held, result, record, time.monotonic() - started)
    release_memory(device)


def _where(sizes: PathSizes, spec: MemoryPath) -> str:
    return f"S={sizes.seq_len}, {sizes.chunks} chunks, {sizes.n_layer} layers, {spec.variant}"


def _bar_check(spec: MemoryPath, sizes: PathSizes, held: dict[str, Any]) -> dict[str, Any]:
    error = held["plain_error"]
    docs = ", packed documents" if spec.documents else ""
    return {"name": f"plain model, bf16 autocast, against fp32 (the bar: {_where(sizes, spec)}{docs})",
            "passed": 1e-4 < error <= 2e-2, "value": error, "limit": 2e-2, "attention": held["plain_attention"],
            "detail": f"bf16's range is 1e-4 to 2e-2 (else autocast did not run); worst: {held['plain_worst']}",
            }  # fmt: skip


def _path_check(path, sizes, held, result: Result, record, seconds: float) -> dict[str, Any]:
    error, worst = path_error(result, held["truth"], held["model"].config)
    limit = K_PLAIN * held["plain_error"]
    return {"name": f"{path.name} = plain model, bf16 ({_where(sizes, path)})", "passed": error <= limit,
            "value": error, "limit": limit, "ratio": error / held["plain_error"], "seconds": seconds,
            **record.to_dict(),
            "detail": f"{error / held['plain_error']:.2f}x the plain model's own bf16 error"
                      f" ({held['plain_error']:.3g}; limit {K_PLAIN:g}x); worst: {worst}"}  # fmt: skip


NEGATIVE = "negative control: the decisive path with a stride-blind attention backward fails the bar"


def _negative(sizes, held, result: Result, record, calls: int, seconds: float) -> dict[str, Any]:
    error, worst = path_error(result, held["truth"], held["model"].config)
    limit = K_PLAIN * held["plain_error"]
    return {"name": NEGATIVE, "passed": error > limit and calls > 0, "value": error, "limit": limit,
            "ratio": error / held["plain_error"], "seconds": seconds, **record.to_dict(),
            "detail": f"{DECISIVE_PATH.name}; {calls} backward calls read the attention output in the other layout:"
                      f" {error / held['plain_error']:.1f}x the plain model's error; passes when it EXCEEDS the"
                      f" limit; worst: {worst}"}  # fmt: skip


# -- the child process ----------------------------------------------------------------------------------------


def all_checks(device: torch.device, tiny: bool, delay_ms: float) -> Iterator[dict[str, Any]]:
    """What the decisive preset's checks part runs, in order: ``gpu_checks.run_checks`` (kernels against float64,
    subsequence attention, engine, documents, layer order, offload with delayed copies), the paths against the plain
    model with their negative control, and last the offload negative control."""
    sizes = CheckSizes(model="tiny-gqa", seq_len=256, head_size=16) if tiny else CheckSizes()
    for check in run_checks(device, sizes, delay_ms):
        yield asdict(check)
    yield from path_checks(device, TINY if tiny else PathSizes())
    for check in check_offload_negative_control(device, sizes, delay_ms):
        yield asdict(check)


ENDED = "checks child process ran to its end"
"""The child's last line: the parent reports a child that ended without it (killed, crashed) as a failed check."""


def _write(out: Path | None, check: dict[str, Any]) -> None:
    if out is None:
        return
    with out.open("a") as f:
        f.write(json.dumps(check, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _ratios(device: torch.device, sizes: PathSizes, seeds: list[int]) -> None:
    """Each path's error over the plain model's, per seed: where ``K_PLAIN`` comes from."""
    table: dict[str, list[float]] = {}
    for seed in seeds:
        for check in path_checks(device, sizes, seed):
            if "ratio" in check:
                table.setdefault(check["name"].split(" = ")[0].split(" (")[0], []).append(check["ratio"])
    for name, ratios in table.items():
        print(f"{min(ratios):6.2f} {max(ratios):6.2f}  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU, seconds)")
    p.add_argument("--out", type=Path, help="append one JSON line per check here (the suite's child process)")
    p.add_argument("--copy-delay-ms", type=float, default=20.0)
    p.add_argument("--seeds", type=int, nargs="+", help="print min and max of each path's error ratio over these seeds")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.seeds:
        _ratios(device, TINY if args.tiny else PathSizes(), args.seeds)
        return 0
    failed = False
    try:
        for check in all_checks(device, args.tiny, args.copy_delay_ms):
            _write(args.out, check)
            failed |= check["passed"] is False
            print(f"{ {True: 'pass', False: 'FAIL', None: 'n/a'}[check['passed']]:<4}  {check['name']}", flush=True)
    except Exception as error:  # e.g. a CUDA context lost to a device-side assert: the checks after it cannot run
        _write(args.out, {"name": ENDED, "passed": False, "detail": f"{type(error).__name__}: {first_line(error)}"})
        raise
    _write(args.out, {"name": ENDED, "passed": True, "detail": "every check above ran"})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
