"""Executes training steps: subsequence by subsequence on one device (pipeline stages come later)."""

from lightning_sppo.runtime.engine import StepState, SubsequenceEngine

__all__ = ["StepState", "SubsequenceEngine"]
