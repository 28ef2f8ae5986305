"""The documentation: the site builds in strict mode, the README stays a front door, and every file or Python name
the pages cite exists. The docs tools are in the dev extra: without them this fails, it does not skip."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import mkdocs  # noqa: F401  (the dev extra installs it; a missing one must fail here, loudly)
from markdown.extensions.toc import slugify

from tests.subprocesses import one_thread_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250


def _prose(text: str) -> str:
    """The page without its fenced blocks (commands there are checked by tests/test_docs_commands.py)."""
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def test_site_builds_in_strict_mode(tmp_path: Path):
    """A broken link or anchor between pages, or an API name mkdocstrings cannot find, fails the build."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
        + ["--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=one_thread_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "forward_backward" in api and "num_subsequences" in api, "the API page lost the strategy's docstrings"


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f": {page.name}" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def _headings(path: Path) -> set[str]:
    return {slugify(m[1].strip(), "-") for m in re.finditer(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M)}


def test_readme_links_reach_a_page_and_heading():
    """The README is outside the site, so mkdocs does not check its links: this does."""
    text = _prose((ROOT / "README.md").read_text())
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links, "the README links to no docs page"
    for target, anchor in links:
        path = ROOT / target
        assert path.is_file(), f"README.md links to {target}, which does not exist"
        if anchor:
            assert anchor in _headings(path), f"README.md links to {target}#{anchor}: no such heading there"


_FILE = re.compile(
    r"`((?:lightning_sppo|benchmarks|tests|configs|recipes|data|[a-z_]+)/[\w./-]+\.(?:py|md|yaml|json|bin))`"
)
_NAME = re.compile(r"`(lightning_sppo(?:\.\w+)+)")
_PENDING: set[str] = set()  # files a page may name before they exist (none)


def test_cited_files_exist():
    """A file the pages name in code (`lightning_sppo/model/hf.py`, `benchmarks/msp_bound.py`, `runtime/links.py`
    inside the package) exists: a moved or renamed file makes the page stale."""
    missing = []
    for page in PAGES:
        for name in set(_FILE.findall(_prose(page.read_text()))) - _PENDING:
            if not any((base / name).exists() for base in (ROOT, ROOT / "lightning_sppo")):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, "the docs cite files that do not exist:\n" + "\n".join(missing)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attribute in parts[i:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return False
        return True
    return False


def test_cited_python_names_exist():
    """Every `lightning_sppo.x.y` the pages name imports (a module) or is an attribute of one."""
    assert _resolves("lightning_sppo.partition.split_sequence") and not _resolves("lightning_sppo.partition.nope")
    stale = []
    for page in PAGES:
        for name in set(_NAME.findall(page.read_text())):
            if not _resolves(name):
                stale.append(f"{page.relative_to(ROOT)}: {name}")
    assert not stale, "the docs name Python objects that do not exist:\n" + "\n".join(stale)
