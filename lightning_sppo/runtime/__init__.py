"""Executes training steps: subsequence by subsequence on one device (pipeline stages come later)."""

from lightning_sppo.runtime.engine import StepState, SubsequenceEngine
from lightning_sppo.runtime.hooks import SubsequenceHooks, SubsequenceKey

__all__ = ["StepState", "SubsequenceEngine", "SubsequenceHooks", "SubsequenceKey"]
