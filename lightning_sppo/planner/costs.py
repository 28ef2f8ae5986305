"""Seconds for each piece of a step: what the GPU does (``planner.kernels``) for each layer pass, and the links.

Per stage k and subsequence i (n_i tokens after a prefix of c_i, split over sp ranks by Ulysses), one layer pass:

    device     the block's GEMMs over n_i / sp tokens at their shape's rate (``kernels.matmul_seconds``); the
               attention calls of the kernel the run uses (``attention_kernel``): the engine's diagonal (causal,
               n_i x n_i) and its prefix (not causal, n_i x c_i), or the plain model's one causal call, each timed
               by the kernel model (``kernels.attention_seconds``, H / sp heads); the HBM bytes of everything else
               (``planner.census``: norms, RoPE, SwiGLU, casts, residual adds, the engine's K/V copies and dK/dV
               sums over the prefix, the weight gradients' casts and sums) at ``elementwise_gbps``, plus
               ``kernel_s`` per op. The last stage adds the head's GEMMs (per loss chunk) and the loss's bytes.
    host       ops x ``host_op_s``: Python, the dispatcher and the launch of every op (``planner.census`` counts
               them per pass)
    compute    max(device, host): the GPU cannot run ahead of the ops the host gives it, so short subsequences,
               whose kernels finish faster than the host issues them, are bound by the host (SPPO Figure 7)
    backward   the GEMMs' input and weight gradients (2x), the attention backward, its own bytes and ops; under
               ``recompute`` the block's forward again (without its attention kernel under "selective")
    packed documents of ``document_length`` tokens: attention only inside them (``planner.flops``): each call's
               time is scaled by its pairs inside documents over all its pairs
    all-to-all per layer and pass: 4 all-to-alls (q, k, v to heads; output back) moving
               (n_i / sp) (2 H + 2 G) Dh c bytes, of which (sp - 1) / sp leave the rank; an SP group of whole
               nodes sends the part for other nodes over the network, the rest over NVLink at once
    P2P        (n_i / sp) D m bytes to the neighbour stage (m: message dtype), at NVLink or network speed
    FSDP       all-gather of the stage's working weights (w bytes each) and reduce-scatter of its fp32
               gradients over ds = dp x sp ranks move (ds - 1) / ds of w P_stage and 4 P_stage bytes. When, by
               ``fsdp_sync`` (``parallel/fsdp.py``): "step" gathers at the first forward and reduces after
               the last backward, once per step; "reduce" gathers once per step and reduces in every
               backward; "regather" gathers in every forward and backward and reduces in every backward
    offload    bytes / BW_D2H (BW_H2D) on the offloader's one copy stream (see ``planner.alpha``)
    K/V spill  with tokens [R, S) of each layer's K/V on host (``kv_device_tokens``): a subsequence's forward
               reads the host part of its prefix (K, V: H2D) and writes its own host part (D2H); its backward
               reads the host part of [0, c + n) (K, V and dK/dV: H2D) and writes dK/dV back (D2H). The copies
               run on the spill's one side stream, chunk by chunk, both directions one after another
               (``kernels.copy_seconds``), beside the attention over the chunks before: per layer and pass only
               what the copies take beyond that layer's attention is exposed
    model state on host (``model_state="host"``): every FSDP gather first copies the rank's fp32 parameter
               shard H2D, every reduce-scatter sends the gradient shard D2H (overlapped as FSDP's traffic is),
               and the step ends with AdamW on the CPU: 28 bytes per parameter of the shard (read p, g, m, v;
               write p, m, v) at ``host_optimizer_bytes_per_s``; on the device the same bytes at
               ``elementwise_gbps`` (``optimizer``: whether the step includes it)

A profile without the kernel terms (``sms``, ``gemm_tile``, ``elementwise_gbps``, ``kernel_s``, ``host_op_s``, an
``attention`` entry) charges what it has: FLOPs at ``mfu`` (attention at ``attention_mfu``) and ``layer_overhead_s``
plus the read of the block's weights at ``hbm_gbps`` per layer pass.

Pipeline and Ulysses communication is charged to the sending action, not overlapped with compute: the
receiver cannot start before the data is there, and Ulysses' all-to-alls sit between the projections and
attention. FSDP2 overlaps a unit's gather (reduce-scatter) with its neighbour's compute, so the pass that
carries it is charged what cannot hide: one unit's share, or whatever exceeds the pass's compute. The
once-per-step gather of "step" and "reduce" rides on the forward of subsequence 0, the once-per-step
reduce-scatter of "step" on its backward (the step's last). Links are not shared out: FSDP traffic is
assumed not to slow the all-to-alls that run beside it. The "sppo" schedule's group traffic (shared units,
streamed weights and K/V) is counted in ``planner.multiplexed`` with ``link_seconds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from lightning_sppo.loss import default_chunk_tokens
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.census import census, structure_of, widths_of
from lightning_sppo.planner.flops import ATTENTION_BACKWARD_FACTOR, attention_flops, block_matmul_params
from lightning_sppo.planner.kernels import (
    ATTENTION_KERNELS,
    attention_seconds,
    block_gemms,
    copy_seconds,
    matmul_seconds,
)
from lightning_sppo.planner.layout import StageSpec
from lightning_sppo.planner.precision import PrecisionBytes
from lightning_sppo.planner.profile import HardwareProfile

__all__ = ["ENGINE_KERNELS", "CostModel", "PassTimes", "block_params", "census_precision", "resolve_attention"]

_GB = 1e9
_ADAMW_BYTES = 28
"""AdamW reads p, g, m, v and writes p, m, v: 7 fp32 values per parameter."""
ENGINE_KERNELS = {"sdpa": "flash", "flash_attn": "flash", "cudnn": "cudnn", "reference": "reference"}
"""The engine's attention backends (``attention.kernels``) and the kernel each runs on a GPU (``planner.kernels``)."""


