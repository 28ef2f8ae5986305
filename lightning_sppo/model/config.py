"""GPT configurations: one dataclass, LitGPT-style field names, and a registry of named sizes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, get_args

__all__ = ["GPTConfig", "RopeScaling", "RopeScalingType"]

RopeScalingType = Literal["llama3", "yarn"]


@dataclass(kw_only=True)
class RopeScaling:
    """How RoPE frequencies are stretched beyond the context a model was pretrained at.

    ``"llama3"`` (Llama 3.1+): wavelengths longer than ``original_max_position_embeddings / low_freq_factor``
    are divided by ``factor``, shorter than ``original_max_position_embeddings / high_freq_factor`` kept, and
    interpolated smoothly in between. ``"yarn"`` (YaRN, used by Qwen for long context): each frequency blends
    its interpolated (/ ``factor``) and original value along a linear ramp between the dimensions that turn
    ``beta_fast`` and ``beta_slow`` times over the original context, and cos/sin are multiplied by
    ``attention_factor``. Field names follow Hugging Face's ``rope_scaling`` / ``rope_parameters``.
    """

    type: RopeScalingType
    """The rule: ``"llama3"`` or ``"yarn"``."""
    factor: float
    """Context extension ratio: low frequencies are divided by it."""
    original_max_position_embeddings: int
    """Context length (tokens) of the pretraining the frequencies were tuned for."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are fully scaled."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    beta_fast: float = 32.0
    """yarn: dimensions turning more than this many times over the original context are kept (extrapolated)."""
    beta_slow: float = 1.0
    """yarn: dimensions turning fewer than this many times over the original context are fully interpolated."""
    attention_factor: float | None = None
    """yarn: multiplier of cos and sin (so of attention logits, squared); None: ``0.1 ln(factor) + 1``."""
    truncate: bool = True
    """yarn: round the ramp's ends to whole dimensions (floor / ceil), as the reference implementation does."""

    def __post_init__(self) -> None:
        if self.type not in get_args(RopeScalingType):
            raise ValueError(
                f"GPTConfig.rope_scaling.type must be one of {list(get_args(RopeScalingType))}, got type={self.type!r}."
            )
        if not self.factor > 0:
            raise ValueError(f"GPTConfig.rope_scaling.factor must be positive, got factor={self.factor!r}; e.g. 8.0.")
        value = self.original_max_position_embeddings
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                "GPTConfig.rope_scaling.original_max_position_embeddings must be a positive integer, got"
                f" original_max_position_embeddings={value!r}; e.g. 8192."
            )
        if self.type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "GPTConfig.rope_scaling needs 0 < low_freq_factor < high_freq_factor for type='llama3', got"
                f" low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}; e.g. 1.0 and 4.0."
            )
        if self.type == "yarn" and not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError(
                "GPTConfig.rope_scaling needs 0 < beta_slow <= beta_fast for type='yarn', got"
                f" beta_slow={self.beta_slow}, beta_fast={self.beta_fast}; e.g. 1.0 and 32.0."
            )
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(
                "GPTConfig.rope_scaling.attention_factor must be positive or None (derived from factor), got"
                f" attention_factor={self.attention_factor!r}."
            )


