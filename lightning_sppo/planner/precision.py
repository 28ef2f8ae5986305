"""Bytes per element that each precision setting puts in memory and on the wire, as the runtime runs it.

* ``"bf16-mixed"`` (default): Lightning's bf16-mixed. How the runtime applies it depends on the layout:

  - a sharded stage (dp * sp > 1, FSDP2): ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
    (``parallel/fsdp.py``). FSDP gathers bf16 weights from the fp32 shards (the optimizer's master
    weights); the residual stream, every activation and the pipeline messages are bf16
    (``parallel.fsdp.activation_dtype``); each block casts the fp32 RoPE tables to bf16 once. Gradients that
    accumulate unsharded between the N backwards are fp32 (FSDP2 upcasts them to the reduce dtype), and
    reduce-scatters move fp32.
  - an unsharded stage (dp * sp = 1, no FSDP): autocast only. Parameters are fp32; autocast runs matmuls,
    attention and the MLP in bf16 and keeps a bf16 copy of each weight from the first forward to the last
    backward; the residual stream and the pipeline messages stay fp32.
* ``"fp32"``: everything in fp32 (the CPU tests).

In all of them AdamW keeps two fp32 moments per parameter, sharded over dp x sp, and dK/dV accumulate in fp32,
unless the run opts into ``kv_grad_dtype="bf16"`` (``--kv-grad-dtype=bf16``): then the K/V cache's dK/dV
accumulators are bf16, two bytes less per element, and their sums over later subsequences round in bf16 (lossy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch

from lightning_sppo.attention.kv_cache import KV_GRAD_DTYPES, KVGradDtype

__all__ = ["KV_GRAD_DTYPES", "PRECISIONS", "KVGradDtype", "Precision", "PrecisionBytes", "precision_bytes"]

Precision = Literal["bf16-mixed", "fp32"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
_KV_GRAD_BYTES = {name: (dtype or torch.float32).itemsize for name, dtype in KV_GRAD_DTYPES.items()}
"""Bytes per dK/dV element under each ``kv_grad_dtype``, from the runtime's table (None: fp32)."""


@dataclass(frozen=True)
class PrecisionBytes:
    """Element sizes under one precision setting, for a sharded (FSDP) or an unsharded stage."""

    compute: int
    """Matmul inputs/outputs, attention, MLP activations and the K/V cache."""
    residual: int
    """The residual stream inside a stage."""
    message: int
    """Pipeline messages, and the stage inputs and outputs the pipeline holds for backward."""
    working: int
    """Per parameter: the weights the step computes with (FSDP's gathered copy, or the fp32 parameters)."""
    working_grad: int
    """Per parameter: the unsharded gradient the step's backwards accumulate into."""
    sharded: bool = False
    """FSDP2 shards the stage over dp x sp (master weights, reduced gradients and AdamW state per shard)."""
    fresh_grad: int = 4
    """Per parameter: the gradient one backward produces before FSDP accumulates or reduces it."""
    master: int = 4
    """Per parameter: the fp32 master weights (FSDP shards, or the parameters themselves without FSDP)."""
    reduce: int = 4
    """Per parameter: what a reduce-scatter moves (FSDP2 reduces in fp32)."""
    autocast_copy: int = 0
    """Per parameter: autocast's low-precision weight copy, cached from the first forward to the last backward."""
    rope_casts: int = 0
    """Copies of the [s, n_rope] cos/sin tables each layer casts and saves (0: the fp32 tables are shared)."""
    accumulation: int = 4
    """dK/dV accumulation buffers: fp32 whatever the compute dtype (DESIGN.md, "Pitfalls"), 2 under the opt-in
    ``kv_grad_dtype="bf16"``."""
    optimizer: int = 8
    """AdamW: two fp32 moments per parameter."""

    @property
    def autocast(self) -> bool:
        """Whether autocast makes activation copies (compute dtype narrower than the residual stream)."""
        return self.compute < self.residual

    @property
    def kv_grad_dtype(self) -> str:
        """The ``kv_grad_dtype`` setting these sizes were made for ("fp32" or "bf16")."""
        return "bf16" if self.accumulation == _KV_GRAD_BYTES["bf16"] else "fp32"


_FP32 = PrecisionBytes(compute=4, residual=4, message=4, working=4, working_grad=4)
_BYTES: dict[tuple[str, bool], PrecisionBytes] = {
    ("fp32", False): _FP32,
    ("fp32", True): PrecisionBytes(compute=4, residual=4, message=4, working=4, working_grad=4, sharded=True),
    # autocast: apply_rope casts cos and sin for q and for k (4 copies per layer)
    ("bf16-mixed", False): PrecisionBytes(
        compute=2, residual=4, message=4, working=4, working_grad=4, autocast_copy=2, rope_casts=4
    ),
    # FSDP2 mixed precision: each block casts cos and sin once (2 copies per layer)
    ("bf16-mixed", True): PrecisionBytes(
        compute=2, residual=2, message=2, working=2, working_grad=4, sharded=True, fresh_grad=2, rope_casts=2
    ),
}


def precision_bytes(precision: str, sharded: bool = False, kv_grad_dtype: str = "fp32") -> PrecisionBytes:
    """Element sizes for ``precision`` on a stage sharded by FSDP (dp * sp > 1) or not, with dK/dV accumulated in
    ``kv_grad_dtype``; errors name the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown --precision={precision!r}; choose one of {list(PRECISIONS)}.")
    if kv_grad_dtype not in KV_GRAD_DTYPES:
        raise ValueError(f"Unknown --kv-grad-dtype={kv_grad_dtype!r}; choose one of {list(KV_GRAD_DTYPES)}.")
    return replace(_BYTES[(precision, sharded)], accumulation=_KV_GRAD_BYTES[kv_grad_dtype])
