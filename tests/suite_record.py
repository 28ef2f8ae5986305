"""A machine-readable record of one test-suite run, for the figures the docs quote (``tests/suite_figures.py``).

Active only where ``SPPO_SUITE_RECORD`` names the file to write (``.ci/run`` sets it); registered by
``tests/conftest.py``. The record holds what pytest's summary line says (outcomes, seconds), the tests not marked
``slow`` and their share of the run's time, the machine (cores, load average when pytest started) and the commit.
``SPPO_SUITE_STARTED`` (seconds since the epoch, set by ``.ci/run`` before it creates the environment) adds the
time of the whole CI run, installation and lint included.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.subprocesses import one_thread_env

RECORD_VARIABLE = "SPPO_SUITE_RECORD"
STARTED_VARIABLE = "SPPO_SUITE_STARTED"
ROOT = Path(__file__).resolve().parents[1]


class SuiteRecord:
    """Counts what pytest reports, test by test, and writes it out at the end of the session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.time()
        self.load_at_start = os.getloadavg()[0]
        self.outcomes: Counter[str] = Counter()
        self.deselected = 0
        self.slow: dict[str, bool] = {}
        self.seconds: Counter[str] = Counter()  # nodeid -> setup + call + teardown

    @pytest.hookimpl(trylast=True)
    def pytest_deselected(self, items) -> None:
        self.deselected += len(items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.slow = {item.nodeid: item.get_closest_marker("slow") is not None for item in session.items}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        outcome = _outcome(report)
        if outcome:
            self.outcomes[outcome] += 1

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.path.write_text(json.dumps(self.record(), indent=1) + "\n")

    def record(self) -> dict:
        now = time.time()
        quick = [nodeid for nodeid, slow in self.slow.items() if not slow]
        started = os.environ.get(STARTED_VARIABLE)
        return {
            "command": "python -m pytest -q",
            "commit": _git("rev-parse", "HEAD"),
            # An earlier record in the same checkout is not a change to the code under test.
            "uncommitted_changes": bool(
                _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!.ci/record.json")
            ),
            "date": datetime.fromtimestamp(self.started, timezone.utc).strftime("%Y-%m-%d"),
            "cores": os.cpu_count(),
            "load_average_at_start": round(self.load_at_start, 2),
            "python": platform.python_version(),
            "torch": _version("torch"),
            "tests": len(self.slow),
            "outcomes": dict(sorted(self.outcomes.items())),
            "deselected": self.deselected,
            "pytest_seconds": round(now - self.started, 1),
            "ci_seconds": round(now - float(started), 1) if started else None,
            "not_slow": {"tests": len(quick), "seconds": round(sum(self.seconds[n] for n in quick), 1)},
        }


def _outcome(report: pytest.TestReport) -> str | None:
    """What pytest's summary line counts for this report: an outcome per test, and an error per failed set-up or
    tear-down."""
    expected_failure = hasattr(report, "wasxfail")
    if report.when == "call":
        if expected_failure:
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome
    if report.failed:
        return "error"
    if report.skipped:  # a skip (or an xfail marker with run=False) in set-up
        return "xfailed" if expected_failure else "skipped"
    return None


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, env=one_thread_env(), capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(RECORD_VARIABLE)
    if path:
        config.pluginmanager.register(SuiteRecord(Path(path).resolve()), "sppo_suite_record")
