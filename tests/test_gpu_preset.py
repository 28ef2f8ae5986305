"""The GPU suite's decisive preset (``benchmarks/gpu_suite.py --preset decisive``): run end to end on CPU (tiny sizes,
in a fresh interpreter as the GPU session would run it), and its pieces on their own: the real preset's predicted time,
the budget, which failures mean "does not fit", which attention kernel a profile names, the path checks' bar and
negative control, the slices' fit, and the child process that runs the checks."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.subprocesses import one_thread_env

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["checks", "kernels", "long", "longer", "n1_overhead", "longest", "sppo_fit", "calibrate"]
RUN_AND_WATCH = """
import json, runpy, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")  # as `python benchmarks/gpu_suite.py` does
import suite_state
out, seen, save = Path(sys.argv[1]), [], suite_state.Report.save

def save_and_look(self):  # what is on disk after each write
    save(self)
    d = json.loads((out / "gpu_suite.json").read_text())
    seen.append({"checks": len(d["checks"]), "kernels": len(d["kernels"]), "table": len(d["table"]),
                 "probes": sum(len(r["probes"]) for r in (d["longest"] or {}).get("runs", [])),
                 "ended": [p["name"] for p in d["parts"] if p["status"] != "running"]})

suite_state.Report.save = save_and_look
sys.argv = ["benchmarks/gpu_suite.py", "--preset", "decisive", "--device", "cpu", "--out", str(out)]
try:
    runpy.run_path("benchmarks/gpu_suite.py", run_name="__main__")
except SystemExit as exit:
    status = exit.code
