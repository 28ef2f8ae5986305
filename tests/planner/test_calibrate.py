"""``sppo-plan --calibrate``: every term measured on its own (``planner.calibrate``), here on CPU at tiny sizes (the
same code a GPU runs; its numbers are this CPU's, not a profile to plan a GPU with)."""

from __future__ import annotations

import pytest

from lightning_sppo.planner.calibrate import calibrate
from lightning_sppo.planner.cli import main
from lightning_sppo.planner.kernels import AttentionKernel
from lightning_sppo.planner.profile import load_profile


@pytest.fixture(scope="module")
def cpu_profile():
    return calibrate("cpu", quick=True)


@pytest.mark.slow
def test_every_term_is_measured_and_says_so(cpu_profile):
    p = cpu_profile
    assert p.name.startswith("calibrated: cpu") and 0 < p.mfu <= 1 and p.gemm_tile >= 0
    assert p.elementwise_gbps > 0 and p.host_op_s > 0 and p.d2h_gbps > 0 and p.h2d_gbps > 0
    flash = p.attention_kernel("flash")  # the engine's "sdpa" backend: the CPU flash op here
    assert isinstance(flash, AttentionKernel) and flash.forward.tflops > 0 and flash.backward.tflops > 0
    sources = p.sources
    for term in ("mfu", "gemm_tile", "elementwise_gbps", "host_op_s", "attention.flash", "d2h_gbps"):
        assert sources[term].startswith("measured"), term
    assert "cpu" in sources["device"] and sources["torch"] and sources["date"]


@pytest.mark.slow
def test_the_cli_writes_a_profile_the_planner_reads(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert main(["--calibrate", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.host_op_s > 0 and profile.attention_kernel("flash") is not None
    capsys.readouterr()
    assert main(["--model", "tiny", "--seq-len", "4K", "--gpu", str(out), "--gpus-per-node", "1", "--json"]) == 0
