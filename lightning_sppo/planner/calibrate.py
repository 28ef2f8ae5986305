"""``sppo-plan --calibrate``: measure every term of the cost model on this machine and write a profile JSON.

Each term of ``planner.kernels`` is timed on its own, in about a minute on a GPU (``quick``: seconds, tiny sizes,
what the tests run on CPU):

    matmul      bf16 GEMMs of several shapes, from the 8192^3 reference (``mfu``) down to 512 rows: ``gemm_tile``
                is fitted to how much the smaller ones lose
    attention   every backend the engine can run here (``attention.kernels``: ATen's flash op "sdpa", cuDNN when the
                runtime has it, flash-attn when installed), forward and backward, causal and not, at square and
                prefix shapes (few queries over many keys, as the engine's later subsequences run): each kernel's
                rates are fitted to its times (``fit_rates``)
    elementwise a large add and a cast through HBM: ``elementwise_gbps``
    kernel_s    a chain of tiny kernels replayed as a CUDA graph: a kernel's fixed device cost
    host        the engine's real step on a tiny model (its kernels cost nothing): host seconds per op, per saved
                tensor under the offloader's hooks, per offloaded unit (``host_seconds``)
    copies      pinned device <-> host copies of 1 GiB, each direction
    memory      the device's size, and what is in use outside the caching allocator (the CUDA context)

Links between GPUs and nodes cannot be measured from one process; they, and the peak, stay the closest built-in
profile's. The profile's ``source`` says what was measured here, when, on which device and torch, and what was kept.
``sppo-plan --fit-suite`` then checks the whole model against measured steps (``planner.fit``).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from lightning_sppo.planner.kernels import GEMM_REFERENCE, AttentionKernel, AttentionRates, attention_seconds, gemm_rate
from lightning_sppo.planner.profile import BUILTIN_PROFILES, HardwareProfile

__all__ = ["CalibrationUnavailable", "calibrate", "fit_gemm_tile", "fit_rates", "host_seconds"]

_HEADS, _HEAD_SIZE = 16, 128


class CalibrationUnavailable(RuntimeError):
    """No device to measure."""


def calibrate(device: str | torch.device | None = None, quick: bool = False) -> HardwareProfile:
    """A profile of ``device`` (default: the current CUDA device; ``CalibrationUnavailable`` without one). ``quick``
    measures tiny sizes in seconds: what a CPU run (the tests) can check of the code path, not a usable profile."""
    if device is None:
        if not torch.cuda.is_available():
            raise CalibrationUnavailable(
                "--calibrate needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
                "use --gpu a100-80gb, h100, h200 or a profile JSON instead (--calibrate --device cpu measures this CPU)."
            )
        device = "cuda"
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"--device={str(device)!r} is not a device; use --device cpu, cuda or cuda:N.") from error
    cuda = device.type == "cuda"
    if cuda and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise CalibrationUnavailable(
            f"--device={str(device)!r}: torch sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            " CUDA GPU(s); name a visible one, or --device cpu to measure this CPU."
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device={str(device)!r}: --calibrate measures cpu or cuda devices only.")
    name = torch.cuda.get_device_name(device) if cuda else f"cpu: {_cpu_name()}"
    base = _closest_builtin(name)
    timer = _Timer(device, repeats=3 if quick else 10)
    dtype = torch.bfloat16 if cuda else torch.float32
    peak = base.peak_bf16_tflops if _known(name) else None
    gemms = _gemm_times(timer, dtype, quick)
    reference = max(gemms, key=lambda g: g[0] * g[1] * g[2])
    rate = 2 * math.prod(reference[:3]) / reference[3]
    tile = fit_gemm_tile(gemms)
    ref_rate = rate / gemm_rate(1.0, 1.0, tile, *reference[:3]) * gemm_rate(1.0, 1.0, tile, *(GEMM_REFERENCE,) * 3)
    peak = peak or ref_rate / 1e12
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    attention = _attention(timer, device, dtype, sms, quick)
    copies = _copy_gbps(timer, device, quick)
    host = host_seconds(device, quick)
    stamp = f"{time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__}"
    measured = {
        "mfu": f"measured: {reference[0]}x{reference[1]}x{reference[2]} GEMM, scaled to {GEMM_REFERENCE}^3",
        "gemm_tile": "measured: fitted to GEMMs of 512 to 8192 rows",
        "elementwise_gbps": "measured: a large add and a cast", "kernel_s": "measured: a chain of tiny kernels",
        "host_op_s": "measured: the engine's step on a tiny model", "host_saved_s": "measured: the offloader's hooks",
        "copy_unit_s": "measured: the offloader's copies of tiny units", "d2h_gbps": "measured: pinned copies",
        "h2d_gbps": "measured: pinned copies", "hbm_bytes": "measured: total_memory", "sms": "measured",
        "context_bytes": "measured: in use outside the allocator",
        **{f"attention.{k}": f"measured: {len(v[1])} calls fitted" for k, v in attention.items()},
    }  # fmt: skip
    source = (("date", time.strftime("%Y-%m-%d")), ("device", name), ("torch", torch.__version__),
              *((k, f"{v} ({stamp})") for k, v in measured.items()),
              ("kept", f"from the built-in {base.name}: peak_bf16_tflops, links, host memory, reserve"))  # fmt: skip
    kernels = tuple((k, v[0]) for k, v in attention.items())
    auto = "cudnn" if any(k == "cudnn" for k, _ in kernels) and base.auto_attention == "cudnn" else "flash"
    return replace(
        base, name=f"calibrated: {name}", peak_bf16_tflops=peak, mfu=min(1.0, ref_rate / (peak * 1e12)),
        gemm_tile=tile, sms=sms, attention=kernels or base.attention, auto_attention=auto,
        hbm_bytes=torch.cuda.get_device_properties(device).total_memory if cuda else base.hbm_bytes,
        host_bytes_per_gpu=_host_bytes_per_gpu(), d2h_gbps=copies[0], h2d_gbps=copies[1],
        elementwise_gbps=_elementwise_gbps(timer, device, quick), kernel_s=_kernel_s(timer, device, quick),
        host_op_s=host["host_op_s"], host_saved_s=host["host_saved_s"], copy_unit_s=host["copy_unit_s"],
        context_bytes=_context_bytes(device), gpus_per_node=max(1, torch.cuda.device_count()) if cuda else 1,
        layer_overhead_s=0.0, source=source,
    )  # fmt: skip


# -- timing ------------------------------------------------------------------------------------------------


class _Timer:
    """Median seconds of a callable: CUDA events on a GPU (after a warm-up), the wall clock on CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats

    def __call__(self, fn: Callable[[], object], repeats: int | None = None) -> float:
        fn()
        self.synchronize()
        times = []
        for _ in range(repeats or self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                fn()
                times.append(time.perf_counter() - began)
        return statistics.median(times)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _gemm_times(timer: _Timer, dtype: torch.dtype, quick: bool) -> list[tuple[int, int, int, float]]:
    """(M, N, K, seconds) of GEMMs from the reference cube down to short ones (the engine's short subsequences)."""
    big = 256 if quick else GEMM_REFERENCE
    shapes = [(big, big, big)] + [(m, big // 2, big // 2) for m in (big // 16, big // 8, big // 4, big // 2, big)]
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=timer.device, dtype=dtype)
        b = torch.randn(k, n, device=timer.device, dtype=dtype)
        out.append((m, n, k, timer(lambda a=a, b=b: torch.mm(a, b))))
    return out


def fit_gemm_tile(gemms: Sequence[tuple[int, int, int, float]]) -> float:
    """The tile loss t of ``kernels.gemm_rate`` that best explains the GEMMs' rates (relative least squares; the
    overall rate is a free scale), searched over 0 to 1024."""
    rates = [2 * m * n * k / s for m, n, k, s in gemms]

    def misfit(tile: float) -> float:
        model = [gemm_rate(1.0, 1.0, tile, m, n, k) for m, n, k, _ in gemms]
        logs = [math.log(r / p) for r, p in zip(rates, model, strict=True)]
        mean = sum(logs) / len(logs)
        return sum((x - mean) ** 2 for x in logs)

    return min((float(t) for t in range(0, 1025, 8)), key=misfit)


# -- attention ---------------------------------------------------------------------------------------------


def _attention(
    timer: _Timer, device: torch.device, dtype: torch.dtype, sms: int, quick: bool
) -> dict[str, tuple[AttentionKernel, list]]:
    """Each engine backend available here, timed and fitted: kernel name -> (rates, the measurements)."""
    from lightning_sppo.attention.kernels import KERNEL_NAMES, select_kernel
    from lightning_sppo.planner.costs import ENGINE_KERNELS

    out = {}
    for backend in ("sdpa", "cudnn", "flash_attn"):
        if backend not in KERNEL_NAMES:
            continue
        try:
            kernel = select_kernel(backend, device)
        except ValueError:  # not runnable here (flash-attn not installed, cuDNN off Hopper, ...)
            continue
        name = ENGINE_KERNELS[backend]
        if name in out:
            continue
        calls = _attention_calls(timer, kernel, device, dtype, quick)
        out[name] = (fit_kernel(calls, sms, dtype), calls)
    return out


def _attention_calls(timer: _Timer, kernel, device: torch.device, dtype: torch.dtype, quick: bool) -> list[tuple]:
    """(queries, keys, causal, backward, batch, seconds) for square and prefix shapes."""
    heads, dh = (2, 32) if quick else (_HEADS, _HEAD_SIZE)
    sizes = (128, 256) if quick else (1024, 4096, 16384)
    shapes = [(s, s, True, max(1, sizes[-1] // s)) for s in sizes] + [
        (s, s, False, max(1, sizes[-1] // s)) for s in sizes
    ]
    shapes += [(sizes[0], sizes[-1], False, 1), (sizes[0], sizes[0], True, 1)]  # one short subsequence after a prefix
    out = []
    scale = 1.0 / math.sqrt(dh)
    for q_len, k_len, causal, batch in shapes:
        q = torch.randn(batch, q_len, heads, dh, device=device, dtype=dtype).transpose(1, 2)  # sequence-major
        k = torch.randn(batch, k_len, heads, dh, device=device, dtype=dtype).transpose(1, 2)
        v = torch.randn_like(k)
        o, lse = kernel.forward(q, k, v, causal, scale)
        dout = torch.randn_like(o)
        forward = timer(lambda q=q, k=k, v=v, c=causal: kernel.forward(q, k, v, c, scale))
        backward = timer(
            lambda q=q, k=k, v=v, o=o, lse=lse, d=dout, c=causal: kernel.backward(d, q, k, v, o, lse, c, scale)
        )
        out += [
            (q_len, k_len, causal, False, batch, heads, dh, forward),
            (q_len, k_len, causal, True, batch, heads, dh, backward),
        ]
    return out


def fit_kernel(calls: Sequence[tuple], sms: int, dtype: torch.dtype) -> AttentionKernel:
    """A kernel's forward and backward rates fitted to its measured calls (``fit_rates``)."""
    half = dtype in (torch.float16, torch.bfloat16)
    tiles = {False: dict(tile_q=128, tile_k=64 if half else 128, occupancy=1), True: dict(tile_q=64, tile_k=128, occupancy=1)}  # fmt: skip
    rates = {
        b: fit_rates([c for c in calls if c[3] == b], sms, AttentionRates(tflops=1.0, **tiles[b]))
        for b in (False, True)
    }
    if rates[True].causal == 1.0 and rates[False].causal != 1.0:  # no causal backward measured: the forward's factor
        rates[True] = replace(rates[True], causal=rates[False].causal)
    return AttentionKernel(forward=rates[False], backward=rates[True], source="measured: sppo-plan --calibrate")


def fit_rates(calls: Sequence[tuple], sms: int, start: AttentionRates) -> AttentionRates:
    """``start``'s tiles with ``tflops``, ``cta_tiles`` and ``causal`` fitted to ``calls`` (queries, keys, causal,
    backward, batch, heads, head size, seconds): the rate in closed form (a scale), the CTA cost by a grid search, the
    causal factor as the causal calls' mean ratio; relative least squares on the times."""
    causal_calls = [c for c in calls if c[2]]
    best = None
    for cta_tiles in [x / 4 for x in range(0, 49)]:
        rates = replace(start, tflops=1.0, cta_tiles=cta_tiles, causal=1.0)
        logs = {c: math.log(_seconds(rates, c, sms) / c[7]) for c in calls}  # model at 1 TFLOP/s over measured
        plain = [v for c, v in logs.items() if not c[2]] or list(logs.values())
        scale = sum(plain) / len(plain)  # log of the fitted TFLOP/s
        causal = [v - scale for c, v in logs.items() if c[2]]
        factor = sum(causal) / len(causal) if causal and len(plain) < len(logs) else 0.0
        misfit = sum((v - scale - (factor if c[2] else 0.0)) ** 2 for c, v in logs.items())
        if best is None or misfit < best[0]:
            best = (misfit, cta_tiles, math.exp(scale), math.exp(factor) if causal_calls else 1.0)
    _, cta_tiles, tflops, causal = best
    return replace(start, tflops=tflops, cta_tiles=cta_tiles, causal=min(1.0, causal))


def _seconds(rates: AttentionRates, call: tuple, sms: int) -> float:
    q, k, causal, backward, batch, heads, dh, _ = call
    return attention_seconds(rates, q, k, causal, heads=heads, head_size=dh, batch=batch, sms=sms, backward=backward)


# -- HBM, kernels, host, copies ----------------------------------------------------------------------------


def _elementwise_gbps(timer: _Timer, device: torch.device, quick: bool) -> float:
    """GB/s of a large add (read two, write one) and a bf16 -> fp32 cast, the kinds of kernel the census counts."""
    n = 2**20 if quick else 2**28
    a = torch.randn(n, device=device)
    b = torch.randn(n, device=device)
    half = a.to(torch.bfloat16)
    add = timer(lambda: torch.add(a, b))
    cast = timer(lambda: half.float())
    return (3 * 4 * n + (2 + 4) * n) / (add + cast) / 1e9


def _kernel_s(timer: _Timer, device: torch.device, quick: bool) -> float:
    """Device seconds per tiny kernel: a chain of adds on one element, replayed as a CUDA graph (no host in it)."""
    if device.type != "cuda":
        return 0.0
    x = torch.zeros(1, device=device)
    chain = 100 if quick else 1000
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(chain):
            x.add_(1.0)
    return timer(graph.replay) / chain


def host_seconds(device: torch.device | str = "cpu", quick: bool = False) -> dict[str, float]:
    """Host seconds per op, per saved tensor under the offloader's hooks, and per offloaded unit: the engine's real
    step on a tiny model (d=32), with 2 and 10 layers, plain, with the hooks (``offload="none"``), copying
    (``offload="full"``); the differences over the 8 layers' ops, saved tensors and units (``planner.census``)."""
    from lightning_sppo.planner.census import census, structure_of

    device = torch.device(device)
    n, tokens = 4, 32
    config = _tiny_config(2, n * tokens)
    counts = census(structure_of(config), "autocast").engine["none"]
    first, rest = counts["forward"], counts["forward_prefix"]
    few, many = 2, 10
    layers = many - few
    ops = layers * (first.ops + counts["backward"].ops + (n - 1) * (rest.ops + counts["backward_prefix"].ops))
    saved = layers * (first.saved + (n - 1) * rest.saved)
    units = layers * (first.saved_storages + (n - 1) * rest.saved_storages)
    repeats = 3 if quick else 15
    seconds = {}
    for offload in (None, "none", "full"):
        seconds[offload] = _engine_host_s(device, many, offload, repeats) - _engine_host_s(
            device, few, offload, repeats
        )
    plain, hooked, copied = seconds[None], seconds["none"], seconds["full"]
    return {
        "host_op_s": max(0.0, plain) / ops, "host_saved_s": max(0.0, hooked - plain) / max(saved, 1.0),
        "copy_unit_s": max(0.0, copied - hooked) / max(units, 1.0),
    }  # fmt: skip


def _tiny_config(layers: int, block_size: int):
    from lightning_sppo.model.config import GPTConfig

    reference = GPTConfig.from_name("gpt-1b")  # the structure the census counts the ops of
    return GPTConfig(
        name="host", block_size=block_size, vocab_size=64, n_layer=layers, n_embd=32, n_head=2, n_query_groups=2,
        head_size=16, intermediate_size=64, mlp=reference.mlp, norm=reference.norm,
    )  # fmt: skip


def _engine_host_s(device: torch.device, layers: int, offload: str | None, repeats: int) -> float:
    """Least host seconds of one engine step (bf16 autocast) over ``repeats`` on a tiny model (the least: what the
    work costs without interference): thread CPU time on CPU (other processes do not count), the wall clock up to
    the last op issued on a GPU (its kernels finish far sooner)."""
    from lightning_sppo.model.gpt import GPT
    from lightning_sppo.offload.offloader import Offloader
    from lightning_sppo.runtime.engine import SubsequenceEngine

    n, tokens = 4, 32
    torch.manual_seed(0)
    model = GPT(_tiny_config(layers, n * tokens)).to(device)
    ids = torch.randint(0, 64, (1, n * tokens), device=device)
    hooks = None if offload is None else Offloader(offload, device, min_bytes=0)
    engine = SubsequenceEngine(n, "length", attention="auto", hooks=hooks)
    dtype = torch.bfloat16
    clock = time.thread_time if device.type != "cuda" else time.perf_counter

    def step() -> float:
        began = clock()
        engine.forward_backward(model, ids, ids, forward_context=lambda: torch.autocast(device.type, dtype))
        return clock() - began

    step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(step())
    engine.release()
    if hooks is not None:
        hooks.release()
    return min(times)


def _copy_gbps(timer: _Timer, device: torch.device, quick: bool) -> tuple[float, float]:
    """Pinned host <-> device copy bandwidth, the way the offloader copies (non_blocking into pinned memory)."""
    nbytes = 2**22 if quick else 2**30
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = timer(lambda: host.copy_(gpu, non_blocking=True))
    h2d = timer(lambda: gpu.copy_(host, non_blocking=True))
    return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def _context_bytes(device: torch.device) -> int:
    """Device bytes in use outside PyTorch's caching allocator (CUDA context, libraries' kernels)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def _known(name: str) -> bool:
    return any(tag in name.upper() for tag in ("A100", "H100", "H200"))


def _closest_builtin(device_name: str) -> HardwareProfile:
    upper = device_name.upper()
    for tag, key in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb")):
        if tag in upper:
            return BUILTIN_PROFILES[key]
    return BUILTIN_PROFILES["a100-80gb"]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _host_bytes_per_gpu() -> int:
    """The node's memory less 1/8 for the OS, shared among the visible GPUs (as the built-in profiles assume)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total * 7 // 8 // max(1, torch.cuda.device_count())
