"""Subsequence attention over a device-resident K/V cache, with exact gradients, and its kernel backends."""

from lightning_sppo.attention.apply import apply_subsequence_attention, subsequence_cores
from lightning_sppo.attention.kernels import (
    AttentionKernel,
    CudnnKernel,
    FlashAttnKernel,
    ReferenceKernel,
    SDPAKernel,
    select_kernel,
)
from lightning_sppo.attention.kv_cache import KV_GRAD_DTYPES, KVCache
from lightning_sppo.attention.subsequence import (
    SharedUnitAttention,
    SubsequenceAttention,
    attend,
    attend_backward,
    merge_partials,
    prefix_start,
    subsequence_attention,
)

__all__ = [
    "KV_GRAD_DTYPES",
    "AttentionKernel",
    "CudnnKernel",
    "FlashAttnKernel",
    "KVCache",
    "ReferenceKernel",
    "SDPAKernel",
    "SharedUnitAttention",
    "SubsequenceAttention",
    "apply_subsequence_attention",
    "attend",
    "attend_backward",
    "merge_partials",
    "prefix_start",
    "select_kernel",
    "subsequence_attention",
    "subsequence_cores",
]
