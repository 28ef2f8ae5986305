"""Requests at the edges of what the planner takes (found by fuzzing ``sppo-plan``): each is answered with a plan,
one line of why nothing fits, or one line naming the flag, never a traceback or a plan that breaks its own limits."""

from __future__ import annotations

import pytest

from lightning_sppo import GPTConfig
from lightning_sppo.planner import NoFeasiblePlan, PlanRequest, assess_layout, resolve_profile, solve
from lightning_sppo.planner.cli import main


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
