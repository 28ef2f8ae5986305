"""The cost model's GPU terms (``planner.kernels``): each a function of what one kernel call does, and the fits that
turn measured calls into them (``planner.calibrate``)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lightning_sppo.planner.calibrate import fit_gemm_tile, fit_rates
from lightning_sppo.planner.kernels import (
    GEMM_REFERENCE,
    AttentionKernel,
    AttentionRates,
    attention_seconds,
    copy_seconds,
    gemm_rate,
)
from lightning_sppo.planner.profile import BUILTIN_PROFILES

RATES = AttentionRates(tflops=400.0, cta_tiles=2.0, causal=0.9, tile_q=128, tile_k=64, occupancy=2)


def _tflops(rates, q, k, causal, backward=False, batch=1, heads=16, sms=132):
    seconds = attention_seconds(
        rates, q, k, causal, heads=heads, head_size=128, batch=batch, sms=sms, backward=backward
    )
    pairs = q * k - (q * (q - 1) / 2 if causal else 0)
    return 4 * pairs * heads * 128 * batch * (2.5 if backward else 1) / seconds / 1e12


def test_long_calls_approach_the_rate_and_short_ones_lose():
    long = _tflops(RATES, 32768, 32768, False, batch=1)
    assert long == pytest.approx(400.0, rel=0.03)
    assert _tflops(RATES, 1024, 1024, False, batch=32) < 0.98 * long  # a short key loop pays its CTA's fixed cost
    assert _tflops(RATES, 32768, 32768, True) == pytest.approx(0.9 * long, rel=0.03)  # causal: its own factor


def test_few_ctas_leave_sms_idle():
    """One short subsequence over a long prefix: 16 heads x 8 query tiles = 128 CTAs on 264 slots."""
    many = _tflops(RATES, 1024, 16384, False, batch=8)
    few = _tflops(RATES, 1024, 16384, False, batch=1)
    assert few == pytest.approx(many * 128 / 264, rel=0.05)
    backward = replace(RATES, tile_q=64, tile_k=128, occupancy=1)  # backward: CTAs over key tiles
    assert _tflops(backward, 1024, 16384, False, backward=True) > few


def test_a_causal_call_of_n_queries_after_a_prefix_costs_the_prefix_and_its_diagonal():
    """Bottom-right causal: the last query sees every key; its time sits between the square causal call's and the
    non-causal one's over the same keys."""
    prefix = attention_seconds(RATES, 1024, 8192, True, heads=16, head_size=128, sms=132)
    assert attention_seconds(RATES, 1024, 1024, True, heads=16, head_size=128, sms=132) < prefix
    assert prefix < attention_seconds(RATES, 1024, 8192, False, heads=16, head_size=128, sms=132) / 0.9


def test_gemm_rate_is_the_reference_rate_at_the_reference_shape_and_smaller_below():
    reference = gemm_rate(989e12, 0.79, 128.0, GEMM_REFERENCE, GEMM_REFERENCE, GEMM_REFERENCE)
    assert reference == pytest.approx(989e12 * 0.79)
    assert gemm_rate(989e12, 0.79, 128.0, 1024, 2048, 2048) < 0.85 * reference
    assert gemm_rate(989e12, 0.79, 0.0, 1024, 2048, 2048) == pytest.approx(reference)  # no tile term: one rate


def test_copies_on_one_stream_share_its_time():
    assert copy_seconds(55e9, 54.5e9, 55.0, 54.5) == pytest.approx(2.0)


