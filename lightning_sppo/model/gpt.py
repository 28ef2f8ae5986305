"""A plain decoder-only GPT (LLaMA-style by default). Parallelism is applied from outside.

Shape legend: B batch, S sequence (or subsequence) length, D hidden size, H query heads,
G K/V heads (query groups), Dh head size, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_sppo.documents import Documents
from lightning_sppo.model.config import GPTConfig, RopeScaling
from lightning_sppo.model.init import draw_init_seed, initialise

__all__ = [
    "GPT",
    "Block",
    "CausalSelfAttention",
    "DenseCausalAttention",
    "rope_cos_sin",
    "rope_cos_sin_at",
    "rope_frequencies",
]


class GPT(nn.Module):
    """``model(input_ids)`` is the plain full-sequence forward and returns logits [B, S, V].

    ``document_ids`` [B, S] (integer, non-decreasing along each row) marks packed documents: a token attends only
    to the earlier tokens of its own document and its RoPE position restarts at 0 at each document's first token,
    so every document is trained as if alone (``lightning_sppo.documents``). None: one causal sequence per row.

    ``offset`` is the position of ``input_ids[:, 0]`` in the full sequence; a non-zero offset only makes
    sense once the attention cores have been swapped for ones that see earlier tokens (see
    ``lightning_sppo.attention``).

    ``blocks`` is a ModuleDict keyed "0".."n_layer-1" (state-dict keys as with a ModuleList), so a pipeline
    stage can drop the layers, the embedding (``wte = None``) or the head (``norm_f = lm_head = None``) it
    does not own and keep the plain model's keys for the rest, as torchtitan does.

    With ``config.tie_embeddings`` the head's weight is the embedding's (one parameter, two state-dict keys);
    a pipeline's first and last stages each keep one of the two.

    Initial weights depend on ``init_seed`` (one draw from torch's global generator when the model is built) and
    each parameter's name only (``lightning_sppo.model.init``): a stage built on the meta device and initialised
    where it runs gets the plain model's weights, on any layout.

    Hugging Face checkpoints in and out are the loaders' business, not the model's: ``load_hf_model`` and
    ``save_hf_model`` in ``lightning_sppo.model.hf`` (which imports this module; this one imports nothing back).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # Drawn before any submodule: torch's own layer initialisation consumes the global generator on a real
        # device and not on the meta device, and both must draw the same seed.
        self.init_seed = draw_init_seed()
        """The seed of the initial weights (``reset_parameters``), drawn from torch's global generator."""
        self.wte: nn.Embedding | None = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.norm_f: nn.Module | None = _norm(config, config.n_embd)
        self.lm_head: nn.Linear | None = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Make the head use the embedding's weight (``tie_embeddings``), when this part of the model has both."""
        if self.config.tie_embeddings and self.wte is not None and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> GPT:
        """As ``nn.Module.to_empty``, which allocates every parameter anew and so unties them: tie again."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def forward(self, input_ids: Tensor, document_ids: Tensor | None = None, *, offset: int = 0) -> Tensor:
        documents = None
        if document_ids is not None:
            if offset != 0:
                raise ValueError(
                    f"document_ids describe the tokens given, from position 0, so offset must be 0, got offset={offset}."
                    " Train subsequences through SPPOStrategy.forward_backward(..., document_ids=...)."
                )
            documents = _documents_of(input_ids, document_ids)
        return self.lm_head(self.hidden_states(input_ids, offset, documents))  # [B, S, V]

    def hidden_states(self, x: Tensor, offset: int = 0, documents: Documents | None = None) -> Tensor:
        """Hidden states [B, S, D] after the final norm: everything but the output head.

        x is token ids [B, S] when the model has its embedding, else hidden states [B, S, D] from the
        previous pipeline stage (then the final norm applies only if this part of the model has it).
        ``documents`` covers the whole sequence x is a part of (x holds its positions offset .. offset + S - 1).
        """
        seq_len = x.shape[1]
        if offset < 0 or offset + seq_len > self.config.block_size:
            raise ValueError(
                f"Sequence positions {offset}..{offset + seq_len - 1} exceed the model's"
                f" block_size={self.config.block_size}; raise GPTConfig.block_size or shorten the sequence."
            )
        h = self.wte(x) if self.wte is not None else x  # [B, S, D]
        if documents is None:
            cos, sin = rope_cos_sin(self.config, offset, seq_len, device=h.device)  # [S, n_rope]
        else:
            cos, sin = rope_cos_sin_at(self.config, documents.positions(offset, seq_len))  # [B, 1, S, n_rope]
        for block in self.blocks.values():
            h = block(h, cos, sin, offset, documents)
        return self.norm_f(h) if self.norm_f is not None else h

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer), norms 1, biases 0;
        each parameter drawn by its name and ``init_seed`` (the same values whatever part of the model this is)."""
        initialise(self, self.init_seed, self.config.n_layer, self.config.tie_embeddings)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm_1 = _norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = _norm(config, config.n_embd)
        self.mlp = SwiGLU(config) if config.mlp == "swiglu" else GeluMLP(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, offset: int = 0, documents: Documents | None = None
    ) -> Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin, offset, documents)
        return x + self.mlp(self.norm_2(x))


