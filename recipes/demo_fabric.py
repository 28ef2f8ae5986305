"""A tiny SPPO training run on CPU through ``Fabric(strategy="sppo")``: prints loss and tokens/s.

    python recipes/demo_fabric.py                       # defaults: 60 steps, N=4, flops partition
    python recipes/demo_fabric.py --num_subsequences 8 --partition length --steps 100
    python recipes/demo_fabric.py --help

The corpus is this repository's README, read as bytes (a byte-level "tokenizer": vocab 256), cut into
random windows. The loss falls from ~5.5 (uniform over 256 bytes) as the model learns the text.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import torch
from jsonargparse import CLI
from lightning.fabric import Fabric

from lightning_sppo import GPT, GPTConfig, SPPOStrategy

CORPUS = Path(__file__).resolve().parents[1] / "README.md"


def main(
    model: str = "tiny",
    seq_len: int = 512,
    batch_size: int = 4,
    num_subsequences: int = 4,
    partition: Literal["length", "flops"] = "flops",
    steps: int = 60,
    learning_rate: float = 3e-3,
    log_every: int = 10,
    seed: int = 1337,
) -> list[float]:
    """Train a tiny byte-level GPT on the README with SPPO on one CPU device; returns the logged losses.

    Args:
        model: a ``GPTConfig.from_name`` name with vocab_size 256.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        num_subsequences: N, the subsequences each sequence is cut into.
        partition: ``length`` (equal) or ``flops`` (equal FLOPs, Seq1F1B).
        steps: optimizer steps.
        learning_rate: AdamW learning rate.
        log_every: steps between log lines.
        seed: random seed.
    """
    fabric = Fabric(
        strategy=SPPOStrategy(num_subsequences=num_subsequences, partition=partition),
        accelerator="cpu",
        devices=1,
    )
    fabric.launch()
    fabric.seed_everything(seed)
    config = GPTConfig.from_name(model)
    if config.vocab_size != 256:
        raise ValueError(f"The demo tokenises bytes: pick a model with vocab_size=256, got model={model!r}.")
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    if data.numel() <= seq_len + 1:
        raise ValueError(f"The corpus has {data.numel()} bytes; use seq_len < {data.numel() - 1}.")

    with fabric.init_module():
        gpt = GPT(config)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=learning_rate, weight_decay=0.0)
    gpt, optimizer = fabric.setup(gpt, optimizer)
    fabric.print(
        f"model={model} ({config.num_parameters() / 1e6:.2f}M params)  seq_len={seq_len}  batch={batch_size}"
        f"  N={num_subsequences} ({partition} partition)"
    )

    losses, tokens, start = [], 0, time.perf_counter()
    for step in range(1, steps + 1):
        ids, targets = random_windows(data, batch_size, seq_len)
        loss = fabric.strategy.forward_backward(gpt, ids, targets)
        optimizer.step()
        optimizer.zero_grad()
        tokens += ids.numel()
        if step == 1:  # the plan the step ran: how the strategy cut its batch
            fabric.print(f"subsequence lengths {list(fabric.strategy.core.last_plan.lengths)}")
        if step % log_every == 0 or step == 1:
            elapsed = time.perf_counter() - start
            fabric.print(f"step {step:4d}  loss {loss.item():.4f}  tokens/s {tokens / elapsed:,.0f}")
            losses.append(loss.item())
    return losses


def random_windows(data: torch.Tensor, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of seq_len + 1 bytes: inputs and next-byte targets."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,)).tolist()
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


if __name__ == "__main__":
    CLI(main, as_positional=False)
