"""Executes training steps: on one device subsequence by subsequence (``SubsequenceEngine``) or layer by layer
(``LayerMajorEngine``), and as pipeline stages (``PipelineRuntime``)."""

from lightning_sppo.runtime.engine import StepState, SubsequenceEngine
from lightning_sppo.runtime.hooks import SubsequenceHooks, SubsequenceKey
from lightning_sppo.runtime.layer_major import LayerMajorEngine

__all__ = ["LayerMajorEngine", "StepState", "SubsequenceEngine", "SubsequenceHooks", "SubsequenceKey"]