class CausalSelfAttention(nn.Module):
    """Projections, q/k norms and RoPE; the attention itself is ``self.core``, which parallelisms may replace.

    ``qkv`` is one projection whose output rows are [q; k; v] (H, G and G heads of Dh channels).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size = config.n_head, config.n_query_groups, config.head_size
        qkv_size = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.qkv = nn.Linear(config.n_embd, qkv_size, bias=config.bias or config.attn_bias)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)
        # Qwen3: one norm over the head size, shared by all heads, on q and on k before RoPE.
        self.norm_q: nn.Module | None = _norm(config, config.head_size) if config.norm_qk else None
        self.norm_k: nn.Module | None = _norm(config, config.head_size) if config.norm_qk else None
        self.core: nn.Module = DenseCausalAttention()

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, offset: int = 0, documents: Documents | None = None
    ) -> Tensor:
        B, S, _ = x.shape
        q, k, v = self.heads(x, cos, sin)
        y = self.core(q, k, v, offset, documents)  # [B, H, S, Dh]
        return self.proj(y.transpose(1, 2).reshape(B, S, self.n_head * self.head_size))

    def heads(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, S, Dh], k and v [B, G, S, Dh]: the projection, q/k norms and RoPE, all that runs before the core
        (token by token, so any range of tokens can run it alone)."""
        B, S, _ = x.shape
        H, G, Dh = self.n_head, self.n_query_groups, self.head_size
        q, k, v = self.qkv(x).split((H * Dh, G * Dh, G * Dh), dim=-1)
        q, k, v = q.view(B, S, H, Dh), k.view(B, S, G, Dh), v.view(B, S, G, Dh)
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q = q.transpose(1, 2)  # [B, H, S, Dh]
        k = k.transpose(1, 2)  # [B, G, S, Dh]
        v = v.transpose(1, 2)  # [B, G, S, Dh]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class DenseCausalAttention(nn.Module):
    """Full-sequence causal attention through ``scaled_dot_product_attention`` (query and key lengths equal);
    with ``documents``, a dense boolean mask keeps each token inside its document (the reference path)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, offset: int = 0, documents: Documents | None = None) -> Tensor:
        if offset != 0:
            raise ValueError(
                f"Plain attention only sees the tokens it is given, so offset must be 0, got offset={offset}."
                " Train subsequences through SPPOStrategy.forward_backward (or apply_subsequence_attention)."
            )
        gqa = q.shape[1] != k.shape[1]
        if gqa and q.is_cuda and (q.dtype == torch.float32 or documents is not None):
            # On CUDA only the flash kernel (half precision, no mask) takes grouped K/V; otherwise enable_gqa
            # lands on the math kernel and its O(S^2) scores. Expanded K/V let the memory-efficient kernel run.
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
            gqa = False
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if documents.shape != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"documents cover {documents.shape} (rows, tokens), but attention got {q.shape[0]} rows of"
                f" {q.shape[2]} tokens; plain attention takes the documents of exactly the tokens it is given."
            )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.attention_mask(), enable_gqa=gqa)


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


def _documents_of(input_ids: Tensor, document_ids: Tensor) -> Documents:
    if isinstance(document_ids, Tensor) and tuple(document_ids.shape) != tuple(input_ids.shape[:2]):
        raise ValueError(
            f"document_ids must have the shape of input_ids {tuple(input_ids.shape[:2])},"
            f" got {tuple(document_ids.shape)}."
        )
    return Documents.from_ids(document_ids, input_ids.device)


def _norm(config: GPTConfig, size: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(size, config.norm_eps)
    return nn.LayerNorm(size, eps=config.norm_eps, bias=config.bias)


def rope_cos_sin(config: GPTConfig, offset: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos/sin [S, n_rope] for positions offset .. offset + length - 1 (times YaRN's attention factor).

    Angles are formed in float64: at a million positions fp32 would be off by ~0.06 rad, and a
    subsequence must see exactly the angles the full sequence sees at the same positions.
    """
    inv_freq, scale = rope_frequencies(config, device)  # [n_rope / 2]
    positions = torch.arange(offset, offset + length, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq).repeat(1, 2)  # [S, n_rope]
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()


