"""Seconds for each piece of a step, from FLOPs, bytes and a hardware profile.

Per stage k and subsequence i (n_i tokens after a prefix c_i, split over sp ranks by Ulysses):

    compute    matmul FLOPs / sp / (peak * mfu) + attention FLOPs / sp / (peak * attention_mfu)
               + layers * (layer_overhead + c P_block / HBM) per matmul pass   (FLOPs: ``planner.flops``;
               packed documents of ``document_length`` tokens count only the attention inside them;
               attention_mfu is mfu unless the profile gives it; every matmul pass reads the block's c-byte
               weights from HBM once, which a short subsequence's FLOPs do not hide: the fixed cost of short
               subsequences, SPPO Figure 7)
    all-to-all per layer and pass: 4 all-to-alls (q, k, v to heads; output back) moving
               (n_i / sp) (2 H + 2 G) Dh c bytes, of which (sp - 1) / sp leave the rank; an SP group of whole
               nodes sends the part for other nodes over the network, the rest over NVLink at once
    P2P        (n_i / sp) D m bytes to the neighbour stage (m: message dtype), at NVLink or network speed
    FSDP       all-gather of the stage's working weights (w bytes each) and reduce-scatter of its fp32
               gradients over ds = dp x sp ranks move (ds - 1) / ds of w P_stage and 4 P_stage bytes. When, by
               ``fsdp_sync`` (``parallel/fsdp.py``): "step" gathers at the first forward and reduces after
               the last backward, once per step; "reduce" gathers once per step and reduces in every
               backward; "regather" gathers in every forward and backward and reduces in every backward
    offload    bytes / BW_D2H (BW_H2D): overlapped with the next compute (see ``planner.alpha``)
    recompute  backward runs each block's forward again (``recompute``): "full" all of it (matmuls, attention,
               and under Ulysses the forward's four all-to-alls), "selective" all but the attention kernel
               (matmuls, norms, RoPE; the all-to-alls of q, k, v and of the output, whose sequence-layout copy
               the projection reads is not kept), plus one layer overhead per layer
    K/V spill  with tokens [R, S) of each layer's K/V on host (``kv_device_tokens``): a subsequence's forward
               reads the host part of its prefix (K, V: H2D) and writes its own host part (D2H); its backward
               reads the host part of [0, c + n) (K, V and dK/dV: H2D) and writes dK/dV back (D2H). The copies
               run on a side stream, chunk by chunk, double-buffered, beside the attention over the chunks
               before: per layer and pass only what the copy takes beyond that layer's attention is exposed,
               max(0, copy - attention), H2D and D2H running at once (PCIe is full duplex)
    model state on host (``model_state="host"``): every FSDP gather first copies the rank's fp32 parameter
               shard H2D, every reduce-scatter sends the gradient shard D2H (overlapped as FSDP's traffic is),
               and the step ends with AdamW on the CPU: 28 bytes per parameter of the shard (read p, g, m, v;
               write p, m, v) at ``host_optimizer_bytes_per_s``

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

from dataclasses import dataclass
from functools import cached_property

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.flops import ATTENTION_BACKWARD_FACTOR, attention_flops, block_matmul_params, head_flops
from lightning_sppo.planner.layout import StageSpec
from lightning_sppo.planner.precision import PrecisionBytes
from lightning_sppo.planner.profile import HardwareProfile

__all__ = ["CostModel", "PassTimes"]

_GB = 1e9


@dataclass(frozen=True)
class PassTimes:
    """Seconds of one stage's forward or backward of one subsequence, by kind of work."""

    compute: float
    all_to_all: float
    p2p: float
    fsdp: float = 0.0
    """Exposed FSDP gather / reduce-scatter time of this pass (sync "reduce" and "regather")."""
    spill: float = 0.0
    """Exposed copies of K/V (and dK/dV) spilled to host (``CostModel.spill_seconds``)."""

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

    def forward(
        self, stage: StageSpec, tokens: int, prefix: int, sp: int, *, sp_cross: bool, send_cross: bool | None
    ) -> PassTimes:
        """Forward of one subsequence on one rank of ``stage``; ``send_cross`` is None on the last stage."""
        matmul = stage.layers * 2.0 * tokens * block_matmul_params(self.config)
        attention = stage.layers * attention_flops(self.config, tokens, prefix, self.document_length)
        if stage.last:
            matmul += head_flops(self.config, tokens)
        compute = self.flop_seconds(matmul, attention, sp) + stage.layers * self.layer_fixed_s
        return PassTimes(compute, self._all_to_all(stage, tokens, sp, sp_cross), self._p2p(tokens, sp, send_cross))

    def backward(
        self, stage: StageSpec, tokens: int, prefix: int, sp: int, *, sp_cross: bool, send_cross: bool | None
    ) -> PassTimes:
        """Backward of one subsequence; ``send_cross`` (the input gradient to stage k-1) is None on the first."""
        matmul = 2.0 * 2.0 * tokens * block_matmul_params(self.config)
        forward_attention = attention_flops(self.config, tokens, prefix, self.document_length)
        attention = ATTENTION_BACKWARD_FACTOR * forward_attention
        if self.recompute != "none":  # the block's forward again, with or without its attention
            matmul += 2.0 * tokens * block_matmul_params(self.config)
            attention += forward_attention if self.recompute == "full" else 0.0
        matmul, attention = stage.layers * matmul, stage.layers * attention
        if stage.last:
            matmul += 3.0 * head_flops(self.config, tokens)  # 2x backward + the recomputed loss chunks
        passes = 3 if self.recompute != "none" else 2
        compute = self.flop_seconds(matmul, attention, sp) + passes * stage.layers * self.layer_fixed_s
        all_to_all = self._all_to_all(stage, tokens, sp, sp_cross) * (2 if self.recompute != "none" else 1)
        return PassTimes(compute, all_to_all, self._p2p(tokens, sp, send_cross))

    @cached_property
    def layer_fixed_s(self) -> float:
        """Seconds of one layer's matmul pass that do not shrink with the subsequence: launches and small kernels
        (``layer_overhead_s``) and the read of the block's weights from HBM (``hbm_gbps``)."""
        hbm = self.profile.hbm_gbps
        read = self.dtypes.compute * block_matmul_params(self.config) / (hbm * _GB) if hbm else 0.0
        return self.profile.layer_overhead_s + read

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
        attention = self.flop_seconds(0.0, attention_flops(self.config, tokens, prefix, self.document_length), sp)
        forward = max(self.h2d(read_forward), self.d2h(written * c)) - attention
        backward_copy = max(self.h2d(on_host * (c + a)), self.d2h(on_host * a))
        backward = backward_copy - ATTENTION_BACKWARD_FACTOR * attention
        return stage.layers * max(0.0, forward), stage.layers * max(0.0, backward)

    def flop_seconds(self, matmul: float, attention: float, sp: int = 1) -> float:
        """Seconds of ``matmul`` and ``attention`` FLOPs split over ``sp`` ranks, each at its own achieved rate
        (``HardwareProfile.flops_per_s``, ``attention_flops_per_s``)."""
        return (matmul / self.profile.flops_per_s + attention / self.profile.attention_flops_per_s) / sp

    def optimizer_seconds(self, stage_params: int, shards: int) -> float:
        """AdamW on the CPU over this rank's shard when model state lives on host (0 on the device: negligible)."""
        if self.model_state != "host":
            return 0.0
        return 28.0 * stage_params / shards / self.profile.host_optimizer_bytes_per_s

    def d2h(self, nbytes: float) -> float:
        return nbytes / (self.profile.d2h_gbps * _GB)

    def h2d(self, nbytes: float) -> float:
        return nbytes / (self.profile.h2d_gbps * _GB)

    def fsdp_gather(self, stage_params: int, shards: int, cross_node: bool) -> float:
        """One all-gather of the stage's working weights over ``shards`` ranks (after the H2D of the fp32 shard when
        model state lives on host)."""
        copy = self.h2d(self.dtypes.master * stage_params / shards) if self.model_state == "host" else 0.0
        return copy + self._collective(self.dtypes.working * stage_params, shards, cross_node)

    def fsdp_reduce(self, stage_params: int, shards: int, cross_node: bool) -> float:
        """One reduce-scatter of the stage's (fp32) gradients over ``shards`` ranks (then D2H of the shard when
        model state lives on host)."""
        copy = self.d2h(self.dtypes.reduce * stage_params / shards) if self.model_state == "host" else 0.0
        return copy + self._collective(self.dtypes.reduce * stage_params, shards, cross_node)

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

    def _collective(self, nbytes: float, shards: int, cross_node: bool) -> float:
        """Ring all-gather / reduce-scatter: each rank moves (shards - 1) / shards of the whole."""
        if shards == 1:
            return 0.0
        return nbytes * (shards - 1) / shards / (self._bandwidth(cross_node) * _GB)

    def _all_to_all(self, stage: StageSpec, tokens: int, sp: int, cross: bool) -> float:
        """Each rank sends (sp - 1) / sp of its q, k, v and output to the rest of its group. When the group spans
        whole nodes (``cross``), the (sp - g) / sp bound for ranks on other nodes (g: the group's ranks on one node)
        goes over the network while the (g - 1) / sp for its own node goes over NVLink at the same time: the slower
        of the two counts."""
        if sp == 1:
            return 0.0
        c, h, g = self.config, self.config.n_head, self.config.n_query_groups
        per_layer = tokens / sp * (2 * h + 2 * g) * c.head_size * self.dtypes.compute
        if not cross:
            return stage.layers * per_layer * (sp - 1) / sp / (self._bandwidth(False) * _GB)
        local = min(sp, self.profile.gpus_per_node)  # members of the group on this rank's node
        remote = per_layer * (sp - local) / sp / (self._bandwidth(True) * _GB)
        near = per_layer * (local - 1) / sp / (self._bandwidth(False) * _GB)
        return stage.layers * max(remote, near)

    def _p2p(self, tokens: int, sp: int, cross: bool | None) -> float:
        if cross is None:
            return 0.0
        return tokens / sp * self.config.n_embd * self.dtypes.message / (self._bandwidth(cross) * _GB)

    def _bandwidth(self, cross_node: bool) -> float:
        return self.profile.inter_node_gbps if cross_node else self.profile.intra_node_gbps
