"""``plan_settings``: a plan becomes the strategy settings that run exactly it (``benchmarks/gpu_suite.py`` runs the
planner's choice through it)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner import BUILTIN_PROFILES, Plan, PlanRequest, solve
from lightning_sppo.strategy.autoplan import plan_settings
from lightning_sppo.strategy.config import SPPOConfig

SAME_MEANING = {f.name for f in fields(Plan)} & {f.name for f in fields(SPPOConfig)} - {"partition"}
"""Fields that mean the same on both sides (``Plan.partition`` is the lengths, ``SPPOConfig.partition`` the policy)."""


def _plan(model: str, seq_len: int, gpus: int, pp: int | None = None) -> Plan:
    profile = replace(BUILTIN_PROFILES["h100"], gpus_per_node=gpus)
    return solve(PlanRequest(config=GPTConfig.from_name(model), seq_len=seq_len, nodes=1, profile=profile, pp=pp))


@pytest.fixture(scope="module")
def plans() -> list[Plan]:
    one_gpu = _plan("gpt-1b", 131072, 1)  # N=8, recompute and K/V spilled to host on the built-in h100 profile
    return [one_gpu, _plan("gpt-1b", 16384, 1), _plan("gpt-7b", 65536, 8, pp=2)]


def test_every_setting_the_plan_fixes_is_passed_on(plans):
    assert {"num_subsequences", "offload", "recompute", "kv_device_tokens", "model_state"} <= SAME_MEANING
    for plan in plans:
        config = SPPOConfig(**plan_settings(plan))  # the settings pass the strategy's own checks
        for name in SAME_MEANING - {"layers_per_stage"}:
            assert getattr(config, name) == getattr(plan, name), name
        assert (config.pipeline_parallel, config.sequence_parallel) == (plan.pp, plan.sp)
        assert config.partition == plan.partition_policy
        assert config.layers_per_stage == (plan.layers_per_stage if plan.pp > 1 else None)


def test_the_settings_cut_the_sequence_as_planned(plans):
    """The engine cuts with these settings exactly the lengths the planner predicted for."""
    assert any(plan.num_subsequences > 1 for plan in plans) and any(plan.pp > 1 for plan in plans)
    for plan in plans:
        config = SPPOConfig(**plan_settings(plan))
        lengths = split_sequence(
            plan.seq_len, config.num_subsequences, config.partition, granularity=config.boundary_granularity,
            config=GPTConfig.from_name(plan.model),
        )  # fmt: skip
        assert lengths == plan.partition


def test_a_changed_plan_changes_the_settings(plans):
    """Negative control: the settings follow the plan, they are not the defaults."""
    plan = plans[0]
    changed = replace(plan, recompute="full", offload="adaptive", kv_device_tokens=1024, num_subsequences=3)
    settings = plan_settings(changed)
    assert (settings["recompute"], settings["offload"], settings["kv_device_tokens"]) == ("full", "adaptive", 1024)
    assert settings["num_subsequences"] == 3 and plan_settings(plan)["num_subsequences"] == plan.num_subsequences
