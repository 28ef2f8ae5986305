"""No import circle inside ``lightning_sppo``: a module that needs another is never needed by it, even lazily.

Every ``import`` and ``from ... import`` statement of every module is an edge, wherever it sits (module level,
inside a function, under ``if TYPE_CHECKING``): a lazy import hides a circle from the interpreter, not from
the design. ``from package import name`` is an edge to ``package.name`` when that is a module of the package,
else to ``package`` itself (its ``__init__``). Parent packages that Python runs on the way are not edges: every
submodule would otherwise form a circle with a package ``__init__`` that re-exports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_sppo"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package at ``root`` (``__init__`` as the package)."""
    out = {}
    for file in sorted(root.rglob("*.py")):
        parts = file.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = file
    return out


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from {'.' * level}{target} import ...`` written in ``module``."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its body), from the source alone (nothing runs)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, file in modules.items():
        is_package = file.name == "__init__.py"
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    source = _resolve_relative(name, is_package, node.level, node.module)
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]  # fmt: skip
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a function or class: its module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_lightning_sppo_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and "lightning_sppo.model.gpt" in graph["lightning_sppo.model.hf"]  # the graph is real
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_model_does_not_know_its_converters():
    """The Hugging Face name map and conversion sit beside the model; the model imports neither."""
    graph = import_graph(PACKAGE)
    assert not {"lightning_sppo.model.hf", "lightning_sppo.model.export"} & graph["lightning_sppo.model.gpt"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


def test_a_lazy_import_circle_is_found(tmp_path):
    """Negative control: the checker finds the circle that the old model/hf pair had (a function-level import
    back), through a relative import and a package ``__init__``."""
    package = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.model import Model\n",
        "pkg/model.py": "class Model:\n    def load(self):\n        from .convert import load\n        return load()\n",
        "pkg/convert.py": "from pkg import model\n\ndef load():\n    return model.Model()\n",
        "pkg/other.py": "import pkg.model\n",
    })  # fmt: skip
    graph = import_graph(package)
    assert graph["pkg.model"] == {"pkg.convert"} and graph["pkg.convert"] == {"pkg.model"}
    assert graph["pkg.other"] == {"pkg.model"} and graph["pkg"] == {"pkg.model"}
    assert find_cycle(graph) == ["pkg.model", "pkg.convert", "pkg.model"]  # reached from pkg/__init__


def test_a_package_without_circle_passes(tmp_path):
    """The same package with the import going one way only: no circle reported."""
    package = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.model import Model\n",
        "pkg/model.py": "class Model:\n    pass\n",
        "pkg/convert.py": "from pkg import model\n\ndef load():\n    return model.Model()\n",
    })  # fmt: skip
    assert find_cycle(import_graph(package)) is None


def _imports_of(graph: dict[str, set[str]], package: str) -> set[str]:
    """The top-level parts of ``lightning_sppo`` that ``package``'s modules import."""
    inside = [m for m in graph if m == f"lightning_sppo.{package}" or m.startswith(f"lightning_sppo.{package}.")]
    return {target.split(".")[1] for m in inside for target in graph[m] if target.count(".")}


def _step_direction_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Where the import graph breaks the direction strategy -> step plan -> runtime (DESIGN.md, "A step's plan is a
    value"): the strategy makes each step's plan and hands it to the runtime, which reads it (and so imports the step
    plan) but never asks the strategy or the planner; the step plan knows neither the strategy nor the runtime."""
    forbidden = {
        "runtime": {"strategy", "planner"},
        "planner": {"strategy"},
        "step_plan": {"strategy", "runtime", "planner", "offload"},
    }
    breaks = {package: sorted(bad & _imports_of(graph, package)) for package, bad in forbidden.items()}
    return [f"{package} imports {', '.join(bad)}" for package, bad in breaks.items() if bad]


def test_the_strategy_plans_each_step_and_the_runtime_runs_it():
    graph = import_graph(PACKAGE)
    assert "lightning_sppo.step_plan" in graph["lightning_sppo.strategy.core"]  # the strategy makes the plans
    assert "lightning_sppo.step_plan" in graph["lightning_sppo.runtime.pipeline"]  # the runtime reads them
    assert _step_direction_breaks(graph) == []


def test_an_arrow_back_up_to_the_strategy_is_found():
    """Negative control: the engine asking the strategy's planner again (what ``_plan_engine`` did the other way)."""
    graph = import_graph(PACKAGE)
    graph["lightning_sppo.runtime.engine"] = graph["lightning_sppo.runtime.engine"] | {
        "lightning_sppo.strategy.autoplan"
    }
    graph["lightning_sppo.step_plan.decide"] = graph["lightning_sppo.step_plan.decide"] | {"lightning_sppo.runtime"}
    assert _step_direction_breaks(graph) == ["runtime imports strategy", "step_plan imports runtime"]