def _with_host(times: PassTimes, host: float) -> PassTimes:
    """``times`` with more host work: its compute is the larger of device and host work again."""
    compute = times.compute - max(times.device, times.host) + max(times.device, host)
    return PassTimes(compute, times.all_to_all, times.p2p, times.fsdp, times.spill, times.device, host)


def resolve_attention(name: str, profile: HardwareProfile) -> str:
    """The kernel the engine's ``attention=name`` runs on ``profile``'s GPU (a kernel's own name: that kernel): "auto" is
    the profile's ``auto_attention`` when the runtime has that backend (cuDNN on Hopper), else FlashAttention-2."""
    if name in ATTENTION_KERNELS:  # a kernel named as such (a suite row records what ran)
        return name
    if name != "auto":
        if name not in ENGINE_KERNELS:
            raise ValueError(f"Unknown attention={name!r}; choose one of {['auto', *ENGINE_KERNELS]}.")
        return ENGINE_KERNELS[name]
    from lightning_sppo.attention.kernels import KERNEL_NAMES

    available = {ENGINE_KERNELS[k] for k in KERNEL_NAMES if k in ENGINE_KERNELS}
    return profile.auto_attention if profile.auto_attention in available else "flash"


def census_precision(dtypes: PrecisionBytes) -> str:
    """How ``planner.census`` ran the model for these element sizes: "fp32", "autocast" (fp32 residual, bf16
    compute) or "bf16" (FSDP2's bf16 parameters and residual)."""
    if dtypes.compute == 4:
        return "fp32"
    return "autocast" if dtypes.residual == 4 else "bf16"


def block_params(config: GPTConfig) -> int:
    """Parameters of one block (its linear layers and norms), what the weight-gradient bytes scale with."""
    from lightning_sppo.planner.memory import stage_parameters

    return stage_parameters(config, StageSpec(0, 1, first=False, last=False))


@dataclass(slots=True, unsafe_hash=True)
class PassTimes:
    """Seconds of one stage's forward or backward of one subsequence, by kind of work (not frozen, for speed: the
    search makes millions; treat it as a value, ``dataclasses.replace`` to change it: it is hashed by its values, as
    the "sppo" plans' caches key on them)."""

    compute: float
    all_to_all: float
    p2p: float
    fsdp: float = 0.0
    """Exposed FSDP gather / reduce-scatter time of this pass (sync "reduce" and "regather")."""
    spill: float = 0.0
    """Exposed copies of K/V (and dK/dV) spilled to host (``CostModel.spill_seconds``)."""
    device: float = 0.0
    """The GPU's work in ``compute`` (GEMMs, attention, elementwise kernels)."""
    host: float = 0.0
    """The host's work in ``compute`` (its ops); ``compute`` is the larger of the two, plus legacy fixed costs."""

    @property
    def total(self) -> float:
        return self.compute + self.all_to_all + self.p2p + self.fsdp + self.spill


