"""Activation bytes one pipeline stage holds per token: what the code saves, counted from the code.

Level 1 (SPPO section 5.1, kept on the device): the per-layer K/V cache [B, G/sp, S, Dh] in the compute
dtype for the whole sequence, plus fp32 dK/dV buffers of the same shape from the first backward on
(``attention/kv_cache.py``). Level 2: everything else autograd saves for backward, per subsequence; a
share alpha_i of it may go to host memory. The paper counts about 36 BSH bytes of level 2 per layer for
its Megatron layer; ours differs because the terms below are read off ``model/gpt.py``,
``attention/subsequence.py``, ``parallel/ulysses.py`` and ``loss.py``, one saved storage each (checked
byte for byte against a saved-tensor hook count in ``tests/planner/test_memory_measured.py``):

per layer and local token (D hidden, H heads, G K/V groups, Dh head size, I MLP width; c compute and r
residual element bytes, see ``planner.precision``)
    norm inputs     2 r D          the block input and the mid-block sum, as norm_1 and norm_2 save them
    RMSNorm         2 * 4          the fp32 1 / rms (its autograd function recomputes x / rms in backward)
    LayerNorm       2 * 8          mean and rstd
    norm readers    k c D          each linear's saved input: k = 2, or 3 under autocast with SwiGLU,
                                   whose fc_1 and fc_2 each make their own bf16 copy of the norm output
    attention       2 c H Dh + 4 H q after RoPE and the output (saved by the attention function; flash
                                   kernels return [B, s, H, Dh] memory, so the proj input is a view of
                                   it), and the fp32 log-sum-exp
    RoPE, c < 4     + k c n_rope   cos/sin cast in every layer: k = 4 under autocast (apply_rope casts them
                                   for q and for k), 2 under FSDP mixed precision (each block casts its inputs
                                   once); in fp32 the tables are shared: 2 * 4 * n_rope per stage instead
    Ulysses sp > 1  + c H Dh       the proj input is a fresh copy after the all-to-all back
    no RoPE         + 2 c G Dh     q is then a view of the whole qkv output
    MLP             4 c I / 2 c I  SwiGLU: fc_1, fc_2, silu and product; GELU: fc and gelu outputs
per stage and token, on the last stage: the final norm's input and own terms, and its output, which
the checkpointed loss keeps (the logits are recomputed in backward). Per step: the int64 token ids
(first stage) and targets (last stage) of the whole sequence.
Recompute (``recompute``, ``lightning_sppo/recompute.py``) keeps less per layer and token, and runs the block's
forward again in backward (its level 2 then exists for one layer at a time: ``recompute_transient_bytes_per_token``):
    "full"          r D            the block input only (K/V stay at level 1 as always)
    "selective"     r D + c H Dh + 4 H   the block input, the attention output (heads-sharded under Ulysses,
                                   before its all-to-all back) and the fp32 log-sum-exp
and per stage, under either, the fp32 cos/sin tables the checkpointed blocks take as inputs (2 * 4 * n_rope,
shared by all layers): the casts happen inside the recomputed blocks.
Not counted: parameters, their views and casts (autocast's weight copies are counted with the model state).
Layout caveat: with partial RoPE the CPU SDPA kernel returns a contiguous [B, H, s, Dh] output, so the
proj input becomes a copy (+ c H Dh, about 5% for ``tiny-gelu``); flash-attn returns [B, s, H, Dh] memory.
"""

from __future__ import annotations

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.precision import PrecisionBytes

__all__ = [
    "kv_cache_bytes_per_layer",
    "layer_saved_bytes_per_token",
    "received_input_saved_bytes",
    "recompute_transient_bytes_per_token",
    "stage_extra_bytes_per_token",
    "stage_saved_bytes_per_token",
    "step_constant_bytes",
]

_FP32 = 4
_INT64 = 8


def _norm_input_bytes(config: GPTConfig, dtypes: PrecisionBytes) -> int:
    """A norm's input, which both norms save as it is (in the residual stream's dtype)."""
    return dtypes.residual * config.n_embd


def _norm_own_bytes(config: GPTConfig) -> int:
    """What one norm saves per token besides its input and output."""
    return 2 * _FP32 if config.norm == "layernorm" else _FP32  # mean and rstd, or RMSNorm's 1 / rms


def _rope_bytes_per_layer(config: GPTConfig, dtypes: PrecisionBytes) -> int:
    """The cos/sin copies a layer casts to the compute dtype (``PrecisionBytes.rope_casts``); the muls save them."""
    return dtypes.rope_casts * dtypes.compute * config.rope_n_elem


