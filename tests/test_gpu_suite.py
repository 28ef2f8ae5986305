"""``benchmarks/gpu_suite.py --device cpu --quick``: the GPU suite's own code on tiny sizes, so it cannot rot.

The suite runs as CI would call it, in a fresh interpreter, which also shows that it imports neither jsonargparse
nor wandb (the GPU machine has neither). Every part must have run and written its section: checks, calibrate (n/a on
CPU), profile, table, kernels, longest, negative control. CUDA-only figures (peak memory, MFU) are null on CPU. The
part runner itself (a part stopped by its budget or broken leaves the earlier parts written) is tested without the
suite, on fake parts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner import HardwareProfile, PlanRequest, solve
from lightning_sppo.strategy.autoplan import plan_settings

ROOT = Path(__file__).resolve().parents[1]
RUN_AND_LIST_IMPORTS = """
import json, runpy, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")  # as `python benchmarks/gpu_suite.py` does
import suite_state
out, snapshots, save = Path(sys.argv[1]), [], suite_state.Report.save

def save_and_look(self):  # the file on disk each time a part has just ended
    save(self)
    on_disk = json.loads((out / "gpu_suite.json").read_text())
    ended = [p["name"] for p in on_disk["parts"] if p["status"] != "running"]
    if ended and (not snapshots or snapshots[-1][0] != ended):
        snapshots.append((ended, on_disk))

suite_state.Report.save = save_and_look
sys.argv = ["benchmarks/gpu_suite.py", "--device", "cpu", "--quick", "--out", str(out)]
try:
    runpy.run_path("benchmarks/gpu_suite.py", run_name="__main__")
except SystemExit as exit:
    status = exit.code
(out / "snapshots.json").write_text(json.dumps([on_disk for _, on_disk in snapshots]))
print("IMPORTED:", sorted({m.split(".")[0] for m in sys.modules} & {"jsonargparse", "wandb", "flash_attn"}))
sys.exit(status)
"""
PARTS = ["checks", "calibrate", "profile", "table", "kernels", "longest", "negative_control"]
RUNS = ["plain", "plain + AC", "engine N=1", "layer order", "planner's choice"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("gpu_suite")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", RUN_AND_LIST_IMPORTS, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(out.glob("*.partial")), "a write was left half done"
    data = json.loads((out / "gpu_suite.json").read_text())
    data["_snapshots"] = json.loads((out / "snapshots.json").read_text())
    return data, (out / "gpu_suite.md").read_text(), done.stdout


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@pytest.mark.slow
def test_every_part_ran_in_order_within_the_budget(report):
    data, markdown, stdout = report
    assert "IMPORTED: []" in stdout
    assert [p["name"] for p in data["parts"]] == PARTS
    status = {p["name"]: p["status"] for p in data["parts"]}
    assert status.pop("calibrate").startswith("n/a") and set(status.values()) == {"done"}, data["parts"]
    assert all(_finite(p["seconds"]) for p in data["parts"])
    assert sum(data["budget"]["allotments"].values()) == pytest.approx(data["budget"]["total_s"], abs=0.5)
    assert data["elapsed_s"] < data["budget"]["total_s"]
    assert data["environment"]["git_commit"] and data["environment"]["attention_auto"].startswith("sdpa")
    assert markdown.startswith("# GPU suite")
    for heading in ("## What decides", "## Throughput: tiny-gqa", "## Throughput: tiny,", "## Longest", "## Attention",
                    "## Profile", "## Checks", "## Parts", "## Environment"):  # fmt: skip
        assert heading in markdown, heading


SECTIONS = {
    "checks": lambda d: len(d["checks"]) > 10,
    "calibrate": lambda d: d["calibration"] is not None,
    "profile": lambda d: len(d["profile"].get("runs", [])) == 3,
    "table": lambda d: len(d["table"]) == 2 * len(RUNS) and len(d["other_models"]) == 1,
    "kernels": lambda d: len(d["kernels"]) > 0,
    "longest": lambda d: len(d["longest"]) == 2,
    "negative_control": lambda d: d["checks"][-1]["name"].startswith("offload negative control"),
}


@pytest.mark.slow
def test_the_report_on_disk_holds_each_part_as_soon_as_it_ends(report):
    """Read back from the file each time a part ended: that part's section and every earlier one are there, and no
    later part's: a run killed at any point keeps what it measured."""
    data, _, _ = report
    snapshots = data["_snapshots"]
    assert [[p["name"] for p in snap["parts"] if p["status"] != "running"] for snap in snapshots] == [
        PARTS[: i + 1] for i in range(len(PARTS))
    ]
    for i, snap in enumerate(snapshots):
        for name in PARTS[: i + 1]:
            assert SECTIONS[name](snap), (PARTS[i], name)
        for name in PARTS[i + 1 :]:
            assert not SECTIONS[name](snap), (PARTS[i], name)


@pytest.mark.slow
def test_every_check_passes_or_says_why_it_cannot_run_on_cpu(report):
    data, _, _ = report
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
    assert data["checks"][-1]["name"].startswith("offload negative control")  # its own part, the last


@pytest.mark.slow
def test_the_tables_have_every_run_at_every_length(report):
    data, _, _ = report
    sizes = data["sizes"]
    tables = [(data["model"], data["table"])] + [(o["model"], o["table"]) for o in data["other_models"]]
    assert [model for model, _ in tables] == sizes["models"]
    for model, rows in tables:
        assert [(r["seq_len"], r["run"]) for r in rows] == [(s, run) for s in sizes["seq_lens"] for run in RUNS]
        for row in rows:
            assert row["status"] == "ok" and row["model"] == model, row
            assert all(_finite(row[k]) and row[k] > 0 for k in ("seconds", "tokens_per_s", "ratio_to_plain")), row
            assert _finite(row["ratio_to_ac"]) and row["peak_allocated_gib"] is None and row["mfu"] is None
            assert row["attention"] == "CPU flash" and row["attention_source"] == "ATen ops"  # what ran, profiled
            assert row["attention_asked"].startswith(
                "F.scaled_dot_product_attention" if "plain" in row["run"] else "sdpa"
            )
            assert ("planner" in row) == row["run"].startswith(("engine", "layer", "planner"))


@pytest.mark.slow
def test_the_planners_choice_is_what_the_planner_answers(report):
    """Solved again here from the profile and request the report names: the settings each row ran are the plan's,
    and the engine cut the sequence as planned. The quick profile makes the planner cut, recompute and offload."""
    data, _, _ = report
    profile = HardwareProfile.from_dict(data["planner"]["profile"])
    request = {k: tuple(v) if isinstance(v, list) else v for k, v in data["planner"]["request"].items()}
    rows = [r for r in data["table"] + [r for o in data["other_models"] for r in o["table"]]
            if r["run"] == "planner's choice"]  # fmt: skip
    for row in rows:
        config = GPTConfig.from_name(row["model"], block_size=data["model_block_size"])
        plan = solve(PlanRequest(config=config, seq_len=row["seq_len"], nodes=1, profile=profile, **request))
        assert row["settings"] == plan_settings(plan)
        assert row["planner"]["partition"] == plan.partition and row["plan"]["step_time_s"] == plan.step_time_s
    chosen = [r["settings"] for r in rows]
    assert any(s["num_subsequences"] > 1 for s in chosen) and any(s["recompute"] != "none" for s in chosen)
    adaptive = [r for r in rows if r["settings"]["offload"] == "adaptive"]
    assert adaptive and all(r["steps"]["warmup"] >= 2 for r in adaptive)
    # the last subsequence stays on the device: with more than one, some of the others went to host
    cut = [r for r in adaptive if r["settings"]["num_subsequences"] > 1]
    assert cut and all(r["host_bytes"] > 0 for r in cut)


