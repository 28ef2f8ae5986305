"""``sppo-plan --fit-suite``: the planner's constants recovered from a suite of whole steps (``planner.fit``).

The synthetic suites are what ``benchmarks/gpu_suite.py`` writes (its rows and ``planner`` entries), with step times
and peaks predicted under known constants plus seeded noise; the fit starts from the H100 datasheet profile.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner.cli import EXIT_USAGE, main
from lightning_sppo.planner.fit import SuiteError, fit_suite, format_fit, load_suite, predict
from lightning_sppo.planner.flops import ATTENTION_BACKWARD_FACTOR, attention_flops, block_matmul_params, head_flops
from lightning_sppo.planner.profile import BUILTIN_PROFILES, GIB, load_profile

BASE = BUILTIN_PROFILES["h100"]
TRUTH = replace(
    BASE, mfu=0.37, attention_mfu=0.52, layer_overhead_s=2.3e-4, d2h_gbps=21.0, h2d_gbps=21.0, reserved_bytes=3 * GIB
)
CONTEXT = GIB // 2
"""What the synthetic suite says was in use outside the allocator: the rest of TRUTH's reserve is the allocator's."""
MODEL, BLOCK = "gpt-1b", 65536
# (N, offload, recompute, share of K/V on the device), as gpu_suite's table runs them
VARIANTS = [(n, o, "none", None) for n in (1, 4, 16) for o in ("none", "full", "adaptive")]
VARIANTS += [(16, "adaptive", "selective", None), (16, "adaptive", "full", None), (16, "adaptive", "full", 0.25)]
NOISE = 0.003


def _row(seq_len: int, n: int, offload: str, recompute: str, share: float | None, rng: random.Random) -> dict:
    config = GPTConfig.from_name(MODEL, block_size=BLOCK)
    spec = {
        "schedule": "seq1f1b", "sp": 1, "pp": 1, "dp": 1, "gpus_per_node": 1, "batch_size": 1,
        "precision": "bf16-mixed", "kv_grad_dtype": "fp32", "num_subsequences": n, "partition_policy": "flops",
        "partition": split_sequence(seq_len, n, "flops", granularity=1, config=config), "offload": offload,
        "recompute": recompute, "kv_device_tokens": None if share is None else int(share * seq_len),
        "kv_chunk_tokens": 16384,
    }  # fmt: skip
    row = {"run": f"engine N={n} offload={offload} recompute={recompute} kv={share}", "seq_len": seq_len,
           "status": "ok", "seconds": 1.0, "peak_reserved_bytes": 1, "planner": spec}  # fmt: skip
    seconds, peak = predict(load_suite(_suite([row])).runs[0], TRUTH)
    row["seconds"] = seconds * (1 + NOISE * rng.gauss(0, 1))
    row["peak_reserved_bytes"] = peak + TRUTH.reserved_bytes - CONTEXT + rng.randrange(2**20)
    return row


def _suite(rows: list[dict], **environment) -> dict:
    env = {"device": "NVIDIA H100 80GB HBM3", "total_memory_bytes": 80 * GIB, "context_bytes": CONTEXT} | environment
    plain = {"run": "plain", "seq_len": 16384, "status": "ok", "seconds": 0.5}  # no "planner": skipped
    return {"model": MODEL, "model_block_size": BLOCK, "environment": env, "table": [plain, *rows]}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    rng = random.Random(0)
    return [_row(s, *variant, rng) for s in (16384, 65536) for variant in VARIANTS]


@pytest.fixture(scope="module")
def fitted(rows):
    return fit_suite(load_suite(_suite(rows)), BASE)


def _truth(name: str) -> float:
    return {"copy_gbps": TRUTH.d2h_gbps}.get(name, getattr(TRUTH, name, None))


def test_recovers_the_constants_it_was_made_with_within_2_percent(fitted):
    for constant in fitted.constants:
        assert constant.fitted, constant
        assert constant.value == pytest.approx(_truth(constant.name), rel=0.02), constant
        assert constant.base != pytest.approx(constant.value, rel=0.05), constant  # the fit moved it
    assert all(abs(run.time_error) < 4 * NOISE for run in fitted.runs)
    assert all(abs(run.memory_error) < 0.001 for run in fitted.runs)
    assert fitted.skipped == (("plain S=16384", "no 'planner' entry: the plain model is not what sppo-plan plans"),)
    profile = fitted.profile
    assert profile.d2h_gbps == profile.h2d_gbps == pytest.approx(21.0, rel=0.02)
    assert profile.hbm_bytes == 80 * GIB and profile.peak_bf16_tflops == BASE.peak_bf16_tflops


def test_the_prediction_is_the_plain_sum_of_flops_over_rates():
    """The function fitted against, checked by hand on one run without copies: 1 stage, each subsequence's forward
    and backward at the two rates plus three fixed costs per layer (forward, backward), each the overhead and the read of
    the layer's bf16 weights from HBM."""
    config = GPTConfig.from_name(MODEL, block_size=BLOCK)
    row = _row(65536, 4, "none", "none", None, random.Random(1))
    run = load_suite(_suite([row])).runs[0]
    matmul_rate, attention_rate = TRUTH.peak_bf16_tflops * 1e12 * TRUTH.mfu, TRUTH.peak_bf16_tflops * 1e12 * 0.52
    expected, prefix = 0.0, 0
    fixed = TRUTH.layer_overhead_s + 2 * block_matmul_params(config) / (TRUTH.hbm_gbps * 1e9)  # bf16 weights read
    for n in run.partition:
        matmul = 3 * (config.n_layer * 2 * n * block_matmul_params(config)) + 4 * head_flops(config, n)
        attention = (1 + ATTENTION_BACKWARD_FACTOR) * config.n_layer * attention_flops(config, n, prefix)
        expected += matmul / matmul_rate + attention / attention_rate + 3 * config.n_layer * fixed
        prefix += n
    assert predict(run, TRUTH)[0] == pytest.approx(expected, rel=1e-9)
    assert predict(run, replace(TRUTH, attention_mfu=None))[0] > expected  # attention at the slower matmul rate


def test_the_cli_prints_every_run_and_the_planner_uses_the_written_profile(rows, tmp_path, capsys):
    suite, out = tmp_path / "gpu_suite.json", tmp_path / "fitted.json"
    suite.write_text(json.dumps(_suite(rows)))
    assert main(["--fit-suite", str(suite), "--out", str(out)]) == 0  # base: the suite's GPU, h100
    printed = capsys.readouterr().out
    assert all(f"{row['run']} S={row['seq_len']}" in printed for row in rows)
    assert "step time: mean |error|" in printed and "peak memory: mean |error|" in printed
    fitted = load_profile(out)
    assert fitted.mfu == pytest.approx(TRUTH.mfu, rel=0.02) and fitted.attention_mfu == pytest.approx(0.52, rel=0.02)

    def plan(gpu: str) -> dict:
        request = ["--model", MODEL, "--seq-len", "64K", "--nodes", "1", "--gpus-per-node", "1", "--json"]
        assert main([*request, "--gpu", gpu]) == 0
        return json.loads(capsys.readouterr().out)

    truth_file = tmp_path / "truth.json"
    TRUTH.save(truth_file)
    with_fit, with_truth, with_base = plan(str(out)), plan(str(truth_file)), plan("h100")
    assert with_fit["step_time_s"] == pytest.approx(with_truth["step_time_s"], rel=0.02)
    assert with_fit["step_time_s"] < 0.9 * with_base["step_time_s"]  # attention at 0.52 of peak outweighs the rest
    assert with_fit["memory"]["reserved"] == fitted.reserved_bytes != with_base["memory"]["reserved"]


def test_runs_without_an_exposed_copy_hold_the_copy_rate_and_say_why(rows):
    hidden = [r for r in rows if r["planner"]["offload"] != "full" and r["planner"]["kv_device_tokens"] is None]
    result = fit_suite(load_suite(_suite(hidden)), BASE)
    copy = result.constant("copy_gbps")
    assert not copy.fitted and copy.value == BASE.d2h_gbps and "copy the compute does not hide" in copy.why
    assert result.profile.d2h_gbps == BASE.d2h_gbps and result.profile.h2d_gbps == BASE.h2d_gbps
    for name in ("mfu", "attention_mfu", "layer_overhead_s"):  # the rest is still determined
        assert result.constant(name).value == pytest.approx(_truth(name), rel=0.02)


