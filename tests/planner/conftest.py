"""Helpers for planner tests: a profile that never limits, and requests for registered models."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_sppo.planner import BUILTIN_PROFILES, HardwareProfile

UNLIMITED = HardwareProfile(
    name="unlimited", peak_bf16_tflops=100.0, mfu=0.5, hbm_bytes=2**50, host_bytes_per_gpu=2**50, d2h_gbps=25.0,
    h2d_gbps=25.0, intra_node_gbps=200.0, inter_node_gbps=20.0, gpus_per_node=8, reserved_bytes=0,
)  # fmt: skip
"""Memory never binds: the planner's numbers can be compared with a run's."""


@pytest.fixture
def a100() -> HardwareProfile:
    return BUILTIN_PROFILES["a100-80gb"]


def small_gpu(hbm_gib: float, host_gib: float = 64.0) -> HardwareProfile:
    """An A100-like profile with little memory, so tiny models can run out of it."""
    return replace(
        BUILTIN_PROFILES["a100-80gb"], name="small-gpu", hbm_bytes=int(hbm_gib * 2**30),
        host_bytes_per_gpu=int(host_gib * 2**30), reserved_bytes=0, allocator_slack_bytes=0,
    )  # fmt: skip
