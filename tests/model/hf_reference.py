"""Tiny random Hugging Face checkpoints (``transformers`` as the independent reference) and their loss/grads.

Every parameter is randomised (biases and norm weights too, which ``transformers`` initialises to 0 and 1),
so a tensor mapped to the wrong place changes the result.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lightning_sppo import GPT
from lightning_sppo.model.hf import hf_names

IGNORE = -100
ORIGINAL_CONTEXT = 32
"""rope_scaling's original_max_position_embeddings: far below the test sequences, so scaling matters."""
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
YARN = dict(rope_type="yarn", factor=4.0)

_BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    attn_implementation="eager",  # the plain softmax(QK^T)V: independent of our kernels
)
_FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
_FAMILIES["qwen3"] = (Qwen3Config, Qwen3ForCausalLM)

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama3-scaling": ("llama", dict(rope_scaling=LLAMA3)),
    "llama3-scaling-tied": ("llama", dict(rope_scaling=LLAMA3, tie_word_embeddings=True)),
    "qwen2.5-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-yarn": ("qwen3", dict(rope_scaling=YARN)),
}


def make_hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    """A random tiny model of one of ``CASES``, in fp32."""
    family, extra = CASES[case]
    config_class, model_class = _FAMILIES[family]
    extra = dict(extra)
    if "rope_scaling" in extra:
        extra["rope_scaling"] = extra["rope_scaling"] | {"original_max_position_embeddings": ORIGINAL_CONTEXT}
    torch.manual_seed(seed)
    model = model_class(config_class(**_BASE, **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    return model


def save_hf_checkpoint(case: str, path: Path, max_shard_size: str = "5GB") -> torch.nn.Module:
    model = make_hf_model(case)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model


def load_hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def batch(vocab_size: int, batch_size: int = 2, seq_len: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and targets (some ignored); 96 tokens are 3x the original context of the rope scaling."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    targets = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    return ids, targets.masked_fill(torch.rand(batch_size, seq_len, generator=gen) < 0.2, IGNORE)


def hf_loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor):
    """HF's logits, mean cross-entropy over valid targets and every parameter's gradient (HF names)."""
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def worst_grad_error(
    model: GPT, grads: dict[str, torch.Tensor], hf_grads: dict[str, torch.Tensor]
) -> tuple[float, str]:
    """Largest relative error between our gradients ``grads`` (our names) and HF's, mapped by name (our fused
    qkv against HF's q/k/v stacked; a tied weight's single gradient against HF's embedding gradient)."""
    worst, where = 0.0, ""
    for name in grads:
        expected = torch.cat([hf_grads[n] for n in hf_names(name, model.config)])
        err = rel(grads[name], expected)
        if err > worst:
            worst, where = err, name
    return worst, where
