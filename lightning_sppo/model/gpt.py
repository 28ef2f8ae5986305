"""A plain decoder-only GPT (LLaMA-style by default). Parallelism is applied from outside.

Shape legend: B batch, S sequence (or subsequence) length, D hidden size, H query heads,
G K/V heads (query groups), Dh head size, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_sppo.model.config import GPTConfig

__all__ = ["GPT", "Block", "CausalSelfAttention", "DenseCausalAttention", "rope_cos_sin"]


class GPT(nn.Module):
    """``model(input_ids)`` is the plain full-sequence forward and returns logits [B, S, V].

    ``offset`` is the position of ``input_ids[:, 0]`` in the full sequence; a non-zero offset only makes
    sense once the attention cores have been swapped for ones that see earlier tokens (see
    ``lightning_sppo.attention``).

    ``blocks`` is a ModuleDict keyed "0".."n_layer-1" (state-dict keys as with a ModuleList), so a pipeline
    stage can drop the layers, the embedding (``wte = None``) or the head (``norm_f = lm_head = None``) it
    does not own and keep the plain model's keys for the rest, as torchtitan does.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte: nn.Embedding | None = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.norm_f: nn.Module | None = _norm(config)
        self.lm_head: nn.Linear | None = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.reset_parameters()

    def forward(self, input_ids: Tensor, offset: int = 0) -> Tensor:
        return self.lm_head(self.hidden_states(input_ids, offset))  # [B, S, V]

    def hidden_states(self, x: Tensor, offset: int = 0) -> Tensor:
        """Hidden states [B, S, D] after the final norm: everything but the output head.

        x is token ids [B, S] when the model has its embedding, else hidden states [B, S, D] from the
        previous pipeline stage (then the final norm applies only if this part of the model has it).
        """
        seq_len = x.shape[1]
        if offset < 0 or offset + seq_len > self.config.block_size:
            raise ValueError(
                f"Sequence positions {offset}..{offset + seq_len - 1} exceed the model's"
                f" block_size={self.config.block_size}; raise GPTConfig.block_size or shorten the sequence."
            )
        h = self.wte(x) if self.wte is not None else x  # [B, S, D]
        cos, sin = rope_cos_sin(self.config, offset, seq_len, device=h.device)
        for block in self.blocks.values():
            h = block(h, cos, sin, offset)
        return self.norm_f(h) if self.norm_f is not None else h

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        for name, param in self.named_parameters():
            if name.endswith(("norm_1.weight", "norm_2.weight", "norm_f.weight")):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                param.normal_(0.0, 0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                param.normal_(0.0, 0.02)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm_1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = _norm(config)
        self.mlp = SwiGLU(config) if config.mlp == "swiglu" else GeluMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, offset: int = 0) -> Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin, offset)
        return x + self.mlp(self.norm_2(x))


class CausalSelfAttention(nn.Module):
    """Projections and RoPE; the attention itself is ``self.core``, which parallelisms may replace."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size = config.n_head, config.n_query_groups, config.head_size
        qkv_size = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.qkv = nn.Linear(config.n_embd, qkv_size, bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)
        self.core: nn.Module = DenseCausalAttention()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, offset: int = 0) -> Tensor:
        B, S, _ = x.shape
        H, G, Dh = self.n_head, self.n_query_groups, self.head_size
        q, k, v = self.qkv(x).split((H * Dh, G * Dh, G * Dh), dim=-1)
        q = q.view(B, S, H, Dh).transpose(1, 2)  # [B, H, S, Dh]
        k = k.view(B, S, G, Dh).transpose(1, 2)  # [B, G, S, Dh]
        v = v.view(B, S, G, Dh).transpose(1, 2)  # [B, G, S, Dh]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core(q, k, v, offset)  # [B, H, S, Dh]
        return self.proj(y.transpose(1, 2).reshape(B, S, H * Dh))


class DenseCausalAttention(nn.Module):
    """Full-sequence causal attention through ``scaled_dot_product_attention`` (query and key lengths equal)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, offset: int = 0) -> Tensor:
        if offset != 0:
            raise ValueError(
                f"Plain attention only sees the tokens it is given, so offset must be 0, got offset={offset}."
                " Train subsequences through SPPOStrategy.forward_backward (or apply_subsequence_attention)."
            )
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class SwiGLU(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class GeluMLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class _RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * w, normalised in fp32 (or wider) whatever the compute dtype, saving only x and 1 / rms.

    Left to autograd the same ops would save an fp32 copy of x and the fp32 x / rms as well: 8 bytes per
    element against x's own 2 (bf16) or 4, in every norm of every layer, for every token of a long sequence.
    Backward recomputes x / rms from x (the forward's exact values) and applies the RMSNorm gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        x_acc = x.to(acc)
        rstd = torch.rsqrt(x_acc.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return (x_acc * rstd * weight.to(acc)).to(x.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        y = x.to(rstd.dtype) * rstd  # the normalised input, as forward computed it
        dout_acc = dout.to(rstd.dtype)
        dy = dout_acc * weight.to(rstd.dtype)
        # d/dx of x * rstd(x): rstd * (dy - y * mean(dy * y)) over the normalised dimension
        dx = rstd * (dy - y * (dy * y).mean(-1, keepdim=True))
        dweight = (dout_acc * y).reshape(-1, y.shape[-1]).sum(0)
        return dx.to(x.dtype), dweight.to(weight.dtype), None


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


def rope_cos_sin(config: GPTConfig, offset: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos/sin [S, n_rope] for positions offset .. offset + length - 1.

    Angles are formed in float64: at a million positions fp32 would be off by ~0.06 rad, and a
    subsequence must see exactly the angles the full sequence sees at the same positions.
    """
    n = config.rope_n_elem
    inv_freq = config.rope_base ** -(torch.arange(0, n, 2, device=device, dtype=torch.float64) / n)
    positions = torch.arange(offset, offset + length, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq).repeat(1, 2)  # [S, n_rope]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of x [B, heads, S, Dh] (half-split, LLaMA/NeoX layout)."""
    n = cos.shape[-1]
    if n == 0:
        return x
    rot, rest = x[..., :n], x[..., n:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out
