"""Recompute in backward what is cheaper to recompute than to keep (activation checkpointing per block).

Placeholder for issue 21; ``apply_recompute`` installs the chosen mode on every block.
"""

from __future__ import annotations

from typing import Literal, get_args

from torch import nn

__all__ = ["RECOMPUTE_MODES", "RecomputeMode", "apply_recompute"]

RecomputeMode = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)


def apply_recompute(model: nn.Module, mode: RecomputeMode) -> nn.Module:
    """Make every block of ``model`` recompute per ``mode`` in backward; returns ``model``."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"Unknown recompute={mode!r}; choose one of {list(RECOMPUTE_MODES)}.")
    if mode != "none":
        raise NotImplementedError(f"recompute={mode!r} is not implemented yet.")
    return model