def layer_saved_bytes_per_token(config: GPTConfig, dtypes: PrecisionBytes, sp: int = 1, recompute: str = "none") -> int:
    """Level-2 bytes one transformer block keeps per local token under ``recompute`` (module docstring lists the
    terms)."""
    if recompute == "full":
        return _norm_input_bytes(config, dtypes)
    if recompute == "selective":
        return _norm_input_bytes(config, dtypes) + _attention_kept_bytes(config, dtypes)
    if recompute != "none":
        raise ValueError(f"recompute={recompute!r} is not one of 'none', 'selective', 'full'.")
    d, h, g, dh = config.n_embd, config.n_head, config.n_query_groups, config.head_size
    c = dtypes.compute
    residual = 2 * _norm_input_bytes(config, dtypes)  # the block input and the mid-block sum, as the norms save them
    # Each linear reading a norm output saves its input; under autocast each makes its own bf16 copy, so
    # SwiGLU's fc_1 and fc_2 save two. Without autocast they share the norm output.
    mlp_readers = 2 if config.mlp == "swiglu" and dtypes.autocast else 1
    norms = 2 * _norm_own_bytes(config) + (1 + mlp_readers) * c * d
    attention = 2 * c * h * dh + _FP32 * h + _rope_bytes_per_layer(config, dtypes)
    if sp > 1:
        attention += c * h * dh
    if config.rope_n_elem == 0:
        attention += 2 * c * g * dh
    mlp = (4 if config.mlp == "swiglu" else 2) * c * config.intermediate_size
    return residual + norms + attention + mlp


def _attention_kept_bytes(config: GPTConfig, dtypes: PrecisionBytes) -> int:
    """What selective recompute keeps of the attention per local token: its output and fp32 log-sum-exp."""
    return dtypes.compute * config.n_head * config.head_size + _FP32 * config.n_head


def recompute_transient_bytes_per_token(
    config: GPTConfig, dtypes: PrecisionBytes, sp: int = 1, recompute: str = "none"
) -> int:
    """Per local token, what a block's backward recomputes and holds for that one layer: all it would have saved
    ("full"), or all but the attention output and log-sum-exp it kept ("selective"); 0 without recompute."""
    if recompute == "none":
        return 0
    everything = layer_saved_bytes_per_token(config, dtypes, sp)
    if recompute == "full":
        return everything
    return everything - _attention_kept_bytes(config, dtypes)


def stage_extra_bytes_per_token(
    config: GPTConfig, dtypes: PrecisionBytes, *, last: bool, recompute: str = "none"
) -> int:
    """Level-2 bytes per local token a stage saves besides its blocks: RoPE tables, the last stage's head."""
    shared = not dtypes.rope_casts or recompute != "none"  # recomputed blocks take the fp32 tables as inputs
    rope = 2 * _FP32 * config.rope_n_elem if shared else 0  # fp32 cos/sin shared by all layers
    if not last:
        return rope
    # The final norm's input (the last block's output), the norm itself, and its output, which the
    # checkpointed loss keeps in the residual dtype (the cast to bf16 happens inside the checkpoint).
    return rope + _norm_input_bytes(config, dtypes) + _norm_own_bytes(config) + dtypes.residual * config.n_embd


def received_input_saved_bytes(config: GPTConfig, dtypes: PrecisionBytes) -> int:
    """Per token, the bytes of a stage's saved level 2 that are the received hidden states themselves.

    On all but the first stage the input is a leaf that requires grad, held by the pipeline runtime; the
    offloader treats it like a parameter. The first block's norm saves it as it is, unless the block casts
    it first (a message dtype other than the residual stream's).
    """
    uncast = dtypes.residual == dtypes.message
    saves_itself = uncast and _norm_input_bytes(config, dtypes) == dtypes.residual * config.n_embd
    return dtypes.message * config.n_embd if saves_itself else 0


def stage_saved_bytes_per_token(
    config: GPTConfig, dtypes: PrecisionBytes, layers: int, *, last: bool, sp: int = 1, recompute: str = "none"
) -> int:
    """Level-2 bytes a stage of ``layers`` blocks keeps per local token of a subsequence under ``recompute``."""
    return layers * layer_saved_bytes_per_token(config, dtypes, sp, recompute) + stage_extra_bytes_per_token(
        config, dtypes, last=last, recompute=recompute
    )


def step_constant_bytes(seq_len: int, batch: int, *, first: bool, last: bool) -> int:
    """int64 token ids (embedding, first stage) and targets (loss, last stage): whole-sequence storages."""
    return _INT64 * batch * seq_len * (int(first) + int(last))


def kv_cache_bytes_per_layer(
    config: GPTConfig, dtypes: PrecisionBytes, seq_len: int, sp: int = 1, batch: int = 1
) -> tuple[int, int]:
    """(K/V cache, dK/dV buffers) of one layer: [B, G/sp, S, Dh] each for K and V, the whole sequence."""
    elements = 2 * batch * (config.n_query_groups // sp) * seq_len * config.head_size
    return elements * dtypes.compute, elements * dtypes.accumulation
