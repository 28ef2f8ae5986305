"""What one training step does, decided before it runs: the ``StepPlan``.

The strategy makes one per batch (``StepPlans.plan``: the batch's documents, the cut that ``decide_cut`` decides on
rank 0, agreed by one broadcast and kept per batch shape) and hands it to the runtime (``SubsequenceEngine``,
``LayerMajorEngine``, ``PipelineRuntime``), which reads it and asks nobody. The direction is strategy -> step plan ->
runtime: nothing here imports the strategy or the runtime, and the runtime imports only the value (and
``plan_batch``, for an engine run on its own).
"""

from lightning_sppo.step_plan.decide import LAYER_CHUNK_TOKENS, StepPlans, decide_cut, plan_batch
from lightning_sppo.step_plan.plan import StepPlan, StepSettings

__all__ = [
    "LAYER_CHUNK_TOKENS",
    "StepPlan",
    "StepPlans",
    "StepSettings",
    "decide_cut",
    "plan_batch",
]
