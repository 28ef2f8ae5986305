"""The test suite's figures in README.md and docs/, written from the last CI record, never by hand.

``.ci/run`` writes ``.ci/record.json`` (``tests/suite_record.py``; ``SPPO_SUITE_RECORD=FILE python -m pytest -q``
writes one too, without the time of the installation); ``python -m tests.suite_figures`` then rewrites every
``<!-- ci:KEY -->...<!-- /ci -->`` span of the pages with the phrase for KEY made from that record, and ``--check``
only says which spans differ (``tests/test_suite_figures.py`` fails on any, and on a count or time of the suite
written outside a span). A record of a run that failed, of part of the suite, or of a tree with uncommitted
changes is refused: the pages quote only a whole, passing run of a commit, and say how it was run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / ".ci" / "record.json"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SPAN = re.compile(r"<!-- ci:(?P<key>[\w-]+) -->(?P<text>.*?)<!-- /ci -->", re.S)
# A count or time of the test suite: "1066 tests", "904 passed", "82 deselected", "18.1 minutes of pytest time".
_COUNT = re.compile(r"\b\d[\d,]* (tests|passed|failed|skipped|deselected|errors?)\b")
_MINUTES = re.compile(r"\b\d+(\.\d+)? (minutes|min)\b")
_ABOUT_THE_SUITE = re.compile(r"pytest|\.ci/run|test suite|full suite")


NOT_RECORDED = "not recorded yet (`bash .ci/run` records it in `.ci/record.json`)"


def load_record() -> dict | None:
    return json.loads(RECORD.read_text()) if RECORD.exists() else None


def phrases(record: dict | None) -> dict[str, str]:
    """KEY -> the text its spans hold. Raises ``ValueError`` for a record the pages must not quote."""
    if record is None:
        return {"suite": NOT_RECORDED, "quick": NOT_RECORDED}
    failed = {k: v for k, v in record["outcomes"].items() if k in ("failed", "error", "xpassed") and v}
    if failed:
        raise ValueError(f"the record is of a run that did not pass ({failed}): fix the suite and run .ci/run again")
    if record["uncommitted_changes"]:
        raise ValueError("the record is of a tree with uncommitted changes: run .ci/run on a fresh clone of a commit")
    if record["deselected"]:
        raise ValueError(f"the record is not of the whole suite ({record['deselected']} tests deselected)")
    if record["ci_seconds"] is None:  # pytest alone, e.g. in a clean clone with an environment already made
        how = "(`python -m pytest -q` alone, not timed with the installation)"
    else:
        how = f"({record['ci_seconds'] / 60:.1f} minutes for all of `bash .ci/run`, a new environment included)"
    quick = record["not_slow"]
    return {
        "suite": (
            f"{record['tests']} tests in {record['pytest_seconds'] / 60:.1f} minutes of pytest time {how} on "
            f"{record['cores']} cores, load average {record['load_average_at_start']:.1f} when pytest started "
            f"(commit {record['commit'][:7]}, {record['date']})"
        ),
        "quick": f"in that run, the {quick['tests']} tests not marked slow took {quick['seconds']:.0f} s of its test time",
    }


def rewrite(text: str, texts: dict[str, str]) -> str:
    """``text`` with every span's content replaced by the phrase for its key."""

    def replace(match: re.Match) -> str:
        if match["key"] not in texts:
            raise ValueError(f"<!-- ci:{match['key']} -->: no such figure (there are {sorted(texts)})")
        return f"<!-- ci:{match['key']} -->{texts[match['key']]}<!-- /ci -->"

    return SPAN.sub(replace, text)


def stray_figures(text: str) -> list[str]:
    """Counts and times of the suite written outside a span: in a paragraph about the suite, a number of tests or
    of minutes; anywhere, "N passed" / "N deselected" (pytest's summary)."""
    found = []
    prose = re.sub(r"^\s*```.*?^\s*```", "", SPAN.sub("", text), flags=re.S | re.M)  # commands are not figures
    for paragraph in re.split(r"\n\s*\n", prose):
        about_the_suite = _ABOUT_THE_SUITE.search(paragraph)
        for pattern in (_COUNT, _MINUTES):
            for match in pattern.finditer(paragraph):
                if about_the_suite or match[1] in ("passed", "deselected"):
                    found.append(match[0])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.suite_figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which pages differ from the record")
    args = parser.parse_args(argv)
    texts = phrases(load_record())
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = rewrite(text, texts)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(new)
    verb = "differ from" if args.check else "rewritten from"
    source = RECORD.relative_to(ROOT) if RECORD.exists() else f"no record ({RECORD.relative_to(ROOT)} is missing)"
    print(f"{', '.join(stale) or 'no page'} {verb} {source}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