def test_fit_rates_recovers_the_rates_calls_were_made_with():
    truth = AttentionRates(tflops=350.0, cta_tiles=3.0, causal=0.88, tile_q=128, tile_k=64, occupancy=2)
    shapes = [(s, s, c, 16384 // s) for s in (512, 2048, 8192) for c in (False, True)] + [(1024, 8192, False, 1)]
    calls = [
        (q, k, c, False, b, 16, 128, attention_seconds(truth, q, k, c, heads=16, head_size=128, batch=b, sms=132))
        for q, k, c, b in shapes
    ]
    fitted = fit_rates(calls, 132, replace(truth, tflops=1.0, cta_tiles=0.0, causal=1.0))
    assert (fitted.tflops, fitted.cta_tiles, fitted.causal) == pytest.approx((350.0, 3.0, 0.88), rel=0.01)
    wrong = [(*c[:7], c[7] * (1.3 if c[0] == 512 else 1.0)) for c in calls]  # short calls slower than the truth
    assert fit_rates(wrong, 132, replace(truth, tflops=1.0)).cta_tiles > 3.0


def test_fit_gemm_tile_recovers_the_tile_loss():
    gemms = [(m, 4096, 4096, 2 * m * 4096 * 4096 / gemm_rate(700e12, 1.0, 192.0, m, 4096, 4096))
             for m in (512, 1024, 2048, 4096, 8192)]  # fmt: skip
    assert fit_gemm_tile(gemms) == pytest.approx(192.0, abs=8)
    flat = [(m, n, k, 2 * m * n * k / 700e12) for m, n, k, _ in gemms]  # every shape at one rate: no loss
    assert fit_gemm_tile(flat) == 0.0


def test_builtin_profiles_say_where_each_number_comes_from():
    h100, h200, a100 = (BUILTIN_PROFILES[k] for k in ("h100", "h200", "a100-80gb"))
    sources = h100.sources
    assert sources["date"] == "2026-11-26" and "H100" in sources["device"] and sources["torch"].startswith("2.11")
    for term in ("mfu", "d2h_gbps", "h2d_gbps", "hbm_bytes", "context_bytes"):
        assert sources[term].startswith("measured"), term
    for term in ("elementwise_gbps", "host_op_s", "gemm_tile", "attention.flash", "attention.cudnn"):
        assert sources[term].startswith("inferred"), term
    for profile in (h200, a100):
        assert all("scaled" in v or "not measured" in v for k, v in profile.sources.items() if k != "device")
        assert "not measured" in profile.sources["mfu"]
    assert isinstance(h100.attention_kernel("cudnn"), AttentionKernel) and a100.attention_kernel("cudnn") is None
    assert math.isclose(h200.attention_kernel("flash").forward.tflops, h100.attention_kernel("flash").forward.tflops)


def test_the_h100_profile_holds_what_its_derivation_wrote():
    """The inferred numbers are benchmarks/h100_profile.py's and host_overhead.py's (results/*.json), not tuned by
    hand; the FlashAttention-2 rates are refitted here from the FA3 paper's bars with the calibration's own fit."""
    import importlib.util
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    derived = json.loads((results / "h100_profile.json").read_text())
    host = json.loads((results / "host_overhead.json").read_text())
    h100 = BUILTIN_PROFILES["h100"]
    for name in ("host_op_s", "host_saved_s", "copy_unit_s"):
        assert getattr(h100, name) == pytest.approx(host[name], rel=1e-3), name
    assert h100.elementwise_gbps == derived["elementwise_gbps"]
    assert h100.allocator_slack_bytes == derived["allocator_slack_bytes"]
    for kernel in ("flash", "cudnn"):
        for direction in ("forward", "backward"):
            ours = getattr(h100.attention_kernel(kernel), direction)
            assert ours.tflops == pytest.approx(derived[kernel][direction]["tflops"], abs=0.01)
            assert ours.cta_tiles == derived[kernel][direction]["cta_tiles"]
    spec = importlib.util.spec_from_file_location("h100_profile", results.parent / "h100_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    flash = module.paper_kernel("flash")
    assert flash.forward.tflops == pytest.approx(h100.attention_kernel("flash").forward.tflops, abs=0.01)
    assert flash.backward.cta_tiles == h100.attention_kernel("flash").backward.cta_tiles
