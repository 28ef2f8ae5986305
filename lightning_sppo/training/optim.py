"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine learning-rate factor.

Shared by the LightningModule and the Fabric recipe, so both train the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["apply_settings", "build_adamw", "warmup_cosine"]


def build_adamw(
    parameters: Iterable[nn.Parameter], learning_rate: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """Weight decay on matrices (dim >= 2) only, never on norms and biases."""
    parameters = list(parameters)
    groups = [
        {"params": [p for p in parameters if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas))


def warmup_cosine(
    step: int, warmup_steps: int, max_steps: int, learning_rate: float, min_learning_rate: float
) -> float:
    """Multiplier of the peak learning rate at ``step``: linear warm-up, then cosine down to the floor."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    floor = min_learning_rate / learning_rate
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def apply_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
) -> None:
    """A run's settings into the optimizer (``build_adamw``'s) and schedule a resume restored: a checkpoint's
    restore brings back its own learning rate, schedule base, weight decay and betas, so a resume with another
    ``learning_rate`` would train on at the old one. The schedule's factor is the caller's (its ``warmup_steps``,
    ``max_steps`` and floor); the step count and the moments stay. Unchanged settings give the restored values bit
    for bit (the schedule's own formula)."""
    for index, group in enumerate(optimizer.param_groups):  # decay on the first group (matrices) only
        group |= {"initial_lr": learning_rate, "betas": tuple(betas)}
        group["weight_decay"] = weight_decay if index == 0 else 0.0
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    rates = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates
