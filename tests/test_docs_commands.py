"""Every command the README and docs/ show is run here, or marked as not run with a reason.

The rule, for each fenced block of README.md and docs/*.md:

- a shell block (bash, sh, shell, console) is run, command by command, in a scratch folder holding a copy of
  ``data/`` and ``configs/`` and the page's ``<!-- file: NAME -->`` blocks (a YAML block after that comment is
  written to NAME first), unless the line before it says ``<!-- gpu-only -->`` or ``<!-- not-run: reason -->``;
- a Python block is run the same way (a page's blocks in order, one namespace per page, all pages in one
  process), unless marked, or written to a file for the page's commands (``<!-- file: NAME.py -->``);
- a marked block is still checked where that costs nothing: ``sppo-plan`` arguments are parsed by its own
  parser, ``sppo fit`` / ``sppo validate`` lines are parsed with ``--print_config`` (the config they name must
  exist), and a ``configs/...`` path must exist.

A block with neither a marker nor a way to run it fails, so a new command cannot slip into the docs unchecked.
Identical commands with identical files run once.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import preloaded
from tests.subprocesses import one_thread_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
SCRIPTS = {"sppo", "sppo-plan", "sppo-prepare", "sppo-export"}
MARKER = re.compile(r"^\s*<!--\s*(gpu-only|not-run:\s*(?P<reason>.+?)|file:\s*(?P<file>\S+))\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
TIMEOUT_S = 300
PENDING_CONFIGS: set[str] = set()  # configs a page may name before they exist (none)


@dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    marker: str | None = None  # "gpu-only", "not-run" or None (run it)
    reason: str = ""
    file: str | None = None  # for a block preceded by <!-- file: NAME -->

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Page:
    name: str
    blocks: list[Block] = field(default_factory=list)

    def files(self) -> dict[str, str]:
        return {b.file: b.text for b in self.blocks if b.file}


def parse_page(name: str, text: str) -> Page:
    """The fenced blocks of one Markdown page, each with the marker comment on the line before it (if any)."""
    page = Page(name)
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, indent = i, len(fence["indent"])
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # the closing fence
        block = Block(page.name, start + 1, fence["lang"].lower(), "\n".join(body) + "\n")
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(previous)
        if marker and marker["file"]:
            block.file = marker["file"]
        elif marker:
            block.marker = "not-run" if marker["reason"] else "gpu-only"
            block.reason = (marker["reason"] or "").strip()
        page.blocks.append(block)
    return page


def commands(block: Block) -> list[str]:
    """The commands of a shell block: continuation lines joined, comment lines and a leading ``$ `` dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", block.text)
    out = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ")
        if line and not line.startswith("#"):
            out.append(line)
    return out


ALL_PAGES = [parse_page(str(path.relative_to(ROOT)), path.read_text()) for path in PAGES]


def _scratch(tmp_path: Path, files: dict[str, str]) -> Path:
    work = tmp_path / "work"
    work.mkdir(parents=True)
    shutil.copytree(ROOT / "data", work / "data", ignore=shutil.ignore_patterns("README.md"))
    shutil.copytree(ROOT / "configs", work / "configs")
    for name, text in files.items():
        (work / name).write_text(text)
    return work


def _env() -> dict[str, str]:
    scripts = str(Path(sys.executable).parent)  # the console scripts of this environment (sppo, sppo-plan, ...)
    return one_thread_env(
        PATH=scripts + os.pathsep + os.environ.get("PATH", ""),
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        WANDB_MODE="offline",
    )


# -- the rule itself ----------------------------------------------------------------------------------------


def test_the_pages_have_blocks_to_check():
    """The parser finds the README's quick start and its minimal config (a negative control for the rule)."""
    readme = ALL_PAGES[0]
    shell = [b for b in readme.blocks if b.lang in SHELL]
    assert any("python -m pytest -q" in b.text for b in shell)
    assert any(b.file == "my.yaml" and "batch_size" in b.text for b in readme.blocks)
    text = (
        "```bash\nsppo fit --help\n```\n\n<!-- not-run: needs a model folder -->\n\n```bash\nsppo fit\n```\n"
        "1. a step\n\n   <!-- gpu-only -->\n   ```bash\n   sppo-plan --model gpt-7b \\\n       --seq-len 16K\n   ```\n"
    )
    unmarked, marked, indented = parse_page("x.md", text).blocks
    assert (unmarked.marker, marked.marker, marked.reason) == (None, "not-run", "needs a model folder")
    assert indented.marker == "gpu-only"
    assert commands(indented) == ["sppo-plan --model gpt-7b --seq-len 16K"]


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: p.name)
def test_every_block_is_runnable_or_marked(page: Page):
    for block in page.blocks:
        if block.lang in SHELL | {"python", "yaml"} or block.marker or block.file:
            continue
        assert block.lang in ("", "text"), (
            f"{block.where}: a ```{block.lang} block; the test runs bash/sh/shell/console and python blocks and "
            "writes yaml blocks marked <!-- file: NAME -->: use one of those or mark it <!-- not-run: reason -->"
        )
        assert not any(line.startswith(tuple(SCRIPTS)) for line in block.text.splitlines()), (
            f"{block.where}: commands in a block without a language; fence it as ```bash"
        )
    for block in page.blocks:
        if block.marker == "not-run":
            assert len(block.reason) > 5, f"{block.where}: <!-- not-run: ... --> needs a reason"
        if block.lang == "yaml" and not block.marker and not block.file:
            raise AssertionError(
                f"{block.where}: a YAML block that is neither written to a file for the commands of the page "
                "(<!-- file: NAME -->) nor marked <!-- not-run: reason -->"
            )


# -- running what is not marked -------------------------------------------------------------------------------


def _runnable_blocks() -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, commands, files they name) for each unmarked shell block; a block seen before is dropped."""
    seen, out = set(), []
    for page in ALL_PAGES:
        for block in page.blocks:
            if block.lang not in SHELL or block.marker:
                continue
            lines = commands(block)
            files = {name: text for name, text in page.files().items() if any(name in line for line in lines)}
            key = (tuple(shlex.join(shlex.split(line, comments=True)) for line in lines), tuple(sorted(files.items())))
            if key not in seen:
                seen.add(key)
                out.append((block.where, lines, files))
    return out


def _entry_points() -> dict[str, str]:
    """Console script name -> "module:function", as pyproject.toml declares them (what `pip install` writes)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


_COMMAND_RUNNER = r"""
import contextlib, importlib, io, json, os, shlex, shutil, subprocess, sys, traceback
from tests import preloaded
scripts, blocks, report = json.loads(sys.stdin.read())
failed = []
for where, folder, lines in blocks:
    os.chdir(folder)
    for line in lines:
        words = shlex.split(line, comments=True)
        out = io.StringIO()
        if words[0] in scripts and not set("|&;<>$`") & set(line.split("#")[0]):
            # the function the console script calls, in this process: one import of torch for every command
            module, _, function = scripts[words[0]].partition(":")
            sys.argv = words
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    code = getattr(importlib.import_module(module), function)()
            except SystemExit as exit:
                code = exit.code
            except BaseException:
                code, _ = 1, out.write(traceback.format_exc())
            code = 0 if code is None else code
        elif shutil.which(words[0]) == sys.executable and not set("|&;<>$`") & set(line.split("#")[0]):
            # `python ...`: forked from the preloaded server, which has torch imported (tests/preloaded.py)
            result = preloaded.run([sys.executable, *words[1:]])
            code, _ = result.returncode, out.write(result.stdout + result.stderr)
        else:
            result = subprocess.run(["bash", "-c", line], capture_output=True, text=True)
            code, _ = result.returncode, out.write(result.stdout + result.stderr)
        if code != 0:
            failed.append(f"{where}: `{line}` exited {code}:\n{out.getvalue()[-3000:]}")
            break
with open(report, "w") as f:
    json.dump(failed, f)
"""


def test_shown_commands_run(tmp_path: Path):
    """Every unmarked shell command, a block's commands in order in one scratch folder. Our console scripts run
    as the function each one calls (pyproject's [project.scripts]) in one process, forked from the preloaded
    server (``tests/preloaded.py``), and ``python ...`` lines forked from it too, to pay for no import of torch
    and Lightning per command; anything else (pipes, other programs) runs in bash. The console scripts themselves
    run for real in ``tests/data/test_prepare.py::test_console_script``."""
    blocks = []
    for i, (where, lines, files) in enumerate(_runnable_blocks()):
        blocks.append((where, str(_scratch(tmp_path / str(i), files)), lines))
    assert any("sppo fit --config my.yaml" in " ".join(lines) for _, _, lines in blocks), (
        "the minimal config is not run"
    )
    report = tmp_path / "failed.json"
    request = json.dumps([_entry_points(), blocks, str(report)])
    result = preloaded.run([sys.executable, "-c", _COMMAND_RUNNER], input=request, env=_env(), timeout=TIMEOUT_S)
    assert result.returncode == 0 and report.exists(), result.stderr[-3000:]
    failed = json.loads(report.read_text())
    assert not failed, "\n\n".join(failed)


_PYTHON_RUNNER = r"""
import json, sys, traceback
pages = json.load(sys.stdin)
failed = []
for page in pages:
    namespace = {"__name__": "__main__"}
    for where, code in page:
        try:
            exec(compile(code, where, "exec"), namespace)
        except BaseException:
            failed.append(where + "\n" + traceback.format_exc(limit=-3))
            break
print(json.dumps(failed))
"""


def test_shown_python_runs(tmp_path: Path):
    """Every unmarked Python block, a page's blocks in order in one namespace; all pages in one process."""
    pages = []
    for page in ALL_PAGES:
        code = [(b.where, b.text) for b in page.blocks if b.lang == "python" and not b.marker and not b.file]
        if code:
            pages.append(code)
    assert pages, "no Python block is run: the README's examples should be"
    work = _scratch(tmp_path, {})
    command = [sys.executable, "-c", _PYTHON_RUNNER]
    result = preloaded.run(command, input=json.dumps(pages), cwd=work, env=_env(), timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    failed = json.loads(result.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(failed)


# -- checking what is marked, where that is cheap -------------------------------------------------------------


def _marked_commands() -> list[tuple[str, str, dict[str, str]]]:
    out = []
    for page in ALL_PAGES:
        for block in page.blocks:
            if block.lang in SHELL and block.marker:
                out.extend((block.where, command, page.files()) for command in commands(block))
    return out


def _program_and_args(command: str) -> tuple[str, list[str]] | None:
    """Our program in a command line and its arguments: ``sppo ...``, ``srun ... sppo ...``, ``torchrun ... -m
    lightning_sppo.training.cli ...``; None for other programs."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    for i, word in enumerate(words):
        if word in SCRIPTS:
            return word, words[i + 1 :]
        if word == "-m" and i + 1 < len(words) and words[i + 1] == "lightning_sppo.training.cli":
            return "sppo", words[i + 2 :]
    return None


def test_marked_commands_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Marked commands do not run here, but their options and the configs they name can be checked."""
    from lightning_sppo.planner import cli as plan_cli
    from lightning_sppo.training import cli as sppo_cli

    monkeypatch.setenv("WANDB_MODE", "offline")
    checked = 0
    for where, command, files in _marked_commands():
        named = set(re.findall(r"\bconfigs/[\w./-]+\.yaml\b", command))
        for path in named - PENDING_CONFIGS:
            assert (ROOT / path).is_file(), f"{where}: `{command}` names {path}, which does not exist"
        found = _program_and_args(command)
        if found is None or named & PENDING_CONFIGS:
            continue
        program, args = found
        if program == "sppo-plan":
            try:
                parsed = plan_cli._parser().parse_args(args)
                if not parsed.calibrate and not parsed.fit_suite:  # these need no model: they write a profile
                    plan_cli._request(parsed)
            except (plan_cli._UsageError, ValueError) as error:
                raise AssertionError(f"{where}: `{command}`: {error}") from error
            checked += 1
        elif program == "sppo" and args[:1] in (["fit"], ["validate"]) and "--help" not in args:
            config = args[args.index("--config") + 1] if "--config" in args else None
            if config is not None and not config.startswith("configs/") and config not in files:
                continue  # a file that stands for the reader's own (my.yaml in a not-run block)
            work = tmp_path / f"check{checked}"
            if not work.exists():
                shutil.copytree(ROOT / "configs", work / "configs")
                for name, text in files.items():
                    (work / name).write_text(text)
            monkeypatch.chdir(work)
            monkeypatch.setattr(sys, "argv", ["sppo"])
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), pytest.raises(SystemExit) as exit:
                sppo_cli.main([*args, "--print_config"])
            assert exit.value.code in (0, None), (
                f"{where}: `{command} --print_config` failed:\n{out.getvalue()[-2000:]}"
            )
            assert "trainer:" in out.getvalue(), f"{where}: `{command} --print_config` printed no config"
            checked += 1
    assert checked, "no marked command was checked: the parser of marked commands finds nothing"
