"""Every bad input of ``bad_inputs.CASES`` ends as the exit-status convention says (issue 32): the right status,
one ``PROG: error:`` line naming the setting in the caller's terms, no traceback. All cases run in one process,
started once for the module, forked from the preloaded server (``tests/preloaded.py``: no import of torch and
Lightning of its own)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests import preloaded
from tests.subprocesses import one_thread_env
from tests.training.bad_inputs import CASES, Case, Outcome, check

pytestmark = pytest.mark.slow  # about 60 runs of the four commands, one fit of 2 steps among them

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    out = tmp_path_factory.mktemp("bad") / "outcomes.json"
    env = one_thread_env(PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    run = preloaded.run([sys.executable, str(ROOT / "tests/training/bad_inputs.py"), str(out)], env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {k: Outcome(**v) for k, v in json.loads(out.read_text()).items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(outcomes: dict[str, Outcome], case: Case):
    outcome = outcomes[case.id]
    assert not check(case, outcome), (check(case, outcome), outcome.output[-2000:] or outcome.error)


def test_the_table_covers_every_command_and_a_negative_control():
    """Every command has cases; the check itself fails an outcome that is a traceback with status 1 (what 17 of
    the issue's cases printed), and one whose line names no setting."""
    assert {c.program for c in CASES} == {"sppo", "sppo-export", "sppo-prepare", "sppo-plan", "fabric"}
    case = next(c for c in CASES if c.id == "fit-seq-len-0")
    traceback = Outcome(1, "Traceback (most recent call last):\n...\nValueError: seq_len=0\n", "", 3, [])
    assert "exit status 1, not 2" in check(case, traceback) and "a traceback" in check(case, traceback)
    vague = Outcome(2, "sppo: error: something is wrong\n", "", 1, ["sppo: error: something is wrong"])
    assert check(case, vague) == ["does not name 'data.seq_len'"]