@pytest.mark.slow
def test_the_engine_rows_are_what_sppo_plan_fit_suite_reads(report):
    """Every engine row of the primary table carries the run as the planner predicts it; the fit runs on them (CPU
    times of a tiny model: each constant is fitted to a finite value or held with a reason)."""
    from lightning_sppo.planner.fit import fit_suite, load_suite
    from lightning_sppo.planner.profile import BUILTIN_PROFILES

    data, _, _ = report
    suite = load_suite(data)
    engine = [r for r in data["table"] if "planner" in r]
    plain = [r for r in data["table"] if r["run"] in ("plain", "plain + AC")]  # predicted too (planner.plain)
    runs = [run for run in suite.runs if run.plain is None]
    assert [run.label for run in runs] == [f"{r['run']} S={r['seq_len']}" for r in engine]
    for run, row in zip(runs, engine, strict=True):
        assert run.seq_len == row["seq_len"] and run.step_s == row["seconds"] and run.peak_bytes is None
        assert len(run.partition) == row["planner"]["num_subsequences"] and run.offload == row["planner"]["offload"]
        assert run.recompute == row["planner"]["recompute"]
    assert len(suite.skipped) == len(data["table"]) - len(engine) - len(plain)
    result = fit_suite(suite, BUILTIN_PROFILES["h100"])
    assert len(result.runs) == len(engine) + len(plain)
    for constant in result.constants:
        assert (constant.fitted and _finite(constant.value) and constant.value >= 0) or constant.why, constant
    assert not result.constant("allocator_slack_bytes").fitted  # no peak memory on CPU


@pytest.mark.slow
def test_the_profile_names_the_kernels_that_differ(report):
    data, markdown, _ = report
    section = data["profile"]
    assert [r["run"] for r in section["runs"]] == ["plain", "plain, SDPA pinned to flash (FA2)", "engine N=1"]
    runs = {r["run"]: r for r in section["runs"]}
    for run in (runs["plain"], runs["engine N=1"]):
        assert run["status"] == "ok" and run["total_ms"] > 0 and run["top"] and run["attention_kernels"]
        assert all(isinstance(k["calls"], int) and k["calls"] > 0 for k in run["top"])
    # the engine's own attention function is in its profile and not in the plain model's: the profile sees the path
    assert (
        "_SubsequenceAttentionFn" in runs["engine N=1"]["all"] and "_SubsequenceAttentionFn" not in runs["plain"]["all"]
    )
    names = {d["name"] for d in section["difference"]}
    assert names and all(set(d) >= {"engine_ms", "plain_ms", "extra_ms"} for d in section["difference"])
    assert "Where engine N=1's time differs" in markdown


@pytest.mark.slow
def test_the_kernel_part_times_every_backend_the_benchmark_offers(report):
    """On CPU: ATen's CPU flash op pair (the engine's) and the plain model's SDPA call, each timed at each length."""
    data, _, _ = report
    cpu_backends = ("cpu_flash", "sdpa_autograd")  # kernel_bench's names
    rows = data["kernels"]
    assert [(r["backend"], r["seq_len"]) for r in rows] == [
        (b, s) for s in data["sizes"]["kernel_seq_lens"] for b in cpu_backends
    ]
    for row in rows:
        assert row["status"] == "ok" and _finite(row["tflops"]) and row["tflops"] > 0 and row["source"], row
        assert row["seconds"] == pytest.approx((row["forward_ms"] + row["backward_ms"]) / 1e3)


@pytest.mark.slow
def test_the_longest_searches_and_the_targets(report):
    data, _, _ = report
    planner, ac = data["longest"]  # the planner's choice first: its longest is the one not known yet
    assert (planner["run"], ac["run"]) == ("planner's choice", "plain + AC")
    assert ac["longest"] == ac["cap"] and ac["stopped"] == "cap reached"  # no device memory limit on CPU
    # the squeezed quick profile has no plan at the cap: the planner's search brackets its longest
    assert (
        planner["stopped"] == "bracket closed" and planner["first_failure"] - planner["longest"] <= planner["granule"]
    )
    for result in (ac, planner):
        assert [tuple(p) for p in result["probes"]] == [(d["seq_len"], d["fits"]) for d in result["probe_detail"]]
    assert all(d["settings"] for d in planner["probe_detail"] if d["fits"])
    assert any(d["status"] == "no plan" for d in planner["probe_detail"])
    assert planner["probe_detail"][0]["seq_len"] == planner["planned_longest"]  # its own longest, probed first
    by_target = {t["target"]: t for t in data["targets"]}
    n1 = next(
        r for r in data["table"] if r["run"] == "engine N=1" and r["seq_len"] == data["sizes"]["target_n1_lens"][0]
    )
    assert by_target[f"{data['model']} 256: engine N=1 / plain"]["value"] == n1["ratio_to_plain"]
    longest = by_target[f"{data['model']}: longest, planner's choice / plain + AC"]
    assert longest["value"] == planner["longest"] / ac["longest"] and "bounds only" in longest["verdict"]


