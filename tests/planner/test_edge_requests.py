"""Requests at the edges of what the planner takes (found by fuzzing ``sppo-plan``): each is answered with a plan,
one line of why nothing fits, or one line naming the flag, never a traceback or a plan that breaks its own limits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.planner import NoFeasiblePlan, PlanRequest, assess_layout, resolve_profile, solve
from lightning_sppo.planner.cli import main
from lightning_sppo.planner.longest import longest_sequence
from lightning_sppo.planner.solver import fits


def _small(seq_len: int, **kwargs) -> PlanRequest:
    return PlanRequest(
        config=GPTConfig.from_name("small"), seq_len=seq_len, nodes=1, profile=resolve_profile("h100", 4), **kwargs
    )


@pytest.mark.parametrize("seq_len, n", [(3, None), (258, 2)])
def test_sppo_too_short_to_share_says_why(seq_len, n):
    """The "sppo" schedule splits each shared unit among up to pp ranks, a token each at least: 3 tokens (or 258 as 256 + 2)
    over pp=4 cannot be split. That is no plan with one reason, not the runtime's ValueError from inside the
    search; with seq1f1b allowed too, seq1f1b plans it."""
    request = _small(seq_len, pp=4, sp=1, schedule=("sppo",), num_subsequences=n)
    with pytest.raises(NoFeasiblePlan, match=r"schedule=sppo shares each subsequence among up to pp=4 ranks"):
        solve(request)
    plan = solve(_small(seq_len, pp=4, sp=1, num_subsequences=n))
    assert plan.schedule == "seq1f1b" and sum(plan.partition) == seq_len
    with pytest.raises(ValueError, match="schedule=sppo cannot share the subsequences"):
        assess_layout(request, 1, 4, n or 1)


def test_sppo_long_enough_to_share_still_plans():
    """Negative control: 260 tokens as 256 + 4 give each of the four members a token of the short unit."""
    plan = solve(_small(260, pp=4, sp=1, schedule=("sppo",), num_subsequences=2))
    assert plan.schedule == "sppo" and plan.partition == [256, 4]


def test_cli_sppo_too_short_is_one_line(capsys):
    argv = ["--model", "gpt-7b", "--seq-len", "1", "--nodes", "3", "--gpus-per-node", "2", "--gpu", "h100"]
    assert main([*argv, "--schedule", "sppo", "--pp", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "schedule=sppo" in err
    assert main(argv) == 0  # seq1f1b plans it (the auto search no longer raises inside "sppo")


@pytest.mark.parametrize("host", ["1", "7"])
def test_host_memory_below_a_byte_per_gpu(capsys, host):
    """7/8 of 1 (or 7) bytes over 8 GPUs is no byte per GPU: a plan that keeps nothing on host, or one line of why
    nothing fits, not a ZeroDivisionError from ranking the misses against a limit of 0 bytes."""
    argv = ["--model", "gpt-7b", "--nodes", "1", "--gpu", "h100", "--host-memory", host, "--json"]
    assert main([*argv, "--seq-len", "64K"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["host_limit_bytes"] == 0 and plan["peak_host_bytes"] == 0
    # needs host memory to fit in the subsequence order: why, on one line (the layer order holds 1M on the device)
    assert main([*argv, "--seq-len", "1M", "--order", "subsequence"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no layout fits" in err


def test_host_memory_of_a_few_bytes_per_gpu_still_plans(capsys):
    """Negative control: 16 bytes give each of the 8 GPUs a byte; the plan is the same one."""
    argv = ["--model", "gpt-7b", "--seq-len", "64K", "--nodes", "1", "--gpu", "h100", "--host-memory", "16", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["host_limit_bytes"] == 1 and plan["peak_host_bytes"] == 0


def _gpt1b_host_bound(seq_len: int, **kwargs) -> PlanRequest:
    config = replace(GPTConfig.from_name("gpt-1b"), block_size=4 * 2**20)
    profile = resolve_profile("h100", 1, 125 * 2**30)
    return PlanRequest(config=config, seq_len=seq_len, nodes=1, profile=profile, order=("subsequence",), **kwargs)


def test_fits_where_the_host_binds_tries_fewer_subsequences():
    """gpt-1b on one H100 with 125 GiB of host memory at 385024 tokens: its largest N holds more on host than its
    smallest (24, which solve plans), so ``fits`` said no where ``solve`` finds a plan, and ``--max-seq-len`` stopped
    1K short of what plans (384000, while 385024 to 390144 plan)."""
    assert fits(_gpt1b_host_bound(385024))
    assert solve(_gpt1b_host_bound(385024)).num_subsequences == 24
    longest = longest_sequence(_gpt1b_host_bound(1024), limit=None)
    assert solve(_gpt1b_host_bound(longest.seq_len)).seq_len == longest.seq_len
    with pytest.raises(NoFeasiblePlan):
        solve(_gpt1b_host_bound(longest.seq_len + 1024))  # 1K more does not plan: the answer is the longest


def test_fits_at_the_largest_n_alone_misses_there():
    """Negative control: pinned to its largest N (160) the same length fits in no configuration."""
    assert not fits(_gpt1b_host_bound(385024, num_subsequences=160))
    with pytest.raises(NoFeasiblePlan):
        solve(_gpt1b_host_bound(385024, num_subsequences=160))


def test_no_kv_on_the_device_reads_as_0_tokens():
    """--kv-device-tokens 0 printed "0M tokens of each layer"; 0 is digits (negative control: 1M and 512K)."""
    from lightning_sppo.planner.units import format_tokens

    assert (format_tokens(0), format_tokens(2**20), format_tokens(512 * 1024)) == ("0", "1M", "512K")
