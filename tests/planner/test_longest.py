"""``sppo-plan --max-seq-len``: the bisection over the length (``planner.longest``) and its CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.planner import NoFeasiblePlan, PlanRequest
from lightning_sppo.planner.cli import EXIT_USAGE, main
from lightning_sppo.planner.longest import longest_sequence
from lightning_sppo.planner.solver import fits
from tests.planner.conftest import small_gpu

TINY = GPTConfig.from_name("tiny-gqa")


def _request(hbm_gib: float = 0.25, host_gib: float = 2.0, **overrides) -> PlanRequest:
    profile = replace(small_gpu(hbm_gib, host_gib), gpus_per_node=1)
    return PlanRequest(**(dict(config=TINY, seq_len=1024, nodes=1, profile=profile) | overrides))


def _at(request: PlanRequest, length: int) -> PlanRequest:
    return replace(request, config=replace(request.config, block_size=max(length, request.config.block_size)),
                   seq_len=length)  # fmt: skip


@pytest.mark.slow
def test_the_answer_fits_and_one_granule_more_does_not():
    request = _request()
    longest = longest_sequence(request, granularity=1024, start=8192)
    length = longest.seq_len
    assert length % 1024 == 0 and length >= 8192
    assert fits(_at(request, length)) and not fits(_at(request, length + 1024))
    plan = longest.plan
    assert plan.seq_len == length
    assert plan.peak_gpu_bytes <= plan.gpu_bytes and plan.peak_host_bytes <= plan.host_limit_bytes
    # The predicate is monotone over every length the search tried.
    fit = [n for n, ok in longest.probes if ok]
    miss = [n for n, ok in longest.probes if not ok]
    assert max(fit) == length and min(miss) == length + 1024


@pytest.mark.slow
def test_more_host_memory_goes_further_and_pins_are_kept():
    small = longest_sequence(_request(host_gib=1.0), granularity=1024, start=8192).seq_len
    large = longest_sequence(_request(host_gib=4.0), granularity=1024, start=8192).seq_len
    assert large > small
    plain = longest_sequence(
        _request(host_gib=4.0, recompute=("none",), kv_device_tokens=None), granularity=1024, start=8192
    )
    assert plain.seq_len < large and plain.plan.recompute == "none" and plain.plan.kv_device_tokens is None


def test_a_block_size_limit_stops_the_search():
    request = _request(host_gib=4.0)
    longest = longest_sequence(request, granularity=1024, start=8192, limit=20000)
    assert longest.seq_len == 19456 and longest.limit == 20000


def test_nothing_fits():
    with pytest.raises(NoFeasiblePlan):
        longest_sequence(_request(hbm_gib=0.001, host_gib=0.001), granularity=1024, start=1024)


@pytest.mark.slow
def test_cli_max_seq_len(capsys, tmp_path):
    path = tmp_path / "gpu.json"
    replace(small_gpu(0.25, 2.0), gpus_per_node=1, host_bytes_per_node=0).save(path)
    argv = ["--model", "tiny-gqa", "--gpu", str(path), "--max-seq-len"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_seq_len"] == out["plan"]["seq_len"] and out["granularity"] == 1024
    assert out["plan"]["peak_gpu_bytes"] <= out["plan"]["gpu_bytes"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for needle in ("longest sequence", "does not fit", "host assumption", "tokens/GPU/s", "MFU", "recompute"):
        assert needle in text, needle
    assert main([*argv, "--seq-len", "1M"]) == EXIT_USAGE
    assert "drop --seq-len" in capsys.readouterr().err


def test_cli_flags(capsys):
    argv = ["--model", "llama-3.1-8b", "--seq-len", "64K", "--gpu", "h100", "--sp", "8", "--schedule", "seq1f1b"]
    pins = ["--recompute", "full", "--kv-device-tokens", "16K", "--model-state", "host", "--host-memory", "1T"]
    assert main([*argv, *pins, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["recompute"], plan["kv_device_tokens"], plan["model_state"]) == ("full", 16384, "host")
    assert plan["host_bytes_per_node"] == 2**40 and plan["host_limit_bytes"] == 2**40 * 7 // 8 // 8
    assert plan["memory"]["host_bytes"] == plan["peak_host_bytes"] <= plan["host_limit_bytes"]
    assert main([*argv, "--kv-device-tokens", "all", "--recompute", "none", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_device_tokens"] is None and plan["recompute"] == "none"
    assert main([*argv, "--kv-device-tokens", "lots"]) == EXIT_USAGE
    assert "--kv-device-tokens='lots'" in capsys.readouterr().err
    assert main([*argv, "--host-memory", "much"]) == EXIT_USAGE
    assert "--host-memory='much' is not a size" in capsys.readouterr().err


@pytest.mark.slow
def test_a_step_time_limit_stops_below_what_memory_allows():
    """--max-step-time: the answer's fastest plan takes at most the limit and one granule more takes longer; memory
    alone would allow more (negative control: without the limit the answer is that longer length)."""
    request = _request(hbm_gib=0.5)
    free = longest_sequence(request, granularity=1024, start=8192)
    limit = free.plan.step_time_s / 3
    limited = longest_sequence(request, granularity=1024, start=8192, max_step_time_s=limit)
    assert limited.seq_len < free.seq_len and limited.plan.step_time_s <= limit
    from lightning_sppo.planner.solver import solve

    assert solve(_at(request, limited.seq_len + 1024)).step_time_s > limit
    assert limited.memory_seq_len == free.seq_len and limited.memory_step_time_s == pytest.approx(free.plan.step_time_s)


def test_max_step_time_needs_max_seq_len(capsys):
    assert main(["--model", "tiny", "--seq-len", "4K", "--max-step-time", "60"]) == EXIT_USAGE
    assert "--max-step-time=60 needs --max-seq-len" in capsys.readouterr().err
