"""``sppo-plan``: text and JSON output, exit statuses, and one-line errors (never a traceback)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_sppo.planner import BUILTIN_PROFILES
from lightning_sppo.planner.cli import EXIT_NO_FIT, EXIT_USAGE, main

JSON_KEYS = {
    "sp", "pp", "dp", "num_subsequences", "partition", "alpha", "peak_gpu_bytes", "peak_host_bytes",
    "step_time_s", "tokens_per_gpu_per_s", "mfu", "bubble_ratio", "schedule", "kv_grad_dtype",
}  # fmt: skip


def test_json_output(capsys):
    assert main(["--model", "gpt-1b", "--seq-len", "128K", "--nodes", "1", "--gpu", "h100", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= set(plan)
    assert plan["sp"] * plan["pp"] * plan["dp"] == 8
    assert sum(plan["partition"]) == 2**17 and len(plan["alpha"]) == plan["num_subsequences"]
    assert plan["peak_gpu_bytes"] <= BUILTIN_PROFILES["h100"].hbm_bytes


def test_fixed_sizes_and_modes(capsys):
    argv = ["--model", "gpt-1b", "--seq-len", "128K", "--gpu", "h100", "--json", "--sp", "4", "--pp", "2"]
    assert main([*argv, "--offload", "full", "--fsdp-sync", "regather"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["sp"], plan["pp"], plan["dp"], plan["offload"], plan["fsdp_sync"]) == (4, 2, 1, "full", "regather")


def test_schedule_and_kv_grad_dtype_flags(capsys):
    """--json names the schedule and the dK/dV dtype; a fixed schedule is the one planned."""
    argv = ["--model", "gpt-1b", "--seq-len", "128K", "--gpu", "h100", "--json", "--pp", "2"]
    for schedule in ("seq1f1b", "sppo"):
        assert main([*argv, "--schedule", schedule, "--kv-grad-dtype", "bf16"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert (plan["schedule"], plan["kv_grad_dtype"]) == (schedule, "bf16")
        assert plan["other_schedules"] == []
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_grad_dtype"] == "fp32" and len(plan["other_schedules"]) == 1


def test_sizes_that_do_not_divide_the_gpus(capsys):
    assert main(["--model", "gpt-1b", "--seq-len", "128K", "--sp", "3"]) == EXIT_NO_FIT
    assert "no (sp, pp) with --sp=3 divides the 8 GPUs" in _one_line_error(capsys)


def test_text_output_shows_layout_memory_time_and_runner_ups(capsys):
    assert main(["--model", "gpt-1b", "--seq-len", "131072", "--nodes", "2", "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    for needle in ("layout", "sp=", "memory / GPU", "host", "tokens/GPU/s", "MFU", "bubble ratio", "runner-ups"):
        assert needle in out, needle


def test_a_step_of_several_replicas_says_how_many_sequences_it_trains(capsys):
    """Step times compare at equal work: a dp-way step trains dp sequences, and the output says so."""
    argv = ["--model", "gpt-1b", "--seq-len", "128K", "--gpu", "h100", "--sp", "2", "--pp", "1"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["dp"] == 4 and plan["seconds_per_sequence"] == pytest.approx(plan["step_time_s"] / 4)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"s for 4 sequences (one per data-parallel replica; {plan['seconds_per_sequence']:.2f} s each)" in out
    assert "no pipeline" in out
    assert main([*argv[:-4], "--sp", "8", "--pp", "1"]) == 0  # dp = 1: the step is the sequence
    out = capsys.readouterr().out
    assert "sequences (one per" not in out and "step " in out


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.slow
def test_too_long_for_the_memory(capsys):
    """Without recompute, spill or model state on host (pinned), 4M tokens of gpt-7b do not fit on 4 nodes."""
    lean = ["--recompute", "none", "--kv-device-tokens", "all", "--model-state", "device"]
    assert main(["--model", "gpt-7b", "--seq-len", "4M", "--nodes", "4", *lean]) == EXIT_NO_FIT
    line = _one_line_error(capsys)
    assert line.startswith("sppo-plan: no layout fits gpt-7b at --seq-len=4194304 (4M) on 4 x 8 a100-80gb")
    assert "GiB over the 80.0 GiB" in line and "too long for the memory" in line


@pytest.mark.slow
def test_too_few_gpus_for_the_model(capsys):
    argv = ["--model", "gpt-65b", "--seq-len", "64K", "--nodes", "1", "--json"]
    assert main([*argv, "--model-state", "device"]) == EXIT_NO_FIT
    line = _one_line_error(capsys)
    assert "too few GPUs for the model" in line and "use more --nodes or --model-state=host" in line
    assert main(argv) == 0  # model state on host: 16 bytes per parameter there, the device keeps gathered blocks
    assert json.loads(capsys.readouterr().out)["model_state"] == "host"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt-7b", "--seq-len", "lots"], "--seq-len='lots' is not a token count"),
        (["--model", "gpt-7b"], "--seq-len required"),
        (["--model", "gpt-99b", "--seq-len", "1M"], "argument --model: invalid choice: 'gpt-99b'"),
        (["--model", "gpt-7b", "--seq-len", "1M", "--nodes", "0"], "--nodes must be a positive integer"),
        (["--model", "gpt-7b", "--seq-len", "1M", "--gpu", "tpu"], "--gpu='tpu' is neither a built-in profile"),
        (["--model", "gpt-7b", "--seq-len", "1M", "--gpus-per-node", "0"], "--gpus-per-node must be >= 1"),
        # issue 39: accepted without a word with the 8-GPU built-in profiles
        (
            ["--model", "tiny", "--seq-len", "4K", "--gpus-per-node", "9"],
            "--gpus-per-node=9: the built-in a100-80gb profile describes nodes of up to 8 GPUs",
        ),
        (["--model", "tiny", "--seq-len", "4K", "--gpus-per-node", "16", "--gpu", "h100"], "--gpus-per-node=16"),
        (["--model", "gpt-7b", "--seq-len", "1M", "--schedule", "gpipe"], "argument --schedule: invalid choice"),
        (["--model", "gpt-7b", "--seq-len", "1M", "--kv-grad-dtype", "fp16"], "argument --kv-grad-dtype: invalid"),
    ],
)
def test_bad_arguments(capsys, argv, message):
    assert main(argv) == EXIT_USAGE
    assert message in _one_line_error(capsys)


def test_profile_file(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    BUILTIN_PROFILES["h200"].save(path)
    assert main(["--model", "gpt-1b", "--seq-len", "64K", "--gpu", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"] == "h200"
    # a profile of one's own node may describe a larger one than the built-ins' 8 GPUs
    assert main(["--model", "gpt-1b", "--seq-len", "64K", "--gpu", str(path), "--gpus-per-node", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus_per_node"] == 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_calibrate_without_a_gpu(capsys, tmp_path):
    assert main(["--calibrate", "--out", str(tmp_path / "p.json")]) == EXIT_NO_FIT
    assert "--calibrate needs a CUDA GPU" in _one_line_error(capsys)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibrate_writes_a_loadable_profile(tmp_path, capsys):
    from lightning_sppo.planner import load_profile

    out = tmp_path / "p.json"
    assert main(["--calibrate", "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.d2h_gbps > 1 and 0 < profile.mfu <= 1 and profile.hbm_bytes > 2**30


def test_a_preset_is_planned_past_its_block_size(capsys):
    """Continued pretraining past a model's context: the run raises model_overrides.block_size, and sppo-plan
    plans the longer sequence the same way (positions cost no memory); an explicit --block-size below it is the
    run's error, named with the flag to change."""
    argv = ["--model", "llama-3.2-1b", "--seq-len", "256K", "--gpu", "h100", "--json"]
    assert main(argv) == 0
    assert sum(json.loads(capsys.readouterr().out)["partition"]) == 2**18
    assert main([*argv, "--block-size", "128K"]) == EXIT_USAGE
    assert "or raise --block-size" in capsys.readouterr().err


