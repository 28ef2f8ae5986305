"""``benchmarks/gpu_suite.py --device cpu --quick``: the GPU suite's own code on tiny sizes, so it cannot rot.

The suite runs as CI would call it, in a fresh interpreter, which also shows that it imports neither
jsonargparse nor wandb (the GPU machine has neither). Its JSON must hold every section, finite numbers, and
passing checks; CUDA-only figures (peak memory, MFU) are null on CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_AND_LIST_IMPORTS = """
import runpy, sys
sys.path.insert(0, "benchmarks")  # as `python benchmarks/gpu_suite.py` does
sys.argv = ["benchmarks/gpu_suite.py", "--device", "cpu", "--quick", "--out", sys.argv[1]]
try:
    runpy.run_path("benchmarks/gpu_suite.py", run_name="__main__")
except SystemExit as exit:
    status = exit.code
print("IMPORTED:", sorted({m.split(".")[0] for m in sys.modules} & {"jsonargparse", "wandb", "flash_attn"}))
sys.exit(status)
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_suite")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", RUN_AND_LIST_IMPORTS, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "gpu_suite.md").read_text().startswith("# GPU suite")
    return json.loads((out / "gpu_suite.json").read_text()), done.stdout


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@pytest.mark.slow
def test_imports_only_what_the_gpu_machine_has(report):
    _, stdout = report
    assert "IMPORTED: []" in stdout


@pytest.mark.slow
def test_every_check_passes_or_says_why_it_cannot_run_on_cpu(report):
    data, _ = report
    assert data["all_checks_passed"] is True
    by_name = {c["name"]: c for c in data["checks"]}
    for prefix in ("kernel sdpa out", "kernel sdpa lse", "kernel sdpa grads", "subsequence attention",
                   "engine = plain model, fp32", "engine = plain model, bf16", "offload=full", "offload=adaptive"):  # fmt: skip
        matching = [c for name, c in by_name.items() if name.startswith(prefix)]
        assert matching and all(c["passed"] is True and _finite(c["value"]) for c in matching), prefix
    not_here = [c for c in data["checks"] if c["passed"] is None]
    assert {c["name"] for c in not_here} == {
        "no reference-kernel call on CUDA",
        "offload negative control: waits removed change the gradients",
    }
    assert all(c["detail"] for c in not_here)


@pytest.mark.slow
def test_the_table_has_every_run_at_every_length_with_finite_numbers(report):
    data, _ = report
    sizes = data["sizes"]
    runs = ["plain", "plain + AC", "plain + save_on_cpu"]
    runs += [f"engine N={n} offload={o}" for n in sizes["subsequences"] for o in ("none", "full", "adaptive")]
    n = max(sizes["subsequences"])
    runs += [f"engine N={n} offload=adaptive recompute={r}" for r in ("selective", "full")]
    runs += [f"engine N={n} offload=adaptive recompute=full kv_device=0.25S"]
    assert [(r["seq_len"], r["run"]) for r in data["table"]] == [(s, run) for s in sizes["seq_lens"] for run in runs]
    for row in data["table"]:
        assert row["status"] == "ok", row
        assert all(_finite(row[key]) and row[key] > 0 for key in ("seconds", "tokens_per_s", "ratio_to_plain")), row
        assert isinstance(row["host_bytes"], int) and row["host_bytes"] >= 0, row
        assert row["peak_allocated_gib"] is None and row["mfu"] is None  # CUDA-only figures
        sends = row["run"] == "plain + save_on_cpu" or row["run"].endswith("offload=full") and "N=1 " not in row["run"]
        sends = sends or "kv_device" in row["run"]  # the K/V beyond S/4 live on host
        assert row["host_bytes"] > 0 if sends else True, row


