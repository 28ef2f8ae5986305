"""``sppo-plan --fit-suite``: the cost model checked against measured steps, and the terms calibration cannot see
fitted (``planner.fit``).

The real rows are the H100 results of 2026-11-26 (``benchmarks/results/gpu_rows``); the synthetic suites are what
``benchmarks/gpu_suite.py`` writes, with step times and peaks predicted under known terms plus seeded noise.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner.cli import EXIT_USAGE, main
from lightning_sppo.planner.fit import SuiteError, check_suite, fit_suite, format_fit, load_suite, predict
from lightning_sppo.planner.profile import BUILTIN_PROFILES, GIB, load_profile

ROWS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_rows" / "h100-2026-11-26"
H100 = BUILTIN_PROFILES["h100"]
UNMEASURED = tuple((k, v) for k, v in H100.source if k not in ("host_op_s", "elementwise_gbps"))
BASE = replace(H100, source=UNMEASURED + (("host_op_s", "inferred"), ("elementwise_gbps", "inferred")))
TRUTH = replace(BASE, host_op_s=1.5 * H100.host_op_s, elementwise_gbps=0.8 * H100.elementwise_gbps,
                allocator_slack_bytes=3 * GIB)  # fmt: skip
MODEL, BLOCK = "gpt-1b", 65536
VARIANTS = [(n, o, "none") for n in (1, 4, 16) for o in ("none", "full", "adaptive")]
VARIANTS += [(16, "adaptive", "selective"), (16, "adaptive", "full")]
NOISE = 0.003


def _row(seq_len: int, n: int, offload: str, recompute: str, rng: random.Random) -> dict:
    config = GPTConfig.from_name(MODEL, block_size=BLOCK)
    spec = {
        "schedule": "seq1f1b", "sp": 1, "pp": 1, "dp": 1, "gpus_per_node": 1, "batch_size": 1,
        "precision": "bf16-mixed", "kv_grad_dtype": "fp32", "num_subsequences": n, "partition_policy": "flops",
        "partition": split_sequence(seq_len, n, "flops", granularity=1, config=config), "offload": offload,
        "recompute": recompute, "kv_device_tokens": None, "kv_chunk_tokens": 16384,
    }  # fmt: skip
    row = {"run": f"engine N={n} offload={offload} recompute={recompute}", "seq_len": seq_len, "status": "ok",
           "seconds": 1.0, "peak_reserved_bytes": 1, "planner": spec}  # fmt: skip
    predicted = predict(load_suite(_suite([row])).runs[0], TRUTH)
    row["seconds"] = predicted.step_s * (1 + NOISE * rng.gauss(0, 1))
    row["peak_reserved_bytes"] = predicted.reserved_bytes + rng.randrange(2**20)
    return row


def _suite(rows: list[dict], **environment) -> dict:
    env = {"device": "NVIDIA H100 80GB HBM3", "total_memory_bytes": 80 * GIB, "context_bytes": GIB // 2,
           "attention_auto": "sdpa"} | environment  # fmt: skip
    skipped = {"run": "plain + save_on_cpu", "seq_len": 16384, "status": "ok", "seconds": 0.5}
    return {"model": MODEL, "model_block_size": BLOCK, "environment": env, "table": [skipped, *rows]}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    rng = random.Random(0)
    return [_row(s, *variant, rng) for s in (16384, 65536) for variant in VARIANTS]


@pytest.fixture(scope="module")
def fitted(rows):
    return fit_suite(load_suite(_suite(rows)), BASE)


def test_the_shared_suite_loads_with_the_kernel_each_row_ran():
    suite = load_suite(ROWS / "gpu_suite.json")
    engine = [r for r in suite.runs if r.plain is None]
    plain = {r.name: r for r in suite.runs if r.plain is not None}
    assert len(engine) == 12 and all(r.attention == "flash" for r in engine)  # attention_auto "sdpa": ATen's FA2
    assert plain["plain"].attention == plain["plain + AC"].attention == "cudnn"  # SDPA's pick on sm90
    assert plain["plain + AC"].plain is True and plain["plain"].plain is False
    assert dict(suite.skipped)["plain + save_on_cpu S=16384"].startswith("no 'planner' entry, and not a plain run")
    assert dict(suite.skipped)["plain S=32768"] == "status 'skipped (time budget)'"
    recorded = json.loads((ROWS / "gpu_suite.json").read_text())
    recorded["table"][3]["planner"]["attention"] = "cudnn"  # a suite that records the kernel is believed
    assert load_suite(recorded).runs[2].attention == "cudnn"


@pytest.mark.parametrize(
    ("recorded", "plain", "kernel"),
    [
        ("sdpa (ATen flash, FA2)", False, "flash"), ("cudnn", False, "cudnn"), ("flash_attn", False, "flash"),
        ("sdpa (ATen memory-efficient)", False, "efficient"),
        ("F.scaled_dot_product_attention (CUDNN_ATTENTION)", True, "cudnn"),
        ("F.scaled_dot_product_attention (FLASH_ATTENTION)", True, "flash"),
        ("F.scaled_dot_product_attention (backend unknown: no memory to ask)", True, "cudnn"),  # the device's rule
        (None, False, "flash"),  # the environment's attention_auto, "sdpa": ATen's FA2 op
    ],
)  # fmt: skip
def test_a_recorded_kernel_is_read_as_the_suite_words_it(recorded, plain, kernel):
    from lightning_sppo.planner.fit import row_kernel

    row = {} if recorded is None else {"attention": recorded}
    assert row_kernel(row, {"attention_auto": "sdpa"}, "NVIDIA H100 80GB HBM3", plain) == kernel


def test_the_fit_recovers_the_unmeasured_terms_within_3_percent(fitted):
    assert fitted.constant("host_op_s").value == pytest.approx(TRUTH.host_op_s, rel=0.03)
    assert fitted.constant("elementwise_gbps").value == pytest.approx(TRUTH.elementwise_gbps, rel=0.03)
    assert fitted.constant("allocator_slack_bytes").value == pytest.approx(3 * GIB, rel=0.01)
    assert all(abs(run.time_error) < 4 * NOISE for run in fitted.runs)
    checked = [abs(run.time_error) for run in fitted.checked]  # before the fit: the base profile's errors
    assert max(checked) > 0.05, format_fit(fitted)


def test_measured_terms_are_held_whatever_the_steps_say(rows):
    measured = replace(BASE, source=BASE.source + (("host_op_s", "measured: on this GPU's host"),))
    result = fit_suite(load_suite(_suite(rows)), measured)
    host = result.constant("host_op_s")
    assert not host.fitted and host.value == BASE.host_op_s and "measured" in host.why
    assert result.profile.host_op_s == BASE.host_op_s


def test_the_cli_checks_then_fits_and_writes_a_profile_the_planner_reads(rows, tmp_path, capsys):
    suite, out = tmp_path / "gpu_suite.json", tmp_path / "fitted.json"
    suite.write_text(json.dumps(_suite(rows)))
    assert main(["--fit-suite", str(suite), "--out", str(out)]) == 0  # base: the suite's GPU, h100 (host measured? no)
    printed = capsys.readouterr().out
    assert printed.startswith("check: every run predicted with the profile as given")
    assert all(f"{row['run']} S={row['seq_len']}" in printed for row in rows)
    assert "step time: mean |error|" in printed and "peak reserved: mean |error|" in printed
    assert load_profile(out).allocator_slack_bytes == pytest.approx(3 * GIB, rel=0.01)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s | {"table": []}, "no run to check"),
        (lambda s: {"runs": s["table"]}, "no 'table' list"),
        (lambda s: s | {"model": "gpt-nope"}, "'model' is 'gpt-nope'"),
        (lambda s: _edit_run(s, lambda r: r["planner"].pop("partition")), r"table\[1\] .*missing \['partition'\]"),
        (lambda s: _edit_run(s, lambda r: r.pop("seconds")), r"seconds must be a measured step time"),
        (lambda s: _edit_run(s, lambda r: r.update(seconds=-1.0)), "seconds must be a measured step time > 0"),
        (lambda s: _edit_run(s, lambda r: r["planner"].update(offload="most")), "planner.offload='most'"),
        (lambda s: _edit_run(s, lambda r: r["planner"].update(attention="magic")), "attention='magic'"),
        (lambda s: _edit_run(s, lambda r: r.update(seq_len=5)), "planner.partition sums to"),
        (lambda s: s | {"environment": {"context_bytes": -3}}, "context_bytes must be a byte count"),
    ],
)
def test_bad_suites_name_what_to_fix(rows, edit, message):
    with pytest.raises(SuiteError, match=message):
        load_suite(edit(json.loads(json.dumps(_suite(rows[:2])))))


def _edit_run(suite: dict, change) -> dict:
    change(suite["table"][1])
    return suite


def test_the_cli_reports_a_bad_suite_on_one_line(tmp_path, capsys):
    missing = tmp_path / "none.json"
    assert main(["--fit-suite", str(missing)]) == EXIT_USAGE
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"--fit-suite={str(missing)!r}: cannot read" in error
    unknown = tmp_path / "cpu.json"
    unknown.write_text(json.dumps(_suite([], device="x86_64") | {"table": [_row(16384, 1, "none", "none",
                                                                                   random.Random(2))]}))  # fmt: skip
    assert main(["--fit-suite", str(unknown)]) == EXIT_USAGE
    assert "give --gpu a built-in profile" in capsys.readouterr().err


def test_out_of_memory_rows_are_checked_as_fits_or_not():
    data = json.loads((ROWS / "gpu_suite.json").read_text())
    row = {"run": "engine N=4 offload=none", "seq_len": 65536, "status": "OOM",
           "planner": {"partition": [16384] * 4, "offload": "none", "recompute": "none"}}  # fmt: skip
    suite = load_suite(data | {"model_block_size": 65536, "table": [row]})
    fit = check_suite(suite, H100)[0]
    assert fit.run.out_of_memory and fit.time_error is None and fit.fit_agrees is True
    roomy = replace(suite, hbm_bytes=10**13)  # on a device ten times larger it would have fit: the check says so
    assert check_suite(roomy, H100)[0].fit_agrees is False
