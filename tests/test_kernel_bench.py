"""``benchmarks/kernel_bench.py`` on CPU: rows for every backend, FLOPs as the planner counts them, the budget."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.kernel_bench import attention_call_flops, available_backends, kernel_microbench, table

pytestmark = pytest.mark.usefixtures("one_thread")


def test_flops_are_the_planners_causal_count():
    forward, backward = attention_call_flops(batch=2, heads=4, seq_len=256, head_size=32)
    pairs = 256 * 257 / 2  # query t sees t + 1 keys; the planner's n (c + n / 2) counts n^2 / 2
    assert forward == 2 * 4 * (256 * 128) * 4 * 32 and abs(forward / (2 * 4 * pairs * 4 * 32) - 1) < 0.01
    assert backward == 2.5 * forward


def test_every_cpu_backend_gives_numbers():
    rows = kernel_microbench([64, 128], torch.device("cpu"), heads=2, groups=1, head_size=16, repeats=1)
    assert {(r["backend"], r["seq_len"]) for r in rows} == {(b, s) for b in available_backends(torch.device("cpu"))
                                                            for s in (64, 128)}  # fmt: skip
    for r in rows:
        assert r["error"] is None and math.isfinite(r["tflops"]) and r["tflops"] > 0
        assert r["tflops"] * 1e12 * (r["forward_ms"] + r["backward_ms"]) / 1e3 == pytest.approx(
            r["flops_forward"] + r["flops_backward"]
        )
    assert "cpu_flash" in table(rows)


def test_unknown_backends_and_the_budget_give_reasons_not_numbers():
    rows = kernel_microbench([64, 4096], torch.device("cpu"), backends=["cpu_flash", "triton"], heads=2,
                             head_size=16, repeats=1, budget_s=0.0)  # fmt: skip
    by = {(r["backend"], r["seq_len"]): r for r in rows}
    assert by[("triton", 64)]["error"] == "unknown backend" and by[("triton", 64)]["tflops"] is None
    assert by[("cpu_flash", 64)]["error"] is None  # the first length of a backend always runs: nothing to scale
    assert by[("cpu_flash", 4096)]["error"].startswith("skipped: ") and by[("cpu_flash", 4096)]["tflops"] is None