@dataclass(frozen=True)
class CostModel:
    """Times for one model, precision and hardware profile."""

    config: GPTConfig
    dtypes: PrecisionBytes
    profile: HardwareProfile
    document_length: int | None = None
    """Packed documents of this many tokens (attention only inside them, ``planner.flops``); None: one document."""
    recompute: str = "none"
    """What backward recomputes (``planner.options``)."""
    model_state: str = "device"
    """Where parameters, gradients and AdamW live (``planner.options``)."""
    attention: str = "auto"
    """The engine's attention backend ("auto", "sdpa", "flash_attn", "cudnn", "reference"; ``attention_kernel``)."""
    optimizer: bool = True
    """Whether a step includes the optimizer's step (a training step does; ``benchmarks/gpu_suite.py``'s does not)."""
    kv_grads: str = "before_last"
    """The dK/dV buffers the engine holds: "before_last", the tokens before the last subsequence (later subsequences
    add to those only; none at N = 1), or "sequence", the whole sequence (the engine before 9ccb41d, which the first
    GPU rows measured)."""

    # -- the passes ------------------------------------------------------------------------------------

    def forward(
        self, stage: StageSpec, tokens: int, prefix: int, sp: int, *, sp_cross: bool, send_cross: bool | None
    ) -> PassTimes:
        """Forward of one subsequence on one rank of ``stage``; ``send_cross`` is None on the last stage."""
        device, host = self.layer_forward(tokens, prefix, sp)
        device, host = stage.layers * device, stage.layers * host
        if stage.last:
            head_device, head_host = self.head_seconds(tokens / sp, backward=False)
            device, host = device + head_device, host + head_host
        compute = max(device, host) + stage.layers * self.legacy_fixed_s
        all_to_all, p2p = self._all_to_all(stage, tokens, sp, sp_cross), self._p2p(tokens, sp, send_cross)
        return PassTimes(compute, all_to_all, p2p, device=device, host=host)

    def backward(
        self, stage: StageSpec, tokens: int, prefix: int, sp: int, *, sp_cross: bool, send_cross: bool | None
    ) -> PassTimes:
        """Backward of one subsequence; ``send_cross`` (the input gradient to stage k-1) is None on the first."""
        device, host = self.layer_backward(tokens, prefix, sp)
        device, host = stage.layers * device, stage.layers * host
        if stage.last:
            head_device, head_host = self.head_seconds(tokens / sp, backward=True)
            device, host = device + head_device, host + head_host
        passes = 3 if self.recompute != "none" else 2
        compute = max(device, host) + passes * stage.layers * self.legacy_fixed_s
        all_to_all = self._all_to_all(stage, tokens, sp, sp_cross) * (2 if self.recompute != "none" else 1)
        return PassTimes(compute, all_to_all, self._p2p(tokens, sp, send_cross), device=device, host=host)

    @cached_property
    def _memo(self) -> dict:
        """Results of the pure functions below by their arguments: the search asks for the same passes across sync
        modes, offload policies and N."""
        return {}

    def layer_forward(self, tokens: int, prefix: int, sp: int = 1) -> tuple[float, float]:
        """(device, host) seconds of one layer's forward over ``tokens`` after ``prefix`` on one of ``sp`` ranks."""
        key = ("forward", tokens, prefix, sp)
        if key not in self._memo:
            self._memo[key] = self._layer_forward(tokens, prefix, sp)
        return self._memo[key]

    def _layer_forward(self, tokens: int, prefix: int, sp: int) -> tuple[float, float]:
        counts = self._pass("forward_prefix" if prefix else "forward")
        local = tokens / sp
        device = self.matmul_seconds(local, 1) + self.engine_attention_seconds(tokens, prefix, sp, backward=False)
        device += self._traffic(counts, local, prefix / sp, first=prefix == 0)
        return device, self.host_seconds(counts.ops)

    def layer_backward(self, tokens: int, prefix: int, sp: int = 1) -> tuple[float, float]:
        """(device, host) seconds of one layer's backward (with its recomputed forward, ``recompute``)."""
        key = ("backward", tokens, prefix, sp)
        if key not in self._memo:
            self._memo[key] = self._layer_backward(tokens, prefix, sp)
        return self._memo[key]

    def _layer_backward(self, tokens: int, prefix: int, sp: int) -> tuple[float, float]:
        counts = self._pass("backward_prefix" if prefix else "backward")
        local = tokens / sp
        again = self.recompute != "none"
        device = self.matmul_seconds(local, 3 if again else 2)
        device += self.engine_attention_seconds(tokens, prefix, sp, backward=True)
        if self.recompute == "full":
            device += self.engine_attention_seconds(tokens, prefix, sp, backward=False)
        device += self._traffic(counts, local, prefix / sp)
        return device, self.host_seconds(counts.ops)

    def plain_layer_seconds(self, tokens: int, checkpointed: bool, kernel: str | None = None) -> tuple[float, float]:
        """(device, host) seconds of one layer of the plain model over all ``tokens`` at once, forward and backward
        (``checkpointed``: the block's forward again in backward, as full activation checkpointing runs it)."""
        counts = self.census.plain
        forward, backward = (
            counts["ac_forward" if checkpointed else "forward"],
            counts["ac_backward" if checkpointed else "backward"],
        )
        name = kernel or self.profile.sdpa_attention
        share = self._document_share(tokens, 0)  # packed documents: attention only inside them
        attention = share * self.attention_call(name, tokens, tokens, True, self.config.n_head, backward=False)
        attention_backward = share * self.attention_call(name, tokens, tokens, True, self.config.n_head, backward=True)
        device = self.matmul_seconds(tokens, 4 if checkpointed else 3) + attention * (2 if checkpointed else 1)
        device += (
            attention_backward + self._traffic(forward, tokens, 0, first=True) + self._traffic(backward, tokens, 0)
        )
        return device, self.host_seconds(forward.ops + backward.ops)

    def head_seconds(self, tokens: float, backward: bool) -> tuple[float, float]:
        """(device, host) seconds of the final norm, head and chunked loss over ``tokens`` (one rank's): forward, or
        backward with each chunk's logits recomputed (``loss.py`` checkpoints them)."""
        key = ("head", tokens, backward)
        if key not in self._memo:
            self._memo[key] = self._head_seconds(tokens, backward)
        return self._memo[key]

    def _head_seconds(self, tokens: float, backward: bool) -> tuple[float, float]:
        chunk = default_chunk_tokens(self.config.vocab_size)
        chunks = math.ceil(tokens / chunk) if tokens else 0
        gemm = ((self.config.n_embd, self.config.vocab_size),)
        passes = 3 if backward else 1
        full, rest = divmod(tokens, chunk)
        device = passes * (full * self._gemm_seconds(chunk, gemm) + self._gemm_seconds(rest, gemm))
        counts = self.census.head_backward if backward else self.census.head_forward
        head_params = self.config.vocab_size * self.config.n_embd
        nbytes = counts.bytes(self._widths, tokens, 0, head_params * chunks, chunks, head_params)  # per chunk: the cast
        ops = counts.op_count(chunks)
        device += self.elementwise_seconds(nbytes, ops)
        return device, self.host_seconds(ops)

    # -- the terms (``planner.kernels``) ----------------------------------------------------------------

    def matmul_seconds(self, tokens: float, passes: int) -> float:
        """``passes`` GEMM passes of one block's weights over ``tokens`` rows (forward 1, backward 2)."""
        return passes * self._gemm_seconds(tokens, block_gemms(self.config))

    def _gemm_seconds(self, tokens: float, gemms) -> float:
        p = self.profile
        return matmul_seconds(p.peak_bf16_tflops * 1e12, p.mfu, p.gemm_tile, tokens, gemms)

    def engine_attention_seconds(self, tokens: int, prefix: int, sp: int, backward: bool) -> float:
        """One layer's attention in the engine: the diagonal (causal) and the prefix (not causal, in blocks of
        ``kv_chunk_tokens`` when K/V are spilled), ``H / sp`` heads each."""
        name = self.attention_kernel
        heads = max(1, self.config.n_head // sp)
        seconds = self.attention_call(name, tokens, tokens, True, heads, backward)
        if prefix:
            seconds += self.attention_call(name, tokens, prefix, False, heads, backward)
        return seconds * self._document_share(tokens, prefix)

    def attention_call(self, kernel: str, queries: int, keys: int, causal: bool, heads: int, backward: bool) -> float:
        """Seconds of one attention call of ``kernel`` (``kernels.attention_seconds``); a profile that does not rate
        the kernel (or sets ``attention_mfu``) times its FLOPs at ``attention_flops_per_s``."""
        key = ("attention", kernel, queries, keys, causal, heads, backward)
        if key not in self._memo:
            self._memo[key] = self._attention_call(kernel, queries, keys, causal, heads, backward)
        return self._memo[key]

    def _attention_call(self, kernel: str, queries: int, keys: int, causal: bool, heads: int, backward: bool) -> float:
        rates = self.profile.attention_kernel(kernel)
        if rates is None or self.profile.attention_mfu is not None or not self.profile.sms:
            pairs = queries * keys - (queries * (queries - 1) / 2 if causal else 0)
            flops = 4.0 * pairs * heads * self.config.head_size * (ATTENTION_BACKWARD_FACTOR if backward else 1.0)
            return flops / self.attention_flops_per_s
        return attention_seconds(
            rates.backward if backward else rates.forward, queries, keys, causal, heads=heads,
            head_size=self.config.head_size, sms=self.profile.sms, backward=backward,
        )  # fmt: skip

    @cached_property
    def attention_kernel(self) -> str:
        """The kernel the engine's ``attention`` runs on this profile's GPU (``resolve_attention``)."""
        return resolve_attention(self.attention, self.profile)

    def elementwise_seconds(self, nbytes: float, ops: float = 0.0) -> float:
        """Device seconds of elementwise kernels moving ``nbytes`` through HBM in ``ops`` kernels."""
        bandwidth = self.profile.elementwise_gbps
        return (nbytes / (bandwidth * _GB) if bandwidth else 0.0) + ops * self.profile.kernel_s

    def host_seconds(self, ops: float) -> float:
        """Host seconds of issuing ``ops`` ops."""
        return ops * self.profile.host_op_s

    def saved_per_layer(self, prefix: bool) -> tuple[float, float]:
        """(tensors saved, distinct activation storages) per layer of one forward (``planner.census``): what the
        offloader's hooks pack and unpack, and the units it copies."""
        counts = self._pass("forward_prefix" if prefix else "forward")
        return counts.saved, counts.saved_storages

    def with_hooks(self, times: PassTimes, stage: StageSpec, prefix: int) -> PassTimes:
        """``times`` of a pass run under the offloader's hooks: each saved tensor costs the host ``host_saved_s``
        (packed in forward, unpacked in backward: half each)."""
        saved, _ = self.saved_per_layer(prefix > 0)
        return _with_host(times, times.host + stage.layers * saved * self.profile.host_saved_s / 2)

    def with_copies_issued(self, times: PassTimes, units: float) -> PassTimes:
        """``times`` of a pass at whose end (forward: its own D2H) or start (backward: the previous subsequence's H2D)
        the offloader issues copies of ``units`` saved tensors from Python on the host (``copy_unit_s`` each)."""
        return _with_host(times, times.host + units * self.profile.copy_unit_s)

    def _traffic(self, counts, tokens: float, prefix: float, first: bool = False) -> float:
        """Device seconds of one pass's elementwise bytes and ops (``first``: the step's first forward, which casts
        the weights autocast then caches)."""
        params = self._block_params if (first or counts.per_param) else 0
        nbytes = counts.bytes(self._widths, tokens, prefix, params)
        return self.elementwise_seconds(nbytes, counts.ops)

    def step_seconds(self, stage: StageSpec, device_tokens: int, sp: int) -> float:
        """Device seconds a step spends once per layer besides its passes: the K/V gradient buffers of
        ``device_tokens`` tokens zeroed (charged to the first forward, ``evaluate.stage_times``)."""
        counts = self.census.step
        nbytes = counts.bytes(self._widths, device_tokens / sp) if self.dtypes.compute else 0.0
        return stage.layers * self.elementwise_seconds(nbytes, counts.ops)

    def _pass(self, name: str):
        return self.census.engine[self.recompute][name]

    @cached_property
    def census(self):
        """What each pass does besides GEMMs and attention (``planner.census``), for this model's structure."""
        return census(structure_of(self.config), census_precision(self.dtypes))

    @cached_property
    def _widths(self) -> dict[str, int]:
        return widths_of(self.config)

    @cached_property
    def _block_params(self) -> int:
        return block_params(self.config)

    @cached_property
    def legacy_fixed_s(self) -> float:
        """A profile without the kernel terms: ``layer_overhead_s`` plus the block's weights read at ``hbm_gbps``."""
        hbm, p = self.profile.hbm_gbps, self.profile
        read = self.dtypes.compute * block_matmul_params(self.config) / (hbm * _GB) if hbm and not p.gemm_tile else 0.0
        return self.profile.layer_overhead_s + read

    @cached_property
    def layer_fixed_s(self) -> float:
        """Seconds of one layer pass that do not shrink with the subsequence: the host's ops, or on the device the
        kernels' fixed costs and the weight-gradient bytes, whichever is longer (mean of forward and backward), plus
        the legacy term. The solver stops cutting where these outweigh the matmuls (``solver.shortest_tokens``)."""
        passes = [self._pass("forward"), self._pass("backward")]
        fixed = []
        for counts in passes:
            device = self.elementwise_seconds(counts.per_param * block_params(self.config), counts.ops)
            fixed.append(max(device, self.host_seconds(counts.ops)))
        return sum(fixed) / len(fixed) + self.legacy_fixed_s

    def _document_share(self, tokens: int, prefix: int) -> float:
        """Attention pairs inside documents over all pairs (1 without documents)."""
        if self.document_length is None:
            return 1.0
        whole = attention_flops(self.config, tokens, prefix)
        return attention_flops(self.config, tokens, prefix, self.document_length) / whole if whole else 1.0

    def spill_seconds(
        self, stage: StageSpec, tokens: int, prefix: int, sp: int, device_tokens: int, batch: int = 1
    ) -> tuple[float, float]:
        """(forward, backward) seconds the K/V copies of one subsequence add beyond its attention (module docstring).

        ``device_tokens`` R: each layer's tokens [0, R) are on the device, the rest on host."""
        c, a = self.dtypes.compute, self.dtypes.accumulation
        per_token = 2 * batch * (self.config.n_query_groups // sp) * self.config.head_size  # K and V elements
        read_forward = max(0, prefix - device_tokens) * per_token * c
        written = max(0, prefix + tokens - max(prefix, device_tokens)) * per_token  # its own tokens on host
        on_host = max(0, prefix + tokens - device_tokens) * per_token
        forward = self.copy_seconds(written * c, read_forward) - self.engine_attention_seconds(
            tokens, prefix, sp, backward=False
        )
        backward = self.copy_seconds(on_host * a, on_host * (c + a)) - self.engine_attention_seconds(
            tokens, prefix, sp, backward=True
        )
        return stage.layers * max(0.0, forward), stage.layers * max(0.0, backward)

    def copy_seconds(self, d2h_bytes: float, h2d_bytes: float) -> float:
        """Copies on one stream, both directions sharing its time (``kernels.copy_seconds``)."""
        return copy_seconds(d2h_bytes, h2d_bytes, self.profile.d2h_gbps, self.profile.h2d_gbps)

    def flop_seconds(self, matmul: float, attention: float, sp: int = 1) -> float:
        """Seconds of ``matmul`` and ``attention`` FLOPs split over ``sp`` ranks, at the reference GEMM rate and the
        engine kernel's long-call rate (``HardwareProfile.flops_per_s``, ``attention_flops_per_s``)."""
        return (matmul / self.profile.flops_per_s + attention / self.attention_flops_per_s) / sp

    @cached_property
    def attention_flops_per_s(self) -> float:
        """FLOP/s of the engine's attention in a long call: ``attention_mfu`` of the peak when the profile sets it,
        else its kernel's forward and backward rates in the 1 : 2.5 mix of a training step (causal), else ``mfu``."""
        p = self.profile
        if p.attention_mfu is not None:
            return p.peak_bf16_tflops * 1e12 * p.attention_mfu
        rates = p.attention_kernel(self.attention_kernel)
        if rates is None or not p.sms:
            return p.flops_per_s
        f, b = rates.forward, rates.backward
        mix = 1 + ATTENTION_BACKWARD_FACTOR
        return mix / (1 / (f.tflops * f.causal) + ATTENTION_BACKWARD_FACTOR / (b.tflops * b.causal)) * 1e12

    def optimizer_seconds(self, stage_params: int, shards: int) -> float:
        """AdamW's step over this rank's shard: on the CPU when model state lives on host, else on the device (0 when
        the step has no optimizer, or the profile no ``elementwise_gbps``)."""
        if not self.optimizer:
            return 0.0
        nbytes = _ADAMW_BYTES * stage_params / shards
        if self.model_state == "host":
            return nbytes / self.profile.host_optimizer_bytes_per_s
        return self.elementwise_seconds(nbytes)

    def d2h(self, nbytes: float) -> float:
        return nbytes / (self.profile.d2h_gbps * _GB)

    def h2d(self, nbytes: float) -> float:
        return nbytes / (self.profile.h2d_gbps * _GB)

    def fsdp_gather(self, stage_params: int, shards: int, cross_node: bool) -> float:
        """One all-gather of the stage's working weights over ``shards`` ranks (after the H2D of the fp32 shard when
        model state lives on host)."""
        copy = self.h2d(self.dtypes.master * stage_params / shards) if self.model_state == "host" else 0.0
        return copy + self.collective_seconds(self.dtypes.working * stage_params, shards, cross_node)

    def fsdp_reduce(self, stage_params: int, shards: int, cross_node: bool) -> float:
        """One reduce-scatter of the stage's (fp32) gradients over ``shards`` ranks (then D2H of the shard when
        model state lives on host)."""
        copy = self.d2h(self.dtypes.reduce * stage_params / shards) if self.model_state == "host" else 0.0
        return copy + self.collective_seconds(self.dtypes.reduce * stage_params, shards, cross_node)

    def fsdp_pass_comm(
        self, stage_params: int, shards: int, cross_node: bool, sync: str, *, backward: bool, first: bool
    ) -> float:
        """FSDP communication of one forward or backward pass under ``sync``, before overlap with compute.

        ``first``: the pass of subsequence 0, i.e. the step's first forward or its last backward, where "step"
        gathers (reduces) and "reduce" gathers.
        """
        gather = sync == "regather" or (first and not backward)
        reduce = backward and (sync != "step" or first)
        return gather * self.fsdp_gather(stage_params, shards, cross_node) + reduce * self.fsdp_reduce(
            stage_params, shards, cross_node
        )

    def link_seconds(self, nbytes: float, cross_node: bool) -> float:
        """Moving ``nbytes`` into (or out of) one rank over an NVLink-class or a network link."""
        return nbytes / (self._bandwidth(cross_node) * _GB)

    def collective_seconds(self, nbytes: float, shards: int, cross_node: bool) -> float:
        """Ring all-gather / reduce-scatter of ``nbytes`` over ``shards`` ranks: each moves (shards - 1) / shards of
        the whole."""
        if shards == 1:
            return 0.0
        return nbytes * (shards - 1) / shards / (self._bandwidth(cross_node) * _GB)

    def _all_to_all(self, stage: StageSpec, tokens: int, sp: int, cross: bool) -> float:
        """Each rank sends (sp - 1) / sp of its q, k, v and output to the rest of its group, per layer of the stage
        (``all_to_all_seconds``)."""
        c = self.config
        return stage.layers * self.all_to_all_seconds(tokens, sp, cross, 2 * c.n_head + 2 * c.n_query_groups)

    def all_to_all_seconds(self, tokens: int, sp: int, cross: bool, widths: int) -> float:
        """Ulysses all-to-alls of one layer over a subsequence (or chunk) of ``tokens``: each rank holds tokens / sp
        of them and sends (sp - 1) / sp of ``widths`` head-sized vectors per token (q, k, v and the output: 2 H +
        2 G) to the rest of its group. When the group spans whole nodes (``cross``), the (sp - g) / sp bound for
        ranks on other nodes (g: the group's ranks on one node) goes over the network while the (g - 1) / sp for its
        own node goes over NVLink at the same time: the slower of the two counts."""
        if sp == 1:
            return 0.0
        per_layer = tokens / sp * widths * self.config.head_size * self.dtypes.compute
        if not cross:
            return per_layer * (sp - 1) / sp / (self._bandwidth(False) * _GB)
        local = min(sp, self.profile.gpus_per_node)  # members of the group on this rank's node
        remote = per_layer * (sp - local) / sp / (self._bandwidth(True) * _GB)
        near = per_layer * (local - 1) / sp / (self._bandwidth(False) * _GB)
        return max(remote, near)

    def _p2p(self, tokens: int, sp: int, cross: bool | None) -> float:
        if cross is None:
            return 0.0
        return tokens / sp * self.config.n_embd * self.dtypes.message / (self._bandwidth(cross) * _GB)

    def _bandwidth(self, cross_node: bool) -> float:
        return self.profile.inter_node_gbps if cross_node else self.profile.intra_node_gbps
