"""``tests/preloaded.py`` gives what a new interpreter gives: the same small programs run both ways compare equal
(exit status, stdout, stderr, ``sys.argv``, ``sys.path``, ``__main__``, Lightning's rank from the environment),
and a launcher's second rank is forked from the server too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import preloaded
from tests.subprocesses import one_thread_env

SCRIPT = """\
import os, sys, __main__
print("argv", sys.argv, "cwd", os.getcwd(), "path", sys.path, "main", getattr(__main__.__spec__, "name", None))
print("on stderr", os.environ["SPPO_TEST_WORD"], file=sys.stderr)
import warnings
warnings.warn("a warning")
how = os.environ["SPPO_TEST_END"]
if how == "raise":
    {}["missing"]
if how == "kill":
    os.kill(os.getpid(), 9)
sys.exit(int(how) if how.isdigit() else how)
"""


def _both(args: list[str], cwd: Path, **env: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    environ = os.environ | env
    forked = preloaded.run(args, cwd=cwd, env=environ, timeout=60)
    fresh = subprocess.run(args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=60)
    return forked, fresh


@pytest.mark.parametrize("end", ["0", "3", "a message", "raise", "kill"])
def test_a_script_ends_as_in_a_new_interpreter(tmp_path, end):
    (tmp_path / "program.py").write_text(SCRIPT)
    (tmp_path / "elsewhere").mkdir()
    args = [sys.executable, str(tmp_path / "program.py"), "--flag", "x"]
    forked, fresh = _both(args, tmp_path / "elsewhere", SPPO_TEST_WORD="hello", SPPO_TEST_END=end)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert f"path ['{tmp_path}'," in fresh.stdout and "UserWarning: a warning" in fresh.stderr  # the program ran


def test_a_module_and_code_run_as_with_m_and_c(tmp_path):
    package = tmp_path / "lib" / "sppo_probe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(SCRIPT)
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path / "lib"), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": pythonpath, "SPPO_TEST_WORD": "hi", "SPPO_TEST_END": "0"}
    forked, fresh = _both([sys.executable, "-m", "sppo_probe.main", "a"], tmp_path, **env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert "main sppo_probe.main" in fresh.stdout
    forked, fresh = _both([sys.executable, "-c", SCRIPT, "b"], tmp_path, **env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert "argv ['-c', 'b']" in fresh.stdout


def test_state_an_import_read_from_the_environment_is_read_again():
    """Lightning reads its rank from the environment when imported; the server imported it as rank 0."""
    code = "from lightning.fabric.utilities.rank_zero import rank_zero_only; print(rank_zero_only.rank)"
    ranks = [
        preloaded.run([sys.executable, "-c", code], env=os.environ | {"LOCAL_RANK": str(r)}).stdout for r in (0, 1)
    ]
    assert ranks == ["0\n", "1\n"]
    draws = [preloaded.run([sys.executable, "-c", "import numpy; print(numpy.random.rand())"]).stdout for _ in "ab"]
    assert draws[0] != draws[1]  # numpy is seeded at import: each child is reseeded, as each new process is


def test_stdin_and_a_timeout():
    upper = preloaded.run([sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"], input="abc")
    assert upper.stdout == "ABC\n"
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)


FABRIC = """\
import json, os, sys
from lightning.fabric import Fabric
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
ranks = fabric.all_gather(fabric.global_rank).tolist()
print(json.dumps({"rank": fabric.global_rank, "pid": os.getpid(), "parent": os.getppid(), "group": os.getpgid(0),
                  "ranks": ranks}), flush=True)
"""


def test_a_launcher_starts_its_other_rank_through_the_server(tmp_path):
    """Fabric's launcher runs ``python SCRIPT`` again for rank 1: forked from the server, in rank 0's process group
    (a new interpreter would be rank 0's own child)."""
    (tmp_path / "two.py").write_text(FABRIC)
    run = preloaded.run([sys.executable, str(tmp_path / "two.py")], cwd=tmp_path, env=one_thread_env(), timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    rank0, rank1 = sorted((json.loads(line) for line in run.stdout.splitlines()), key=lambda r: r["rank"])
    assert rank0["ranks"] == rank1["ranks"] == [0, 1]
    assert rank1["parent"] == rank0["parent"] != rank0["pid"]  # both children of the server
    assert rank1["group"] == rank0["group"] == rank0["pid"]