def test_num_subsequences_pins_n(capsys):
    argv = ["--model", "gpt-1b", "--seq-len", "128K", "--gpu", "h100", "--json", "--sp", "4", "--pp", "2"]
    assert main([*argv, "--num-subsequences", "24"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_subsequences"] == 24 and len(plan["partition"]) == 24 and plan["sp"] == 4
    # 128K over sp=4 in granules of 4 x 128 tokens: at most 256 subsequences; the error names the setting.
    assert main([*argv, "--num-subsequences", "257"]) == EXIT_NO_FIT
    error = _one_line_error(capsys)
    assert "--num-subsequences=257 leaves fewer than 512 tokens" in error and "--num-subsequences<=256" in error
    assert error.count("--num-subsequences=257") == 1  # once, though both schedules skip the layout
    # every layout too fine: one clause, the bound of the layout that takes the most (sp=1: 128K / 128 tokens)
    assert main([*argv[:-4], "--num-subsequences", "100000"]) == EXIT_NO_FIT
    error = _one_line_error(capsys)
    assert error.count("--num-subsequences=100000") == 1 and error.endswith("use --num-subsequences<=1024."), error
    assert main([*argv[:-4], "--num-subsequences", "0"]) == 2
    assert "--num-subsequences must be a positive integer" in capsys.readouterr().err
