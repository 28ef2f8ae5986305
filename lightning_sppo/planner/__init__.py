"""Planner (SPPO section 6.1): cost model, memory model and heuristic solver for (SP, PP, N, alpha, schedule).

Typical use::

    from lightning_sppo import GPTConfig
    from lightning_sppo.planner import PlanRequest, resolve_profile, solve

    plan = solve(PlanRequest(config=GPTConfig.from_name("gpt-7b"), seq_len=2**20, nodes=4,
                             profile=resolve_profile("a100-80gb")))
    print(plan.sp, plan.pp, plan.num_subsequences, plan.alpha, plan.tokens_per_gpu_per_s)

or from a shell: ``sppo-plan --model gpt-7b --seq-len 1M --nodes 4 --gpus-per-node 8``.

Modules: ``profile`` (hardware numbers and where each comes from), ``precision`` (bytes per element), ``flops``,
``kernels`` (the GPU's kinds of work: GEMMs by shape, attention calls by kernel, elementwise bytes, host ops,
copies), ``census`` and ``census_table`` (what each pass does besides GEMMs and attention, counted from the code)
and ``costs`` (time), ``activations`` and ``memory`` (bytes), ``alpha`` (offload ratios and the copy stream),
``layout`` (candidate layouts and their placement), ``multiplexed`` (what the "sppo" schedule's shared units hold
and move), ``options`` (recompute, K/V spilled to host, model state on host), ``evaluate`` and ``step_time`` (one
candidate), ``plain`` and ``advice`` (the plain model with full activation checkpointing, scored beside every plan),
``solver`` (the search over layouts, N, schedule and options), ``longest`` (``--max-seq-len``, ``--max-step-time``),
``explain`` (why a layout lost or nothing fits), ``plan`` (request and answer), ``report`` (text), ``calibrate``
(each term measured on the device) and ``fit`` (whole steps of ``benchmarks/gpu_suite.py``: the check, and what
calibration cannot see), and ``cli``.
"""

from lightning_sppo.planner.costs import CostModel, PassTimes
from lightning_sppo.planner.layout import Layout, StageSpec, candidate_layouts, stage_specs
from lightning_sppo.planner.memory import MemoryBreakdown
from lightning_sppo.planner.plan import NoFeasiblePlan, Plan, PlanRequest, RunnerUp
from lightning_sppo.planner.precision import KV_GRAD_DTYPES, PRECISIONS, Precision, precision_bytes
from lightning_sppo.planner.profile import BUILTIN_PROFILES, HardwareProfile, load_profile, resolve_profile
from lightning_sppo.planner.solver import Assessment, assess_layout, solve, subsequence_counts
from lightning_sppo.planner.units import parse_tokens

__all__ = [
    "BUILTIN_PROFILES",
    "KV_GRAD_DTYPES",
    "PRECISIONS",
    "Assessment",
    "CostModel",
    "HardwareProfile",
    "Layout",
    "MemoryBreakdown",
    "NoFeasiblePlan",
    "PassTimes",
    "Plan",
    "PlanRequest",
    "Precision",
    "RunnerUp",
    "StageSpec",
    "assess_layout",
    "candidate_layouts",
    "load_profile",
    "parse_tokens",
    "precision_bytes",
    "resolve_profile",
    "solve",
    "stage_specs",
    "subsequence_counts",
]