(out / "seen.json").write_text(json.dumps(seen))
print("IMPORTED:", sorted({m.split(".")[0] for m in sys.modules} & {"jsonargparse", "wandb", "flash_attn"}))
sys.exit(status)
"""


@pytest.fixture(scope="module")
def preset(tmp_path_factory) -> tuple[dict, str, str, Path]:
    import subprocess

    out = tmp_path_factory.mktemp("decisive")
    env = one_thread_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", RUN_AND_WATCH, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert not list(out.glob("*.partial")), "a write was left half done"
    data = json.loads((out / "gpu_suite.json").read_text())
    data["_seen"] = json.loads((out / "seen.json").read_text())
    return data, (out / "gpu_suite.md").read_text(), done.stdout, out


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.slow
def test_every_part_ran_in_order_and_the_real_preset_is_predicted_within_eight_minutes(preset):
    data, markdown, stdout, out = preset
    assert "IMPORTED: []" in stdout  # the parent needs neither jsonargparse (sppo fit runs apart) nor wandb
    assert [p["name"] for p in data["parts"]] == PARTS
    assert {p["status"] for p in data["parts"]} == {"done"}, data["parts"]
    assert all(_finite(p["seconds"]) and _finite(p["predicted_s"]) and p["predicted_s"] > 0 for p in data["parts"])
    gpu = data["gpu_prediction"]
    assert "the real preset on one H100" in stdout and gpu["limit_s"] == 480 and gpu["total_s"] <= 480 and gpu["fits"]
    assert [p["part"] for p in gpu["parts"]] == ["start", *PARTS]
    assert all(p["predicted_s"] > 0 for p in gpu["parts"])
    assert next(p for p in gpu["parts"] if p["part"] == "checks")["predicted_s"] <= 60
    assert markdown.startswith("# GPU suite, decisive preset (tiny sizes")
    for heading in ("## Parts: predicted", "## What decides (issue 40", "## Step time and memory against the planner",
                    "## Longest sequence, from slices", "## `sppo fit`", "## Attention kernels at the decisive shapes",
                    "## Checks (child process)", "## Calibration", "## Environment"):  # fmt: skip
        assert heading in markdown, heading
    assert (out / "profile.json").exists() and data["calibration"]["status"] == "ok"


@pytest.mark.slow
def test_the_report_on_disk_grows_one_row_at_a_time(preset):
    """Read back after every write: checks land from the child while it runs, and every kernel row, cell and probe is
    on disk as soon as it is measured, so a call killed at its timeout keeps what came before."""
    data, _, _, _ = preset
    seen = data["_seen"]
    for key in ("kernels", "table", "probes"):
        counts = [s[key] for s in seen]
        assert counts == sorted(counts) and set(range(counts[-1] + 1)) <= set(counts), key
    while_checking = [s["checks"] for s in seen if "checks" not in s["ended"]]
    assert len(set(while_checking) - {0}) > 3  # several reads of the child's file, not one at its end
    assert [s["ended"] for s in seen if s["ended"]][-1] == PARTS


@pytest.mark.slow
def test_every_memory_path_is_checked_against_the_plain_model_and_names_the_kernel_that_ran(preset):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from suite_paths import NEGATIVE, PATHS

    data, _, _, _ = preset
    checks = {c["name"]: c for c in data["checks"]}
    for path in PATHS:
        (check,) = [c for name, c in checks.items() if name.startswith(f"{path.name} = plain model, bf16")]
        assert check["passed"] is True and check["value"] <= check["limit"] and check["attention"] == "CPU flash"
        assert check["attention_kernels"] and check["ratio"] < 3
    negative = checks[NEGATIVE]
    assert negative["passed"] is True and negative["value"] > 10 * negative["limit"] / 3  # tens of times the bar
    bars = [c for c in data["checks"] if c["name"].startswith("plain model, bf16 autocast, against fp32")]
    assert len(bars) == 4 and all(c["passed"] and 1e-4 < c["value"] <= 2e-2 for c in bars)
    assert data["all_checks_passed"] is True


@pytest.mark.slow
def test_every_row_has_the_planner_beside_it_and_the_kernel_that_ran(preset):
    data, _, _, _ = preset
    rows = data["table"]
    assert [(r["part"], r["run"], r["seq_len"]) for r in rows] == [
        ("long", "plain + AC", 512), ("long", "planner's choice", 512), ("long", "layer order", 512),
        ("longer", "plain + AC", 1024), ("longer", "planner's choice", 1024), ("longer", "layer order", 1024),
        ("n1_overhead", "plain", 128), ("n1_overhead", "engine N=1", 128), ("n1_overhead", "plain", 256),
        ("n1_overhead", "engine N=1", 256),
    ]  # fmt: skip
    for r in rows:
        assert r["status"] == "ok" and _finite(r["seconds"]) and r["seconds"] > 0, r
        assert r["prediction"]["step_s"] > 0 and r["prediction"]["cell_s"] > 0
        assert _finite(r["prediction_as_ran"]["time_error"]) and r["prediction_as_ran"]["kernel"] == "flash"
        assert r["attention"] == "CPU flash" and r["attention_source"] == "ATen ops" and r["attention_asked"]
        assert ("planner" in r) == (r["run"] not in ("plain", "plain + AC"))
    layer = next(r for r in rows if r["run"] == "layer order")
    assert layer["planner"]["order"] == "layer" and len(layer["planner"]["partition"]) == 4
    assert all(_finite(t["value"]) for t in data["targets"] if "engine N=1" in t["target"])


@pytest.mark.slow
def test_the_decisive_rows_are_what_sppo_plan_fit_suite_reads(preset):
    from lightning_sppo.planner.fit import load_suite

    data, _, _, _ = preset
    suite = load_suite(data)
    assert [run.label for run in suite.runs] == [f"{r['run']} S={r['seq_len']}" for r in data["table"]]
    assert {run.attention for run in suite.runs} == {"flash"}  # "CPU flash", as the planner names kernels


@pytest.mark.slow
def test_kernels_longest_fit_and_calibration_each_produced_their_figures(preset):
    data, _, _, _ = preset
    kernels = data["kernels"]
    assert [(k["backend"], k["seq_len"], k["causal"]) for k in kernels] == [
        (b, s, c) for s in (128, 256) for c in (True, False) for b in ("cpu_flash", "sdpa_autograd")
    ]
    for k in kernels:
        assert k["status"] == "ok" and k["tflops"] > 0 and k["attention"] == "CPU flash"
        assert k["prediction"]["forward_ms"] > 0 and k["prediction"]["kernel"] == "flash"
    longest = data["longest"]
    assert "bytes(S, l) = A + B S + l (C + D S)" in longest["method"] and longest["bytes"].startswith("CPU:")
    assert [r["run"] for r in longest["runs"]] == ["layer order", "plain + AC"]
    for r in longest["runs"]:
        assert [(p["layers"], p["seq_len"]) for p in r["probes"]] == [(1, 256), (1, 512), (2, 256), (2, 512), (2, 1024)]
        assert all(p["status"] == "ok" for p in r["probes"]) and "extrapolated_longest" in r and "fit" in r
        assert abs(r["check"]["error"]) < 0.05  # the planner's bytes stand in on CPU: linear, as the fit assumes
    fit = data["fit"]
    assert fit["status"] == "ok" and fit["step_s"] > 0 and fit["prediction"]["step_s"] > 0
    assert fit["overrides"]["model"]["init_from"] is None and fit["config"] == "configs/llama-3.2-1b-128k.yaml"
    assert [lg["class_path"] for lg in fit["overrides"]["trainer"]["logger"]] == ["lightning.pytorch.loggers.CSVLogger"]


# -- the pieces, fast ----------------------------------------------------------------------------------------


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_suite

    return gpu_suite


def test_the_real_preset_fits_one_device_call_and_no_cell_is_budgeted_at_zero(bench):
    import suite_decisive as d
    from suite_runs import SuitePlanner

    from lightning_sppo.model.config import GPTConfig
    from lightning_sppo.planner import resolve_profile

    planner = SuitePlanner(resolve_profile("h100", 1, bench.DEVICE_HOST_BYTES), "built-in h100")
    prediction = d.predict_parts(d.DECISIVE, planner, d.GPU_BACKENDS)
    assert prediction["total_s"] <= d.LIMIT_S == 480 and prediction["fits"]
    config = GPTConfig.from_name("gpt-1b", block_size=d.DECISIVE.block_size)
    for part in ("long", "longer", "n1_overhead"):
        for run, seq_len in d.decisive_cells(d.DECISIVE, part):
            cell = d.cell_prediction(config, run, seq_len, d.DECISIVE, planner)
            assert cell.step.step_s > 0 and cell.seconds > cell.step.step_s and cell.timed >= 1, (run, seq_len)
    at_256k = [d.cell_prediction(config, r, s, d.DECISIVE, planner) for r, s in d.decisive_cells(d.DECISIVE, "longer")]
    assert all(c.untimed + c.timed <= 3 for c in at_256k)  # the long steps are not warmed up twice


def test_allotments_give_way_in_order_when_the_predictions_do_not_fit(bench):
    assert bench.allotments({"a": 10, "b": 20, "c": 30}, 120) == {"a": 20, "b": 40, "c": 60}
    assert bench.allotments({"a": 10, "b": 20, "c": 30, "d": 5}, 45) == {"a": 10, "b": 20, "c": 0, "d": 5}


def test_a_part_predicted_to_overrun_what_is_left_is_not_started(bench, tmp_path):
    import suite_state as state

    report = state.Report(tmp_path, {"parts": [], "environment": {}}, lambda data: "# fake\n")
    ctx = state.Context(torch.device("cpu"), None, report, None)
    ran = []
    parts = {"first": lambda ctx: ran.append("first"), "long": lambda ctx: ran.append("long"),
             "short": lambda ctx: ran.append("short")}  # fmt: skip
    budget = state.Budget(10.0, {"first": 2.0, "long": 3.0, "short": 5.0})
    bench.run_parts(ctx, budget, parts, predicted={"first": 1.0, "long": 30.0, "short": 1.0})
    assert ran == ["first", "short"]
    status = {p["name"]: p["status"] for p in json.loads((tmp_path / "gpu_suite.json").read_text())["parts"]}
    assert status["long"].startswith("skipped (predicted 30 s,") and status["short"] == "done"


@pytest.mark.parametrize(
    ("error", "status", "what"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "OOM", "device memory (caching"),
        (RuntimeError("cuDNN Frontend error: CUDNN_STATUS_ALLOC_FAILED: workspace"), "OOM", "cuDNN workspace"),
        (RuntimeError("CUDA error: out of memory"), "OOM", "device memory outside the caching allocator"),
        (RuntimeError("cudaHostAlloc failed: out of memory (pinned)"), "host OOM", "pinned host memory"),
        (MemoryError("offloaded activations need 40 GiB of host memory"), "host OOM", "host memory"),
    ],
)
def test_a_failed_allocation_of_any_kind_does_not_fit_and_names_what_failed(bench, error, status, what):
    from suite_alloc import does_not_fit

    found = does_not_fit(error)
    assert found["status"] == status and found["does_not_fit"].startswith(what)


@pytest.mark.parametrize("error", [RuntimeError("shape '[2, 3]' is invalid"), ValueError("out of memory"), KeyError(1)])
def test_a_broken_path_is_not_an_allocation(bench, error):
    from suite_alloc import does_not_fit

    assert does_not_fit(error) is None


def test_a_cudnn_workspace_failure_is_a_row_that_does_not_fit(bench, tmp_path):
    """Negative control: the same row with a broken path (not an allocation) is an error, not "does not fit"."""
    import suite_state as state
    from suite_runs import measure_cell

    report = state.Report(tmp_path, {}, lambda data: "")
    ctx = state.Context(torch.device("cpu"), None, report, None)

    def failing(message):
        def make():
            raise RuntimeError(message)

        return make

    row = measure_cell(ctx, failing("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), {"run": "x", "seq_len": 8}, (0, 1))
    assert row["status"] == "OOM" and row["does_not_fit"].startswith("cuDNN workspace")
    row = measure_cell(ctx, failing("cuDNN error: CUDNN_STATUS_BAD_PARAM"), {"run": "x", "seq_len": 8}, (0, 1))
    assert row["status"] == "error: RuntimeError" and "does_not_fit" not in row


def test_the_attention_families_are_read_from_kernel_names(bench):
    from suite_predict import planner_kernel
    from suite_profiler import NO_ATTENTION, attention_family, record_from_events

    from lightning_sppo.planner.fit import row_kernel

    names = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "cuDNN",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(Flash_fwd_params)":
            "FA2 (ATen flash)",
        "void pytorch_flash::flash_bwd_dot_do_o_kernel<true>(Flash_bwd_params)": "FA2 (ATen flash)",
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(Flash_fwd_params)": "flash-attn",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)":
            "memory-efficient (ATen cutlass)",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": None,
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": None,
    }  # fmt: skip
    for name, family in names.items():
        assert attention_family(name, device_kernel=True) == family, name
    assert attention_family("aten::_scaled_dot_product_flash_attention_for_cpu", device_kernel=False) == "CPU flash"
    assert attention_family("aten::scaled_dot_product_attention", device_kernel=False) is None  # the wrapper
    events = [(name, True, us, 4) for name, us in zip(names, (900.0, 50.0, 5.0, 0.0, 1.0, 300.0, 20.0), strict=True)]
    record = record_from_events(events)
    assert record.label == "cuDNN + FA2 (ATen flash) + memory-efficient (ATen cutlass) + flash-attn"
    assert record.source == "CUDA kernels" and [k["family"] for k in record.kernels][0] == "cuDNN"
    assert record_from_events(events[-2:]).label == NO_ATTENTION
    for label, kernel in (("cuDNN + FA2 (ATen flash)", "cudnn"), ("FA2 (ATen flash)", "flash"), ("CPU flash", "flash"),
                          ("memory-efficient (ATen cutlass)", "efficient"), (NO_ATTENTION, "math")):  # fmt: skip
        assert planner_kernel(label, "x") == kernel == row_kernel({"attention": label}, {}, "H100", plain=True)


def test_the_profile_of_a_cpu_step_names_the_op_that_computed_attention(bench):
    import torch.nn.functional as F
    from suite_profiler import profiled

    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    out, record = profiled(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward(),
                           torch.device("cpu"))  # fmt: skip
    assert record.label == "CPU flash" and record.source == "ATen ops"
    op = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert {k["name"] for k in record.kernels} == {op, op + "_backward"}
    _, nothing = profiled(lambda: q @ q.transpose(-1, -2), torch.device("cpu"))
    assert nothing.label.startswith("no fused attention kernel") and not nothing.kernels


def test_the_decisive_path_passes_its_bar_and_a_stride_blind_backward_fails_it(bench):
    """The bar (3x the plain model's own bf16 error) holds for the layer order with offload="full" and selective
    recompute, and a backward that reads the attention output in the other layout exceeds it many times over."""
    import suite_paths as p

    device = torch.device("cpu")
    held = p._Bench(p.TINY, device, 0).get("GQA", False)
    args = (p.TINY, held["model"], held["ids"], held["targets"], held["docs"])
    error, _ = p.path_error(p.run_path(p.DECISIVE_PATH, *args), held["truth"], held["model"].config)
    with p.stride_blind(device) as calls:
        blind, worst = p.path_error(p.run_path(p.DECISIVE_PATH, *args), held["truth"], held["model"].config)
    bar = p.K_PLAIN * held["plain_error"]
    assert error <= bar < blind / 5 and calls[0] > 0 and "attn.qkv" in worst
    x = torch.randn(2, 3, 5, 4)
    assert (
        p.other_layout(x).stride() == (60, 4, 12, 1)
        and p.other_layout(x.transpose(1, 2).contiguous().transpose(1, 2)).stride() == x.stride()
    )


def test_the_qkv_gradient_is_compared_row_block_by_row_block(bench):
    """The v rows dominate the fused projection's gradient at initialisation: compared whole, a wrong dq would hide."""
    import suite_paths as p

    from lightning_sppo.model.config import GPTConfig

    config = GPTConfig(name="x", n_layer=1, n_embd=8, n_head=2, n_query_groups=1, head_size=4, vocab_size=16)
    grads = {
        "blocks.0.attn.qkv.weight": torch.arange(16 * 8, dtype=torch.float).view(16, 8),
        "wte.weight": torch.ones(2),
    }
    pieces = p.gradient_pieces(grads, config)
    assert {k: v.shape[0] for k, v in pieces.items() if "qkv" in k} == {
        "blocks.0.attn.qkv.weight[q]": 8,
        "blocks.0.attn.qkv.weight[k]": 4,
        "blocks.0.attn.qkv.weight[v]": 4,
    }
    wrong = {k: v.clone() for k, v in grads.items()}
    wrong["blocks.0.attn.qkv.weight"][:8] *= -1  # every dq wrong
    error, worst = p.path_error((1.0, wrong), (1.0, grads), config)
    assert error == pytest.approx(2.0) and worst == "blocks.0.attn.qkv.weight[q]"


def test_the_slices_fit_is_exact_on_linear_bytes_and_extrapolates_to_every_layer(bench):
    from suite_slice import bytes_at, extrapolate, fit_bytes, longest_within

    truth = {"A": 5e9, "B": 3e4, "C": 4e8, "D": 6e4}
    points = {(n, s): bytes_at(truth, n, s) for n in (1, 2) for s in (32768, 65536)}
    assert fit_bytes(points) == pytest.approx(truth)
    longest = longest_within(truth, 16, 80e9)
    assert bytes_at(truth, 16, longest) <= 80e9 < bytes_at(truth, 16, longest + 1024) and longest % 1024 == 0
    probes = [{"layers": n, "seq_len": s, "bytes": points[(n, s)], "host_bytes": n * s * 1e3} for n, s in points]
    probes.append({"layers": 2, "seq_len": 262144, "bytes": bytes_at(truth, 2, 262144) * 1.02, "host_bytes": 0})
    found = extrapolate({"probes": probes}, 16, 80e9, host_capacity=16 * 1e3 * 50_000)
    assert (
        found["bounds"]["device"] == longest and found["bounds"]["host"] == 50_000 // 1024 * 1024
    )  # host: 1e3 B/token/layer
    assert found["extrapolated_longest"] == 50_000 // 1024 * 1024 and found["bound_by"] == "host"
    assert found["check"]["error"] == pytest.approx(1 / 1.02 - 1)
    failed = extrapolate({"probes": [*probes[:-1], {"layers": 2, "seq_len": 262144, "status": "OOM"}]}, 16, 80e9, None)
    assert failed["extrapolated_longest"] is None and "no bytes" in failed["why"]


def test_a_checks_child_that_dies_keeps_the_checks_it_wrote(bench, tmp_path):
    """The checks run in a child process: one killed by a device-side assert (here: an abort after two checks) leaves
    its checks in the report and a failed check saying how it ended; the parent carries on."""
    import suite_decisive as d
    import suite_state as state

    child = tmp_path / "child.py"
    child.write_text(
        "import json, os, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "for i in range(2):\n"
        "    with open(out, 'a') as f:\n"
        "        f.write(json.dumps({'name': f'check {i}', 'passed': True}) + '\\n')\n"
        "print('device-side assert triggered', flush=True)\n"
        "os.abort()\n"
    )
    report = state.Report(tmp_path / "out", {"checks": [], "all_checks_passed": None}, lambda data: "")
    ctx = state.Context(torch.device("cpu"), SimpleNamespace(tiny=True), report, None)
    ctx.budget = state.Budget(600.0, {"checks": 600.0}).part("checks")
    status = d.follow_child(ctx, [sys.executable, str(child)])
    names = [c["name"] for c in report.data["checks"]]
    assert names == ["check 0", "check 1", "checks child process ran to its end"] and status.startswith("error")
    last = report.data["checks"][-1]
    assert last["passed"] is False and "device-side assert triggered" in last["detail"]
    assert report.data["all_checks_passed"] is False
    # negative control: a child that writes its last line ended well, whatever its exit status (1: a check failed)
    child.write_text(
        child.read_text()
        .replace("os.abort()", "sys.exit(1)")
        .replace("for i in range(2):", "for i in ['ran to its end']:")
        .replace("f'check {i}'", "f'checks child process {i}'")
    )
    report.data["checks"].clear()
    assert d.follow_child(ctx, [sys.executable, str(child)]) is None
    assert [c["name"] for c in report.data["checks"]] == ["checks child process ran to its end"]


def test_a_line_the_child_is_still_writing_waits_for_the_next_read(bench, tmp_path):
    import suite_decisive as d
    import suite_state as state

    report = state.Report(tmp_path / "out", {"checks": [], "all_checks_passed": None}, lambda data: "")
    ctx = state.Context(torch.device("cpu"), None, report, None)
    lines = tmp_path / "checks.jsonl"
    lines.write_text('{"name": "one", "passed": true}\n{"name": "tw')
    offset = d._read_new(ctx, lines, 0)
    assert [c["name"] for c in report.data["checks"]] == ["one"]
    with lines.open("a") as f:
        f.write('o", "passed": null}\n')
    d._read_new(ctx, lines, offset)
    assert [c["name"] for c in report.data["checks"]] == ["one", "two"] and report.data["all_checks_passed"] is True


def test_a_report_of_a_run_that_went_wrong_says_what_went_wrong(bench):
    """Rows that did not fit, were skipped, had no plan or broke, a slice search without bytes, a failed sppo fit and
    calibration: the Markdown and the targets name each, none is taken for a measurement."""
    from suite_markdown import decisive_markdown, decisive_targets

    predicted = {"profile": "built-in h100", "parts": [{"part": "long", "title": "c.", "predicted_s": 87.0}],
                 "total_s": 87.0, "limit_s": 480.0, "fits": True}  # fmt: skip
    oom = "cuDNN workspace: CUDNN_STATUS_ALLOC_FAILED"
    data = {
        "environment": {"device": "NVIDIA H100 80GB HBM3", "git_commit": "abc", "date": "2026-12-01T00:00:00"},
        "tiny": False, "preset": "decisive", "prediction": predicted, "gpu_prediction": predicted, "notes": [],
        "parts": [{"name": "long", "status": "done", "seconds": 90.0}],
        "sizes": {"overhead_lens": [16384], "long_lens": [131072]},
        "table": [
            {"part": "long", "run": "plain + AC", "seq_len": 131072, "status": "OOM", "does_not_fit": oom,
             "prediction": {"step_s": 11.8, "peak_allocated_bytes": 38e9}},
            {"part": "long", "run": "planner's choice", "seq_len": 131072, "status": "no plan", "error": "too long",
             "prediction": {"why_not": "no plan: too long", "cell_s": 0.0}},
            {"part": "long", "run": "layer order", "seq_len": 131072, "status": "skipped (predicted 25 s, 3 s left)",
             "prediction": {"step_s": 9.8, "peak_allocated_bytes": 19e9}},
            {"part": "n1_overhead", "run": "engine N=1", "seq_len": 16384, "status": "error: RuntimeError",
             "error": "broken", "prediction": {"step_s": 0.4, "peak_allocated_bytes": 3e10}},
        ],
        "longest": {"method": "m", "bytes": "measured", "runs": [
            {"run": "layer order", "extrapolated_longest": None, "why": "a probe has no bytes (it failed)",
             "planner_longest": 900 * 1024, "probes": [{"layers": 1, "seq_len": 32768, "status": "OOM"}]}]},
        "fit": {"model": "llama-3.2-1b", "seq_len": 131072, "config": "configs/llama-3.2-1b-128k.yaml", "steps": 2,
                "status": "OOM", "does_not_fit": "device memory (caching allocator): CUDA out of memory",
                "log_tail": ["torch.OutOfMemoryError: CUDA out of memory"], "prediction": {"step_s": 5.0}},
        "kernels": [{"backend": "cudnn", "seq_len": 16384, "causal": True, "status": "n/a: no cuDNN here",
                     "prediction": {"forward_ms": 2.0, "backward_ms": 5.0, "kernel": "cudnn"}}],
        "checks": [{"name": "checks child process ran to its end", "passed": False, "detail": "exit status -6"}],
        "calibration": {"command": "sppo-plan --calibrate", "status": "error: sppo-plan --calibrate exited 1"},
    }  # fmt: skip
    targets = {t["target"]: t for t in decisive_targets(data)}
    assert targets["128K: planner's choice / plain + AC"]["verdict"] == "not measured (no plan)"
    assert targets["16K: engine N=1 / plain"]["verdict"] == "not measured (error: RuntimeError)"
    assert targets["rows within 15% (time) and 10% (peak) of the planner"]["verdict"] == "not measured"
    markdown = decisive_markdown(data | {"targets": list(targets.values())})
    for text in (f"does not fit (OOM): {oom}", "skipped (predicted 25 s, 3 s left)", "no plan", "error: RuntimeError",
                 "a probe has no bytes", "n/a: no cuDNN here", "(device memory (caching allocator)",
                 "torch.OutOfMemoryError", "exit status -6", "exited 1"):  # fmt: skip
        assert text in markdown, text