@dataclass(kw_only=True)
class GPTConfig:
    """Architecture of a decoder-only GPT. Dependent sizes are derived in ``__post_init__``.

    The open model families differ in a few switches: Llama 3 (``rope_scaling`` type "llama3", tied
    embeddings at 1B/3B), Qwen2.5 (``attn_bias``), Qwen3 (``norm_qk``); ``lightning_sppo.model.hf``
    converts their Hugging Face checkpoints.
    """

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
    """Whether every linear layer (but the output head) and LayerNorm carries a bias."""
    attn_bias: bool = False
    """Whether the q/k/v projection carries a bias even when ``bias`` is False (Qwen2.5); the attention output
    projection and the MLP follow ``bias``."""
    norm_qk: bool = False
    """Normalise each head of q and k (one ``norm`` over ``head_size``, shared by the heads) before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """The output head reuses the token embedding matrix (Llama 3.2 1B/3B, small Qwen models). With a pipeline
    the first and last stages each hold a copy, kept equal (``lightning_sppo.parallel.tied``)."""
    rope_base: float = 10000.0
    """Base of the rotary position embedding frequencies (Hugging Face's ``rope_theta``)."""
    rope_scaling: RopeScaling | None = None
    """Context-extension rule for the RoPE frequencies; None: plain RoPE. A dict is converted."""
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
        if not isinstance(self.n_query_groups, int) or isinstance(self.n_query_groups, bool):
            raise ValueError(
                f"GPTConfig.n_query_groups must be a positive integer, got n_query_groups={self.n_query_groups!r}."
            )
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
        for key in ("head_size", "intermediate_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{key} must be a positive integer, got {key}={value!r}.")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"GPTConfig.mlp must be 'swiglu' or 'gelu', got mlp={self.mlp!r}.")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"GPTConfig.norm must be 'rmsnorm' or 'layernorm', got norm={self.norm!r}.")
        for key in ("bias", "attn_bias", "norm_qk", "tie_embeddings"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"GPTConfig.{key} must be True or False, got {key}={getattr(self, key)!r}.")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not 0 < self.norm_eps < 1:
            raise ValueError(
                f"GPTConfig.norm_eps must be a number in (0, 1), got norm_eps={self.norm_eps!r}; e.g. 1e-5."
            )
        if not self.rope_base > 1.0:
            raise ValueError(f"GPTConfig.rope_base must be above 1, got rope_base={self.rope_base!r}; e.g. 10000.0.")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                "GPTConfig.rope_scaling must be None, a RopeScaling or a dict of its fields, got"
                f" rope_scaling={self.rope_scaling!r}."
            )
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

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """The inverse of ``to_dict`` (e.g. a checkpoint's ``"model_config"``); unknown keys are an error."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"Unknown GPTConfig fields {unknown}; valid fields: {[f.name for f in fields(cls)]}.")
        return cls(**values)

    @staticmethod
    def available() -> list[str]:
        """Names accepted by ``from_name``."""
        return sorted(_CONFIGS)

    def num_parameters(self) -> int:
        """Parameter count of ``GPT(self)``, computed from the sizes alone (no allocation)."""
        embedding = self.vocab_size * self.n_embd
        head = 0 if self.tie_embeddings else self.vocab_size * self.n_embd
        return embedding + self.n_layer * self.block_parameters() + self.norm_parameters(self.n_embd) + head

    def num_matmul_parameters(self) -> int:
        """P of the FLOPs count (6 P per token): every parameter but the embedding lookup. A tied head still
        multiplies every token by the [V, D] matrix, so it counts here even though it is not a parameter of its own."""
        return (
            self.n_layer * self.block_parameters() + self.norm_parameters(self.n_embd) + self.vocab_size * self.n_embd
        )

    def block_parameters(self) -> int:
        """Parameters of one transformer block."""
        d, h, g, hs = self.n_embd, self.n_head, self.n_query_groups, self.head_size
        qkv = d * (h + 2 * g) * hs + ((self.bias or self.attn_bias) and (h + 2 * g) * hs)
        proj = h * hs * d + (self.bias and d)
        n_mlp_in = 2 if self.mlp == "swiglu" else 1
        mlp = n_mlp_in * (d * self.intermediate_size + (self.bias and self.intermediate_size))
        mlp += self.intermediate_size * d + (self.bias and d)
        qk_norm = 2 * self.norm_parameters(hs) if self.norm_qk else 0
        return qkv + proj + mlp + 2 * self.norm_parameters(d) + qk_norm

    def norm_parameters(self, size: int) -> int:
        """Parameters of one normalisation layer over ``size`` channels (LayerNorm's bias follows ``bias``)."""
        return 2 * size if self.norm == "layernorm" and self.bias else size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _default_intermediate_size(n_embd: int, mlp: str) -> int:
    if mlp == "gelu":
        return 4 * n_embd
    hidden = int(2 * 4 * n_embd / 3)
    return 256 * ((hidden + 255) // 256)  # LLaMA rounds up to a multiple of 256


def _llama3_scaling(factor: float) -> RopeScaling:
    return RopeScaling(type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)  # fmt: skip


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
        # Open models, sizes exactly as their Hugging Face config.json (block_size = max_position_embeddings);
        # lightning_sppo.model.hf.load_hf_model reads the weights. Meta's Llama 3 rope_scaling: factor, low/high_freq_factor, 8K original.
        # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
        GPTConfig(name="llama-3.2-1b", block_size=131072, vocab_size=128256, n_layer=16, n_embd=2048, n_head=32,
                  n_query_groups=8, head_size=64, intermediate_size=8192, rope_base=500000.0,
                  rope_scaling=_llama3_scaling(32.0), tie_embeddings=True),
        # https://huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json
        GPTConfig(name="llama-3.2-3b", block_size=131072, vocab_size=128256, n_layer=28, n_embd=3072, n_head=24,
                  n_query_groups=8, head_size=128, intermediate_size=8192, rope_base=500000.0,
                  rope_scaling=_llama3_scaling(32.0), tie_embeddings=True),
        # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
        GPTConfig(name="llama-3.1-8b", block_size=131072, vocab_size=128256, n_layer=32, n_embd=4096, n_head=32,
                  n_query_groups=8, head_size=128, intermediate_size=14336, rope_base=500000.0,
                  rope_scaling=_llama3_scaling(8.0)),
        # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (sliding window off: use_sliding_window false)
        GPTConfig(name="qwen2.5-7b", block_size=131072, vocab_size=152064, n_layer=28, n_embd=3584, n_head=28,
                  n_query_groups=4, head_size=128, intermediate_size=18944, norm_eps=1e-6, rope_base=1000000.0,
                  attn_bias=True),
        # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
        GPTConfig(name="qwen3-8b", block_size=40960, vocab_size=151936, n_layer=36, n_embd=4096, n_head=32,
                  n_query_groups=8, head_size=128, intermediate_size=12288, norm_eps=1e-6, rope_base=1000000.0,
                  norm_qk=True),
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
