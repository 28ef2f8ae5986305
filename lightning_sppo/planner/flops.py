"""FLOPs of one pipeline stage's work on one subsequence, counted the way the kernels do it.

For a subsequence of n tokens after a prefix of c tokens, per transformer layer (forward):

    matmuls    2 n P_block                 P_block: the weights one token multiplies with in a block
    attention  4 n (c + n/2) H Dh          QK^T and PV, 2 Dh FLOPs each per (query, key) pair; causal,
                                           so the pairs are n c (prefix) + n (n + 1) / 2 ~ n (c + n/2),
                                           each pair counted once (the masked half is not counted)

This is Seq1F1B's count (their Eq. 4, ``partition.flops``: 2 n P + 2 L n (c + n) d summed over layers)
with the causal half of the diagonal block taken out.

Packed documents (``document_length`` Ld): a query sees only the earlier keys of its own document. The planner
does not know where a batch's documents start, so it assumes documents of Ld tokens laid back to back from
position 0: query t sees (t mod Ld) + 1 keys, and the pairs of tokens [0, T) are G(T) = q Ld^2 / 2 + r^2 / 2
(T = q Ld + r, continuous as above), so a subsequence has G(c + n) - G(c) pairs, which is n (c + n/2) again when
Ld >= c + n. Real documents vary in length; for the same mean length the pairs are more (long documents weigh
quadratically), so this is a lower bound that is close when lengths are similar (packed pretraining windows of
fixed-length documents), and the real partition (``partition.masked_flops``) counts the actual documents. Backward: 2x the matmuls, 2.5x the attention
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
    "attention_pairs",
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


def attention_pairs(tokens: float, prefix: float, document_length: float | None = None) -> float:
    """(query, key) pairs of n queries after c earlier tokens: n (c + n/2), or within documents of
    ``document_length`` tokens laid back to back (module docstring)."""
    if document_length is None:
        return tokens * (prefix + tokens / 2.0)
    return _pairs_before(prefix + tokens, document_length) - _pairs_before(prefix, document_length)


def _pairs_before(end: float, document_length: float) -> float:
    """G(T): the pairs of tokens [0, T) when documents of ``document_length`` tokens start at 0, Ld, 2 Ld, ..."""
    whole, rest = divmod(end, document_length)
    return whole * document_length * document_length / 2.0 + rest * rest / 2.0


def attention_flops(config: GPTConfig, tokens: float, prefix: float, document_length: float | None = None) -> float:
    """4 n (c + n/2) H Dh: causal attention of n queries after c earlier tokens, one layer, forward (with
    ``document_length``: only the pairs inside documents)."""
    return 4.0 * attention_pairs(tokens, prefix, document_length) * config.n_head * config.head_size


def layer_forward_flops(config: GPTConfig, tokens: float, prefix: float, document_length: float | None = None) -> float:
    """Forward FLOPs of one block on a subsequence: matmuls plus causal attention."""
    return 2.0 * tokens * block_matmul_params(config) + attention_flops(config, tokens, prefix, document_length)


def head_flops(config: GPTConfig, tokens: float) -> float:
    """2 n V D: the output projection (logits) of n tokens, forward."""
    return 2.0 * tokens * config.vocab_size * config.n_embd


def sequence_model_flops(config: GPTConfig, lengths: Sequence[int], document_length: float | None = None) -> float:
    """Training FLOPs of one sequence cut into ``lengths``: 3x the forward of every layer and the head."""
    total, prefix = 0.0, 0
    for n in lengths:
        total += config.n_layer * layer_forward_flops(config, n, prefix, document_length) + head_flops(config, n)
        prefix += n
    return 3.0 * total
