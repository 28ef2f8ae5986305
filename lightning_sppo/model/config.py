"""GPT configurations: one dataclass, LitGPT-style field names, and a registry of named sizes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

__all__ = ["GPTConfig"]


@dataclass(kw_only=True)
class GPTConfig:
    """Architecture of a decoder-only GPT. Dependent sizes are derived in ``__post_init__``."""

    name: str = ""
    """Registry name, informational."""
    block_size: int = 4096
    """Longest sequence (tokens) the model accepts. RoPE is computed per position, so this costs no memory."""
    vocab_size: int = 32000
    """Number of token ids."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_embd: int = 64
    """Hidden size."""
    n_head: int = 4
    """Number of attention (query) heads."""
    n_query_groups: int | None = None
    """Number of K/V heads (GQA). ``None`` means ``n_head`` (multi-head attention); 1 is multi-query."""
    head_size: int | None = None
    """Size of one head; ``None`` means ``n_embd // n_head``."""
    intermediate_size: int | None = None
    """MLP hidden size; ``None`` means 4 * n_embd (gelu) or the LLaMA rule 2/3 * 4 * n_embd rounded (swiglu)."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """MLP type: ``"swiglu"`` (LLaMA) or ``"gelu"`` (GPT-2)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation layer."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    bias: bool = False
    """Whether linear layers carry a bias."""
    rope_base: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    rotary_percentage: float = 1.0
    """Fraction of each head rotated by RoPE (the rest passes through)."""

    def __post_init__(self) -> None:
        positive = {"block_size": self.block_size, "vocab_size": self.vocab_size, "n_layer": self.n_layer}
        positive |= {"n_embd": self.n_embd, "n_head": self.n_head}
        for key, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{key} must be a positive integer, got {key}={value!r}.")
        if self.n_query_groups is None:
            self.n_query_groups = self.n_head
        if self.n_query_groups < 1 or self.n_head % self.n_query_groups:
            raise ValueError(
                f"GPTConfig.n_head must be divisible by n_query_groups, got n_head={self.n_head},"
                f" n_query_groups={self.n_query_groups}; try n_query_groups={self.n_head}."
            )
        if self.head_size is None:
            if self.n_embd % self.n_head:
                raise ValueError(
                    f"GPTConfig.n_embd must be divisible by n_head when head_size is unset, got"
                    f" n_embd={self.n_embd}, n_head={self.n_head}; set head_size explicitly."
                )
            self.head_size = self.n_embd // self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = _default_intermediate_size(self.n_embd, self.mlp)
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"GPTConfig.mlp must be 'swiglu' or 'gelu', got mlp={self.mlp!r}.")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"GPTConfig.norm must be 'rmsnorm' or 'layernorm', got norm={self.norm!r}.")
        if not 0.0 <= self.rotary_percentage <= 1.0:
            raise ValueError(f"GPTConfig.rotary_percentage must be in [0, 1], got {self.rotary_percentage}.")
        if self.rope_n_elem % 2:
            raise ValueError(f"RoPE rotates pairs: head_size * rotary_percentage must be even, got {self.rope_n_elem}.")

    @property
    def rope_n_elem(self) -> int:
        """Number of leading channels of each head that RoPE rotates."""
        return int(self.rotary_percentage * self.head_size)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """A registered configuration, with optional field overrides."""
        if name not in _CONFIGS:
            raise ValueError(f"Unknown model name={name!r}. Registered names: {sorted(_CONFIGS)}.")
        return replace(_CONFIGS[name], **overrides)

    @staticmethod
    def available() -> list[str]:
        """Names accepted by ``from_name``."""
        return sorted(_CONFIGS)

    def num_parameters(self) -> int:
        """Parameter count of ``GPT(self)``, computed from the sizes alone (no allocation)."""
        d, h, g, hs = self.n_embd, self.n_head, self.n_query_groups, self.head_size
        qkv = d * (h + 2 * g) * hs + (self.bias and (h + 2 * g) * hs)
        proj = h * hs * d + (self.bias and d)
        n_mlp_in = 2 if self.mlp == "swiglu" else 1
        mlp = n_mlp_in * (d * self.intermediate_size + (self.bias and self.intermediate_size))
        mlp += self.intermediate_size * d + (self.bias and d)
        norm = d if self.norm == "rmsnorm" else 2 * d
        block = qkv + proj + mlp + 2 * norm
        return self.vocab_size * d + self.n_layer * block + norm + self.vocab_size * d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _default_intermediate_size(n_embd: int, mlp: str) -> int:
    if mlp == "gelu":
        return 4 * n_embd
    hidden = int(2 * 4 * n_embd / 3)
    return 256 * ((hidden + 255) // 256)  # LLaMA rounds up to a multiple of 256


_LONG_CONTEXT = 4 * 2**20  # the SPPO paper trains up to 4M tokens (Table 2)

# GPT sizes of Table 2 in the SPPO paper, with LLaMA's MLP/norm/RoPE choices.
_CONFIGS: dict[str, GPTConfig] = {
    c.name: c
    for c in (
        GPTConfig(name="gpt-7b", block_size=_LONG_CONTEXT, n_layer=32, n_embd=4096, n_head=32,
                  intermediate_size=11008),
        GPTConfig(name="gpt-13b", block_size=_LONG_CONTEXT, n_layer=40, n_embd=5120, n_head=40,
                  intermediate_size=13824),
        GPTConfig(name="gpt-65b", block_size=_LONG_CONTEXT, n_layer=80, n_embd=8192, n_head=64,
                  intermediate_size=22016),
        # ~1B model for single-GPU benchmarks.
        GPTConfig(name="gpt-1b", block_size=_LONG_CONTEXT, n_layer=16, n_embd=2048, n_head=16,
                  intermediate_size=5632),
        # Tiny models for tests and the CPU demo.
        GPTConfig(name="tiny", block_size=4096, vocab_size=256, n_layer=2, n_embd=64, n_head=4),
        GPTConfig(name="tiny-gqa", block_size=4096, vocab_size=256, n_layer=2, n_embd=64, n_head=4,
                  n_query_groups=2),
        GPTConfig(name="tiny-gelu", block_size=4096, vocab_size=256, n_layer=2, n_embd=64, n_head=4,
                  mlp="gelu", norm="layernorm", bias=True, rotary_percentage=0.5),
        GPTConfig(name="small", block_size=16384, vocab_size=256, n_layer=4, n_embd=256, n_head=8,
                  n_query_groups=4),
    )
}  # fmt: skip
