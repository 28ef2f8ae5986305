"""The suite's counts and times in README.md and docs/ are the last record's (``tests/suite_figures.py``), and the
record counts what pytest reports (``tests/suite_record.py``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests import suite_figures
from tests.suite_figures import PAGES, ROOT, load_record, phrases, rewrite, stray_figures


def test_the_pages_quote_the_last_record():
    """A span edited by hand, or a record newer than the pages, fails here until ``python -m tests.suite_figures``
    has rewritten them."""
    texts = phrases(load_record())
    stale = [str(p.relative_to(ROOT)) for p in PAGES if rewrite(p.read_text(), texts) != p.read_text()]
    assert not stale, f"{stale} differ from .ci/record.json: run `python -m tests.suite_figures`"
    keys = {page.name: set(re.findall(r"<!-- ci:([\w-]+) -->", page.read_text())) for page in PAGES}
    assert "suite" in keys["README.md"] and "quick" in keys["troubleshooting.md"], keys


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_count_or_time_of_the_suite_is_written_by_hand(page):
    assert not stray_figures(page.read_text()), (
        f"{page.name}: {stray_figures(page.read_text())} written by hand; quote the record with <!-- ci:KEY -->"
    )


RECORD = {
    "commit": "0123456789abcdef", "uncommitted_changes": False, "date": "2026-11-26", "cores": 2,
    "load_average_at_start": 0.42, "tests": 1200, "outcomes": {"passed": 1197, "skipped": 3}, "deselected": 0,
    "pytest_seconds": 600.0, "ci_seconds": 690.0, "not_slow": {"tests": 1100, "seconds": 125.6},
}  # fmt: skip
"""A record as tests/suite_record.py writes it, to check the checks (not a measurement)."""


def test_the_checks_catch_a_hand_edit_a_stray_figure_and_a_record_not_to_quote():
    texts = phrases(RECORD)
    assert texts["suite"].startswith("1200 tests in 10.0 minutes of pytest time (11.5 minutes for all of")
    assert "commit 0123456, 2026-11-26" in texts["suite"] and "1100 tests not marked slow took 126 s" in texts["quick"]
    page = f"The suite: <!-- ci:suite -->{texts['suite']}<!-- /ci -->.\n"
    assert rewrite(page, texts) == page
    edited = page.replace("10.0 minutes", "9.0 minutes")
    assert rewrite(edited, texts) == page != edited
    with pytest.raises(ValueError, match="no such figure"):
        rewrite("<!-- ci:typo -->1<!-- /ci -->", texts)
    assert stray_figures("`python -m pytest -q` took 18.1 minutes (1066 tests).") == ["1066 tests", "18.1 minutes"]
    assert stray_figures("A quick check: 904 passed, 82 deselected.") == ["904 passed", "82 deselected"]
    assert stray_figures("The demo took 26 s; the table has 77 cases; 3 tests of the planner.") == []
    for change, why in (
        ({"outcomes": {"passed": 1196, "failed": 1}}, "did not pass"),
        ({"uncommitted_changes": True}, "uncommitted changes"),
        ({"deselected": 82}, "not of the whole suite"),
    ):
        with pytest.raises(ValueError, match=why):
            phrases(RECORD | change)
    assert "`python -m pytest -q` alone" in phrases(RECORD | {"ci_seconds": None})["suite"]


SAMPLE = """
import pytest

def test_passes(): pass

@pytest.mark.slow
def test_slow(): pass

def test_skips(): pytest.skip("no")

def test_fails(): assert False

@pytest.mark.xfail
def test_expected_to_fail(): assert False

@pytest.fixture
def broken(): raise RuntimeError

def test_broken_set_up(broken): pass

def test_deselected(): pass
"""


def test_the_record_counts_what_pytest_s_summary_says(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    env = os.environ | {"SPPO_SUITE_RECORD": str(tmp_path / "record.json"), "PYTHONPATH": str(ROOT)}
    env.pop("SPPO_SUITE_STARTED", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.suite_record", "-p", "no:cacheprovider", "-k",
               "not deselected", str(tmp_path)]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    summary = run.stdout.strip().splitlines()[-1]  # "1 failed, 2 passed, ... in 0.05s"
    said = {kind.rstrip("s") if kind == "errors" else kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", summary)}
    record = json.loads((tmp_path / "record.json").read_text())
    assert said == record["outcomes"] | {"deselected": record["deselected"]}, (summary, record)
    assert said == {"passed": 2, "failed": 1, "skipped": 1, "xfailed": 1, "error": 1, "deselected": 1}
    assert record["tests"] == 6 and record["not_slow"]["tests"] == 5 and record["ci_seconds"] is None
    assert record["pytest_seconds"] >= record["not_slow"]["seconds"] >= 0
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and record["cores"] == os.cpu_count()
    with pytest.raises(ValueError, match="did not pass"):
        phrases(record)


def test_the_script_checks_and_rewrites(capsys):
    assert suite_figures.main(["--check"]) == 0
    assert "no page differ" in capsys.readouterr().out
