"""The repository's promises: CI runs README's test command, and the demo learns."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci_command in readme.splitlines(), ci_command


def test_constraints_pin_torch():
    assert "torch==" in (ROOT / "constraints.txt").read_text()


def test_demo_loss_falls():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_fabric", ROOT / "recipes" / "demo_fabric.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    losses = demo.main(seq_len=128, batch_size=2, num_subsequences=3, steps=30, log_every=10)
    assert losses[-1] < losses[0] - 1.0, losses


# -- dependencies and test hygiene ---------------------------------------------------------------------------

_WALL_CLOCK = {"perf_counter", "time", "monotonic", "perf_counter_ns", "time_ns", "monotonic_ns"}
_SPAWNERS = {"run", "Popen", "call", "check_call", "check_output"}


def _python_files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def _third_party_imports(*folders: str) -> set[str]:
    modules = set()
    for path in _python_files(*folders):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return {m for m in modules if m not in sys.stdlib_module_names and m not in {"lightning_sppo", "__future__"}}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _canonical(re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0])


def _project() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_imported_package_is_declared_and_every_dependency_is_used():
    project = _project()
    runtime = {_requirement_name(r) for r in project["dependencies"]}
    extras = {_requirement_name(r) for group in project["optional-dependencies"].values() for r in group}
    distributions = importlib.metadata.packages_distributions()
    for module in _third_party_imports("lightning_sppo"):
        names = {_canonical(d) for d in distributions.get(module, [module])}
        assert names & (runtime | extras), f"lightning_sppo imports {module!r}, which pyproject.toml does not declare"
    used = {_canonical(d) for m in _third_party_imports("lightning_sppo", "recipes") for d in distributions.get(m, [m])}
    assert runtime <= used, f"declared but never imported: {sorted(runtime - used)}"


def _calls(tree: ast.AST, module: str, names: set[str]) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == module
        and node.func.attr in names
    ]


def test_no_test_asserts_on_the_wall_clock():
    """Timed unit tests fail on a loaded machine; performance is measured by benchmarks. A deadline is fine."""
    for path in _python_files("tests"):
        tree = ast.parse(path.read_text())
        timed = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and _calls(node.value, "time", _WALL_CLOCK)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
                assert not _calls(node.test, "time", _WALL_CLOCK) and not names & timed, (
                    f"{path.relative_to(ROOT)}:{node.lineno} asserts on the wall clock"
                )


def test_processes_started_by_tests_get_an_environment():
    """Every subprocess a test starts gets ``env=`` (``tests.subprocesses.one_thread_env``): one thread each."""
    for path in _python_files("tests"):
        for call in _calls(ast.parse(path.read_text()), "subprocess", _SPAWNERS):
            keywords = {keyword.arg for keyword in call.keywords}
            assert "env" in keywords, f"{path.relative_to(ROOT)}:{call.lineno} starts a process without env="


def test_processes_started_by_tests_inherit_no_process_group_launch(monkeypatch):
    """An in-process test that starts a process group leaves MASTER_ADDR/MASTER_PORT set (its store still holding the
    port): a process a later test starts must launch its own (else EADDRINUSE)."""
    from tests.subprocesses import LAUNCH_VARIABLES, one_thread_env

    for name in LAUNCH_VARIABLES:
        monkeypatch.setenv(name, "1")
    env = one_thread_env(RANK="0")
    assert [name for name in LAUNCH_VARIABLES if name in env] == ["RANK"], env  # what a test passes itself is kept


def test_a_process_group_a_test_starts_is_gone_when_it_ends(tmp_path):
    """The first half: a process group of one, left initialized as Lightning leaves it (the next test checks)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert dist.is_initialized()


def test_no_process_group_is_left_from_the_test_before():
    """A world of one left by an earlier test made failures.py drop the rank from a two-process report (CI failed)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
