"""What the GPU suite's parts share: the time budget, the report (written after every row), and the run's context.

The budget is one total (``--budget-s``) cut into one allotment per part. A part may run until the total's end minus
the allotments of the parts after it: what an earlier part leaves unused goes to the next, and no part eats what the
later ones were promised. Parts call ``check()`` between measurements (a step in flight is never interrupted: on CUDA
an interrupted step could leave work queued and memory held) and ask ``affords(seconds)`` before each one.

The report is a dict written as JSON and Markdown after every row, each file replaced atomically, so a process killed
by the device call's own timeout leaves everything measured before the row in flight.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Budget",
    "Context",
    "PartBudget",
    "PartOverBudget",
    "Report",
    "context_bytes",
    "default_out",
    "first_line",
    "git_commit",
    "gpu_slug",
    "host_memory_bytes",
    "process_age_s",
]

ROOT = Path(__file__).resolve().parents[1]


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error's message, shortened (empty for an error without one)."""
    return (str(error).splitlines() or [""])[0][:limit]


class PartOverBudget(Exception):
    """A part reached the end of its time; what it measured so far stays in the report."""


@dataclass
class PartBudget:
    """The time one part may still use."""

    name: str
    deadline: float
    """``time.monotonic()`` at which the part must stop."""
    allotted_s: float

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def affords(self, seconds: float) -> bool:
        return seconds <= self.left()

    def check(self) -> None:
        if self.left() <= 0:
            raise PartOverBudget(f"part {self.name!r} used its time ({self.allotted_s:g} s allotted)")


class Budget:
    """The suite's total time, cut into per-part allotments (``allotments`` in the order the parts run)."""

    def __init__(self, total_s: float, allotments: dict[str, float]) -> None:
        self.start = time.monotonic()
        self.total_s = total_s
        self.allotments = dict(allotments)

    def part(self, name: str) -> PartBudget:
        names = list(self.allotments)
        later = sum(self.allotments[n] for n in names[names.index(name) + 1 :])
        return PartBudget(name, self.start + self.total_s - later, self.allotments[name])

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class Report:
    """The suite's results as one dict, written as ``gpu_suite.json`` and ``gpu_suite.md`` under ``out``."""

    def __init__(self, out: Path, data: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
        self.out, self.data, self.render = out, data, render

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        _replace(self.out / "gpu_suite.json", json.dumps(self.data, indent=2, default=_plain) + "\n")
        _replace(self.out / "gpu_suite.md", self.render(self.data))


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a kill at any moment leaves the old file or the new one, never half."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _plain(value: Any) -> Any:
    """JSON for what ``json`` does not know: tuples of a dataclass, dtypes, paths."""
    return str(value)


@dataclass
class Context:
    """What every part reads and writes: the device, the sizes, the report, its budget and the shared models."""

    device: torch.device
    sizes: Any
    """``gpu_suite.Sizes``."""
    report: Report
    peak_flops: float | None
    budget: PartBudget | None = None
    """The running part's budget (set by the runner)."""
    lost: str | None = None
    """Why the CUDA context cannot be used any more (a device-side assert, an illegal access), once it happened."""
    cache: dict[str, Any] = field(default_factory=dict)
    """Objects the parts share: the current model, the planner."""

    @property
    def data(self) -> dict[str, Any]:
        return self.report.data

    def save(self) -> None:
        self.report.save()


def git_commit(given: str | None = None) -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes), or ``given`` where there is no git (the device
    machine receives a copy of the working tree without ``.git``: pass ``--commit``)."""
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here: pass --commit)"
    return head + ("+dirty" if dirty else "")


def gpu_slug(device: torch.device) -> str:
    """A short folder name for the device: h100, h200, a100, else its name in lower case (cpu off CUDA)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    for tag in ("H200", "H100", "A100"):
        if tag in name.upper():
            return tag.lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_out(device: torch.device, quick: bool) -> Path:
    """``benchmarks/results/gpu/<gpu>-<date>/`` (``-quick`` for the tiny sizes)."""
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return ROOT / "benchmarks" / "results" / "gpu" / f"{gpu_slug(device)}-{date}{'-quick' if quick else ''}"


def process_age_s() -> float:
    """Seconds since this process started (its imports included: a device call's clock starts before them), from
    ``/proc``; 0 where that cannot be read."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def host_memory_bytes() -> int | None:
    """This machine's memory (``MemTotal``), or None where ``/proc/meminfo`` cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def context_bytes(device: torch.device) -> int | None:
    """Device bytes in use outside PyTorch's caching allocator: the CUDA context and the libraries' loaded kernels
    (what ``sppo-plan --fit-suite`` adds to the allocator's peak)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def base_environment(device: torch.device, peak: float | None, commit: str) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "total_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "context_bytes": context_bytes(device),
        "git_commit": commit,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "peak_flops": peak,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