def test_one_length_and_one_n_cannot_tell_the_rates_apart_and_say_so(rows):
    one = [r for r in rows if r["seq_len"] == 65536 and r["planner"]["num_subsequences"] == 16]
    one = [r for r in one if r["planner"]["recompute"] == "none"]
    result = fit_suite(load_suite(_suite(one)), BASE)
    held = [c for c in result.constants if not c.fitted]
    assert {c.name for c in held} >= {"attention_mfu"}, format_fit(result)
    assert all("do not determine it" in c.why for c in held if c.name != "reserved_bytes")
    assert result.profile.attention_mfu is None  # attention runs at the fitted mfu's rate, not at a guess
    assert all(abs(run.time_error) < 4 * NOISE for run in result.runs)  # what it fitted still fits the runs


def test_a_corrupted_measurement_moves_the_fit_beyond_2_percent(rows):
    corrupted = json.loads(json.dumps(rows))
    for row in corrupted:
        if row["planner"]["num_subsequences"] == 16:
            row["seconds"] *= 1.25
    result = fit_suite(load_suite(_suite(corrupted)), BASE)
    moved = [c.name for c in result.constants if c.value != pytest.approx(_truth(c.name), rel=0.02)]
    assert moved, format_fit(result)
    assert max(abs(run.time_error) for run in result.runs) > 0.05  # and the table shows runs it cannot fit


def test_a_suite_without_peaks_holds_the_reserve(rows):
    no_peaks = [{**row, "peak_reserved_bytes": None} for row in rows[:6]]
    result = fit_suite(load_suite(_suite(no_peaks, context_bytes=None, total_memory_bytes=None)), BASE)
    reserve = result.constant("reserved_bytes")
    assert not reserve.fitted and reserve.value == BASE.reserved_bytes and "peak_reserved_bytes" in reserve.why
    assert all(run.memory_error is None for run in result.runs) and result.profile.hbm_bytes == BASE.hbm_bytes


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s | {"table": []}, "no run to fit"),
        (lambda s: s | {"table": [s["table"][0]]}, "no run to fit"),
        (lambda s: {"runs": s["table"]}, "no 'table' list"),
        (lambda s: s | {"model": "gpt-nope"}, "'model' is 'gpt-nope'"),
        (lambda s: _edit_run(s, lambda r: r["planner"].pop("partition")), r"table\[1\] .*missing \['partition'\]"),
        (lambda s: _edit_run(s, lambda r: r.pop("seconds")), r"missing \['seconds'\]"),
        (lambda s: _edit_run(s, lambda r: r.update(seconds=-1.0)), "seconds must be a measured step time > 0"),
        (lambda s: _edit_run(s, lambda r: r["planner"].update(offload="most")), "planner.offload='most'"),
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
    unknown.write_text(json.dumps(_suite([], device="x86_64") | {"table": [_row(16384, 1, "none", "none", None,
                                                                                   random.Random(2))]}))  # fmt: skip
    assert main(["--fit-suite", str(unknown)]) == EXIT_USAGE
    assert "give --gpu a built-in profile" in capsys.readouterr().err


def test_attention_mfu_is_optional_checked_and_round_trips(tmp_path):
    path = tmp_path / "p.json"
    BASE.save(path)
    assert json.loads(path.read_text())["attention_mfu"] is None and load_profile(path) == BASE
    assert BASE.attention_flops_per_s == BASE.flops_per_s
    TRUTH.save(path)
    assert load_profile(path).attention_flops_per_s == pytest.approx(989e12 * 0.52)
    with pytest.raises(ValueError, match=r"attention_mfu is a fraction of peak in \(0, 1\], got attention_mfu=1.5"):
        replace(BASE, attention_mfu=1.5)


def test_steps_faster_than_the_base_peak_say_so(rows):
    """H100 steps fitted against the A100's 312 TFLOP/s: the rates stop at mfu = 1 and the report says why."""
    result = fit_suite(load_suite(_suite(rows[:12])), BUILTIN_PROFILES["a100-80gb"])
    for name in ("mfu", "attention_mfu"):
        constant = result.constant(name)
        assert constant.value == 1.0 and "at its bound" in constant.why and "peak_bf16_tflops=312" in constant.why
