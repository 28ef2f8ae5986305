"""Initial weights that depend on a seed and each parameter's name only, so every layout trains the same model.

A pipeline stage, a Ulysses rank or an FSDP shard is built on the meta device and initialised where it runs
(``parallel.parallelize.materialize``); drawn one after another from the global generator, a stage's weights were
other numbers than the plain model's (the demo's first loss: 5.552748 on one process, 5.587207 with pp=2). Here
each parameter is drawn from its own generator, seeded by the model's seed and a stable hash of the parameter's
name in the plain model (``blocks.3.attn.qkv.weight``): which other parameters a process holds, and in which
order, changes nothing.

* The seed: ``GPT(config)`` takes one number from torch's global generator (so ``torch.manual_seed`` and
  ``seed_everything`` decide it, as before) and keeps it as ``GPT.init_seed``; a model built on the meta device
  keeps it until its parameters are materialised, on any stage.
* The generator: the parameter's device's (CPU or CUDA). Draws are the same on every layout of one device type;
  a CUDA generator gives other numbers than the CPU's for the same seed.
* Tied embeddings: the head's weight is the embedding's, so it is drawn under ``wte.weight`` wherever it lives (a
  pipeline's last stage holds a copy of it).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

__all__ = ["draw_init_seed", "initialise", "parameter_seed", "plain_name"]

_SEED_BITS = 63  # a non-negative int64: what every torch generator takes
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Name segments that module wrappers (activation checkpointing, ``torch.compile``, FSDP1) insert."""
_NORMS = ("norm_1.weight", "norm_2.weight", "norm_f.weight", "norm_q.weight", "norm_k.weight")
_RESIDUAL = ("attn.proj.weight", "mlp.proj.weight")


def draw_init_seed() -> int:
    """One number from torch's global CPU generator: the model's seed (``torch.manual_seed`` decides it)."""
    return int(torch.randint(0, 2**_SEED_BITS - 1, (1,), device="cpu").item())


def parameter_seed(seed: int, name: str) -> int:
    """The seed of the parameter ``name``: a stable hash of both (the same in every process and Python run, unlike
    ``hash``, which is salted per process)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def plain_name(name: str, tied_embeddings: bool) -> str:
    """The parameter's name in the plain model: wrapper segments dropped, a tied head named by the embedding."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    if tied_embeddings and name == "lm_head.weight":
        return "wte.weight"
    return name


@torch.no_grad()
def initialise(model: nn.Module, seed: int, n_layer: int, tied_embeddings: bool) -> None:
    """GPT-2 initialisation of every (non-meta) parameter of ``model``, a GPT or any part of one, by name:
    norms 1, biases 0, residual projections N(0, 0.02 / sqrt(2 * n_layer)), everything else N(0, 0.02)."""
    for name, param in model.named_parameters():
        if param.is_meta:
            continue
        name = plain_name(name, tied_embeddings)
        if name.endswith(_NORMS):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(_RESIDUAL) else 0.02
            generator = torch.Generator(device=param.device).manual_seed(parameter_seed(seed, name))
            param.normal_(0.0, std, generator=generator)
