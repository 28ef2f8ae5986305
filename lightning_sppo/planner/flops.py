"""FLOPs of one pipeline stage's work on one subsequence, counted the way the kernels do it.

For a subsequence of n tokens after a prefix of c tokens, per transformer layer (forward):

    matmuls    2 n P_block                 P_block: the weights one token multiplies with in a block
    attention  4 n (c + n/2) H Dh          QK^T and PV, 2 Dh FLOPs each per (query, key) pair; causal,
                                           so the pairs are n c (prefix) + n (n + 1) / 2 ~ n (c + n/2),
                                           each pair counted once (the masked half is not counted)

This is Seq1F1B's count (their Eq. 4, ``partition.flops``: 2 n P + 2 L n (c + n) d summed over layers)
with the causal half of the diagonal block taken out. Backward: 2x the matmuls, 2.5x the attention
(flash attention's backward recomputes QK^T and P, then dV, dP, dQ, dK: five matmuls to the forward's
two). The last stage adds the output head, 2 n V D, whose loss chunks are recomputed in backward
(``loss.py`` checkpoints them), so its backward is 3x. Model FLOPs for MFU use the usual 3x forward
(no recomputation counted).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_sppo.model.config import GPTConfig

__all__ = [
    "ATTENTION_BACKWARD_FACTOR",
    "attention_flops",
    "block_matmul_params",
    "head_flops",
    "layer_forward_flops",
    "sequence_model_flops",
]

ATTENTION_BACKWARD_FACTOR = 2.5
"""Flash attention backward / forward FLOPs: 5 matmuls against 2."""


def block_matmul_params(config: GPTConfig) -> int:
    """P_block: weights one token multiplies with in one block (qkv, proj, MLP; norms and biases are negligible)."""
    d, h, g, dh = config.n_embd, config.n_head, config.n_query_groups, config.head_size
    attention = d * (h + 2 * g) * dh + h * dh * d
    mlp = (3 if config.mlp == "swiglu" else 2) * d * config.intermediate_size
    return attention + mlp


def attention_flops(config: GPTConfig, tokens: float, prefix: float) -> float:
    """4 n (c + n/2) H Dh: causal attention of n queries after c earlier tokens, one layer, forward."""
    return 4.0 * tokens * (prefix + tokens / 2.0) * config.n_head * config.head_size


def layer_forward_flops(config: GPTConfig, tokens: float, prefix: float) -> float:
    """Forward FLOPs of one block on a subsequence: matmuls plus causal attention."""
    return 2.0 * tokens * block_matmul_params(config) + attention_flops(config, tokens, prefix)


def head_flops(config: GPTConfig, tokens: float) -> float:
    """2 n V D: the output projection (logits) of n tokens, forward."""
    return 2.0 * tokens * config.vocab_size * config.n_embd


def sequence_model_flops(config: GPTConfig, lengths: Sequence[int]) -> float:
    """Training FLOPs of one sequence cut into ``lengths``: 3x the forward of every layer and the head."""
    total, prefix = 0.0, 0
    for n in lengths:
        total += config.n_layer * layer_forward_flops(config, n, prefix) + head_flops(config, n)
        prefix += n
    return 3.0 * total
