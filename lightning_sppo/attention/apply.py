"""Apply subsequence attention to a plain model, torchtitan-style: the model file stays unchanged."""

from __future__ import annotations

from torch import nn

from lightning_sppo.attention.kernels import AttentionKernel
from lightning_sppo.attention.subsequence import SubsequenceAttention
from lightning_sppo.model.gpt import CausalSelfAttention

__all__ = ["apply_subsequence_attention", "subsequence_cores"]


def apply_subsequence_attention(model: nn.Module, kernel: AttentionKernel) -> list[SubsequenceAttention]:
    """Give every ``CausalSelfAttention`` a ``SubsequenceAttention`` core using ``kernel``.

    Idempotent: cores that are already subsequence cores get the new kernel. Returns the cores in layer order.
    """
    cores = []
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            if isinstance(module.core, SubsequenceAttention):
                module.core.kernel = kernel
            else:
                module.core = SubsequenceAttention(kernel)
            cores.append(module.core)
    if not cores:
        raise TypeError(
            f"{type(model).__name__} has no lightning_sppo CausalSelfAttention layers to run subsequence"
            " attention in; build the model with lightning_sppo.GPT."
        )
    return cores


def subsequence_cores(model: nn.Module) -> list[SubsequenceAttention]:
    """The subsequence cores of ``model`` in layer order (empty if not applied)."""
    return [m for m in model.modules() if isinstance(m, SubsequenceAttention)]