# -- the part runner, on fake parts (fast) ----------------------------------------------------------------


@pytest.fixture
def suite(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_suite
    import suite_state

    return gpu_suite, suite_state


def _context(state, out: Path):
    report = state.Report(out, {"parts": [], "rows": [], "environment": {}}, lambda data: "# fake\n")
    return state.Context(torch.device("cpu"), None, report, None)


def test_a_part_stopped_by_its_budget_leaves_the_earlier_parts_written(suite, tmp_path):
    gpu_suite, state = suite
    ctx = _context(state, tmp_path)
    written = []

    def measures(ctx):  # every row is on disk as soon as it is measured
        for i in range(3):
            ctx.data["rows"].append(i)
            ctx.save()
            written.append(json.loads((tmp_path / "gpu_suite.json").read_text())["rows"])

    def overruns(ctx):
        while True:
            ctx.data["rows"].append("late")
            ctx.budget.check()  # between measurements, as the parts do
            time.sleep(0.01)

    def breaks(ctx):
        raise RuntimeError("broken\nsecond line")

    def after(ctx):
        ctx.data["rows"].append("after")

    budget = state.Budget(10.0, {"measures": 1.0, "overruns": 0.05, "breaks": 1.0, "after": 8.95})
    gpu_suite.run_parts(ctx, budget, {"measures": measures, "overruns": overruns, "breaks": breaks, "after": after})
    assert written == [[0], [0, 1], [0, 1, 2]]
    on_disk = json.loads((tmp_path / "gpu_suite.json").read_text())
    status = {p["name"]: p["status"] for p in on_disk["parts"]}
    assert status["measures"] == "done" and status["after"] == "done"
    assert status["overruns"].startswith("stopped: part 'overruns' used its time")
    assert status["breaks"] == "error: RuntimeError: broken"
    assert on_disk["rows"][:3] == [0, 1, 2] and "late" in on_disk["rows"] and on_disk["rows"][-1] == "after"
    assert not list(tmp_path.glob("*.partial"))


def test_each_part_may_use_what_the_earlier_ones_left_but_not_what_the_later_ones_were_promised(suite):
    _, state = suite
    budget = state.Budget(100.0, {"a": 10.0, "b": 30.0, "c": 60.0})
    ends = {name: budget.part(name).deadline - budget.start for name in "abc"}  # seconds after the suite's start
    assert ends == pytest.approx({"a": 10.0, "b": 40.0, "c": 100.0})


def test_the_negative_control_sends_floating_point_payloads_only(monkeypatch):
    """A torn integer (ids, targets) would reach an index kernel: a device-side assert that poisons the CUDA context.
    Negative control: without the filter, the same full offload sends integer units too."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_checks

    from lightning_sppo.offload import offloader as offloader_module

    sizes = gpu_checks.CheckSizes(model="tiny-gqa", seq_len=128, subsequences=2, head_size=16)
    grads = gpu_checks._Gradients(torch.device("cpu"), sizes)
    unfiltered, first_fit = [], offloader_module._first_fit

    def recording(units, budget):
        chosen = first_fit(units, budget)
        unfiltered.extend(u.dtype for u in chosen)
        return chosen

    monkeypatch.setattr(offloader_module, "_first_fit", recording)
    grads("full")
    assert any(not d.is_floating_point for d in unfiltered)
    monkeypatch.setattr(offloader_module, "_first_fit", first_fit)
    with gpu_checks.floating_only_sends() as sent:
        grads("full")
    assert sent and all(d.is_floating_point for d in sent)
    assert offloader_module._first_fit is first_fit  # restored


def test_the_negative_control_still_waits_before_freeing_what_a_copy_writes(monkeypatch):
    """Reads go unwaited (the control's point); the waits before a subsequence's buffers are freed stay, so no late
    copy can write into memory another tensor already uses."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_checks

    from lightning_sppo.offload.offloader import Offloader
    from lightning_sppo.offload.streams import CudaCopies

    waited = []
    monkeypatch.setattr(CudaCopies, "wait", lambda self, ticket: waited.append(ticket))
    recorder, discard = CudaCopies.wait, Offloader._discard
    offloader = object.__new__(Offloader)
    offloader.copies = object.__new__(CudaCopies)
    step = SimpleNamespace(waits=[], resident=10)
    state = SimpleNamespace(d2h="d2h", h2d="h2d", saves=SimpleNamespace(clear=lambda: None), resident_bytes=10)
    with gpu_checks.reads_unwaited():
        offloader.copies.wait("a read: before_backward's restore, or a source let go")
        offloader._discard(step, state)
    assert waited == ["d2h", "h2d"] and step.resident == 0
    assert CudaCopies.wait is recorder and Offloader._discard is discard  # restored


@pytest.mark.parametrize(("limit", "known"), [(5 * 1024, 1024), (1024, 0), (100 * 1024, 8192), (3 * 1024, 0)])
def test_bisection_finds_the_largest_fitting_granule(suite, limit, known):
    gpu_suite, _ = suite
    probes = []

    def fits(seq_len: int) -> bool:
        probes.append(seq_len)
        return seq_len <= limit

    found = gpu_suite.longest_fitting(fits, known, cap=64 * 1024, granule=1024, affordable=lambda s: True)
    assert found["longest"] == min(limit, 64 * 1024) // 1024 * 1024
    assert found["first_failure"] == (None if limit >= 64 * 1024 else found["longest"] + 1024)
    assert found["stopped"] == ("cap reached" if limit >= 64 * 1024 else "bracket closed")
    assert all(s % 1024 == 0 and s > known for s in probes) and len(probes) == len(set(probes)) <= 12


def test_bisection_stops_at_the_budget_with_the_bracket_so_far(suite):
    gpu_suite, _ = suite
    found = gpu_suite.longest_fitting(
        lambda s: s <= 40_000, 4096, cap=2**20, granule=4096, affordable=lambda s: s <= 16384
    )
    assert found == {"longest": 16384, "first_failure": None, "probes": [(8192, True), (16384, True)],
                     "stopped": "time budget"}  # fmt: skip


def test_the_search_may_start_at_an_expected_answer(suite):
    """The planner's own longest is probed first: when it fits, the lengths past it fail at once (no plan)."""
    gpu_suite, _ = suite
    k = 1024
    found = gpu_suite.longest_fitting(lambda s: s <= 40 * k, 16 * k, cap=2**20, granule=8 * k,
                                      affordable=lambda s: True, first=40 * k)  # fmt: skip
    assert found["probes"][0] == (40 * k, True) and (found["longest"], found["first_failure"]) == (40 * k, 48 * k)
    found = gpu_suite.longest_fitting(lambda s: s <= 40 * k, 16 * k, cap=2**20, granule=8 * k,
                                      affordable=lambda s: True, first=8 * k)  # fmt: skip
    assert found["probes"][0] == (32 * k, True)  # a first length below the known fit: doubling as usual


def test_nothing_fits_or_everything_already_did(suite):
    gpu_suite, _ = suite
    found = gpu_suite.longest_fitting(lambda s: False, 0, cap=8192, granule=1024, affordable=lambda s: True)
    assert found["longest"] is None and found["first_failure"] == 1024
    found = gpu_suite.longest_fitting(lambda s: 1 / 0, 8192, cap=8192, granule=1024, affordable=lambda s: True)
    assert found == {"longest": 8192, "first_failure": None, "probes": [], "stopped": "cap reached"}