def rope_cos_sin_at(config: GPTConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin [B, 1, S, n_rope] (broadcast over heads) for per-token ``positions`` [B, S] (packed documents:
    positions restart at each document), formed in float64 like ``rope_cos_sin``, so a position gets the same
    angles either way."""
    inv_freq, scale = rope_frequencies(config, positions.device)  # [n_rope / 2]
    angles = (positions.to(torch.float64)[..., None] * inv_freq).repeat(1, 1, 2)  # [B, S, n_rope]
    return (angles.cos() * scale).float()[:, None], (angles.sin() * scale).float()[:, None]


def rope_frequencies(config: GPTConfig, device: torch.device | None = None) -> tuple[Tensor, float]:
    """RoPE's inverse frequencies [n_rope / 2] in float64, after ``config.rope_scaling``, and the factor that
    multiplies cos and sin (1 but for YaRN)."""
    n = config.rope_n_elem
    inv_freq = config.rope_base ** -(torch.arange(0, n, 2, device=device, dtype=torch.float64) / n)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    if scaling.type == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    return _yarn_frequencies(inv_freq, scaling, config.rope_base, n)


def _llama3_frequencies(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1's rule: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    context, factor = scaling.original_max_position_embeddings, scaling.factor
    wavelength = 2 * math.pi / inv_freq
    # 0 where the wavelength is above context / low_freq_factor (fully scaled), 1 below context / high_freq_factor
    # (kept), linear in context / wavelength between.
    smooth = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smooth = smooth.clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn_frequencies(inv_freq: Tensor, scaling: RopeScaling, base: float, n: int) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): each frequency blends its
    interpolated value (inv_freq / factor) and its original along a ramp over the dimension index, from the
    dimensions that turn ``beta_fast`` times over the original context (kept) to those turning ``beta_slow``
    times (fully interpolated); cos and sin are scaled by the attention factor."""
    context = scaling.original_max_position_embeddings

    def dimension(turns: float) -> float:  # the dimension index whose frequency turns `turns` times over `context`
        return n * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, n - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    index = torch.arange(n // 2, device=inv_freq.device, dtype=torch.float64)
    interpolated = ((index - low) / (high - low)).clamp(0.0, 1.0)  # 0: keep the frequency, 1: divide by factor
    blended = interpolated * inv_freq / scaling.factor + (1 - interpolated) * inv_freq
    factor = scaling.attention_factor
    if factor is None:
        factor = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
    return blended, factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of x [B, heads, S, Dh] (half-split, LLaMA/NeoX layout);
    cos/sin are [S, n_rope] (positions shared by the rows) or [B, 1, S, n_rope] (per row)."""
    n = cos.shape[-1]
    if n == 0:
        return x
    rot, rest = x[..., :n], x[..., n:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out