@pytest.mark.slow
def test_the_longest_search_ran_for_each_run(report):
    data, _ = report
    assert [r["run"] for r in data["longest"]] == [
        "plain", "plain + AC", "engine + adaptive offload", "engine + adaptive offload + full recompute + K/V on host"
    ]  # fmt: skip
    for result in data["longest"]:
        assert result["probes"] and all(ok for _, ok in result["probes"])  # no device memory limit on CPU
        assert result["longest"] == result["cap"] and result["stopped"] == "cap reached"
    assert _finite(data["elapsed_s"]) and all(_finite(s) for s in data["section_s"].values())


def test_the_engine_rows_are_what_sppo_plan_fit_suite_reads(report):
    """Every engine row carries the run as the planner predicts it; the fit runs on them (CPU times of a tiny model:
    each constant is fitted to a finite value or held with a reason, never left as noise without one)."""
    from lightning_sppo.planner.fit import fit_suite, load_suite
    from lightning_sppo.planner.profile import BUILTIN_PROFILES

    data, _ = report
    suite = load_suite(data)
    engine = [r for r in data["table"] if r["run"].startswith("engine")]
    plain = [r for r in data["table"] if r["run"] in ("plain", "plain + AC")]  # predicted too (planner.plain)
    runs = [run for run in suite.runs if run.plain is None]
    assert [run.label for run in runs] == [f"{r['run']} S={r['seq_len']}" for r in engine]
    for run, row in zip(runs, engine, strict=True):
        assert run.seq_len == row["seq_len"] and run.step_s == row["seconds"] and run.peak_bytes is None
        assert len(run.partition) == int(row["run"].split("N=")[1].split()[0]) and run.offload in row["run"]
        recompute = row["run"].split("recompute=")[1].split()[0] if "recompute=" in row["run"] else "none"
        assert run.recompute == recompute and (run.kv_device_tokens is not None) == ("kv_device" in row["run"])
    assert len(suite.skipped) == len(data["table"]) - len(engine) - len(plain)
    result = fit_suite(suite, BUILTIN_PROFILES["h100"])
    assert len(result.runs) == len(engine) + len(plain)
    for constant in result.constants:
        assert (constant.fitted and _finite(constant.value) and constant.value >= 0) or constant.why, constant
    assert not result.constant("allocator_slack_bytes").fitted  # no peak memory on CPU


@pytest.fixture
def suite(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_suite

    return gpu_suite


@pytest.mark.parametrize(("limit", "known"), [(5 * 1024, 1024), (1024, 0), (100 * 1024, 8192), (3 * 1024, 0)])
def test_bisection_finds_the_largest_fitting_granule(suite, limit, known):
    probes = []

    def fits(seq_len: int) -> bool:
        probes.append(seq_len)
        return seq_len <= limit

    found = suite.longest_fitting(fits, known, cap=64 * 1024, granule=1024, affordable=lambda s: True)
    assert found["longest"] == min(limit, 64 * 1024) // 1024 * 1024
    assert found["first_failure"] == (None if limit >= 64 * 1024 else found["longest"] + 1024)
    assert found["stopped"] == ("cap reached" if limit >= 64 * 1024 else "bracket closed")
    assert all(s % 1024 == 0 and s > known for s in probes) and len(probes) == len(set(probes)) <= 12


def test_bisection_stops_at_the_budget_with_the_bracket_so_far(suite):
    found = suite.longest_fitting(lambda s: s <= 40_000, 4096, cap=2**20, granule=4096, affordable=lambda s: s <= 16384)
    assert found == {"longest": 16384, "first_failure": None, "probes": [(8192, True), (16384, True)],
                     "stopped": "time budget"}  # fmt: skip


def test_nothing_fits_or_everything_already_did(suite):
    found = suite.longest_fitting(lambda s: False, 0, cap=8192, granule=1024, affordable=lambda s: True)
    assert found["longest"] is None and found["first_failure"] == 1024
    found = suite.longest_fitting(lambda s: 1 / 0, 8192, cap=8192, granule=1024, affordable=lambda s: True)
    assert found == {"longest": 8192, "first_failure": None, "probes": [], "stopped": "cap reached"}
