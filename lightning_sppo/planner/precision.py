"""Bytes per element that each precision setting puts in memory and on the wire.

* ``"bf16-mixed"`` (default): what the runtime does today under Fabric's bf16-mixed. Parameters are fp32 and
  are the optimizer's master weights; autocast runs matmuls, attention and the MLP in bf16 and keeps a bf16
  copy of each weight from the first forward to the last backward. The residual stream and the pipeline
  messages stay fp32 (autocast only lowers matmul outputs; ``runtime/pipeline.py``, ``_dtype``). FSDP2 gathers
  the fp32 weights and accumulates fp32 gradients unsharded for the whole step.
* ``"bf16-fsdp-mp"`` (what-if, not applied by ``parallel/fsdp.py`` yet): FSDP2 with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. The gathered weights, their unsharded
  gradients, the residual stream and the messages are bf16; the fp32 shards are the master weights. Plan with
  it to see what the change would buy.
* ``"fp32"``: everything in fp32 (the CPU tests).

In all of them AdamW keeps two fp32 moments per parameter, sharded over dp x sp, and dK/dV accumulate in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["PRECISIONS", "Precision", "PrecisionBytes", "precision_bytes"]

Precision = Literal["bf16-mixed", "bf16-fsdp-mp", "fp32"]
PRECISIONS: tuple[str, ...] = get_args(Precision)


@dataclass(frozen=True)
class PrecisionBytes:
    """Element sizes under one precision setting."""

    compute: int
    """Matmul inputs/outputs, attention, MLP activations and the K/V cache."""
    residual: int
    """Residual stream and pipeline messages."""
    working: int
    """Per parameter: the weights the step computes with (FSDP's gathered copy, held for the whole step)."""
    working_grad: int
    """Per parameter: the unsharded gradient the step's backwards accumulate into."""
    master: int = 4
    """Per parameter: the fp32 master weights (FSDP shards, or the parameters themselves without FSDP)."""
    autocast_copy: int = 0
    """Per parameter: autocast's low-precision weight copy, cached from the first forward to the last backward."""
    accumulation: int = 4
    """dK/dV accumulation buffers (fp32 whatever the compute dtype; DESIGN.md, "Pitfalls")."""
    optimizer: int = 8
    """AdamW: two fp32 moments per parameter."""

    @property
    def autocast(self) -> bool:
        """Whether autocast makes activation copies (compute dtype narrower than the residual stream)."""
        return self.compute < self.residual


_BYTES: dict[str, PrecisionBytes] = {
    "bf16-mixed": PrecisionBytes(compute=2, residual=4, working=4, working_grad=4, autocast_copy=2),
    "bf16-fsdp-mp": PrecisionBytes(compute=2, residual=2, working=2, working_grad=2),
    "fp32": PrecisionBytes(compute=4, residual=4, working=4, working_grad=4),
}


def precision_bytes(precision: str) -> PrecisionBytes:
    """Element sizes for ``precision``; errors name the valid choices."""
    if precision not in _BYTES:
        raise ValueError(f"Unknown --precision={precision!r}; choose one of {list(PRECISIONS)}.")
    return _BYTES[precision]
