"""Python commands a test runs, forked from a server that has torch, Lightning and lightning_sppo imported.

A fresh interpreter pays several seconds of CPU for those imports (4-5 s on CI's two cores), and a test that runs
``python -m lightning_sppo.training.cli fit ...`` with two processes paid it twice per run, dozens of runs per
suite. ``run`` and ``Popen`` here take the same command lines as ``subprocess.run`` / ``subprocess.Popen`` and give
the same results (exit status, a negative one for a signal, stdout and stderr), but the process is forked from the
preloaded server and only then becomes the command: environment, working directory, ``sys.argv``, ``sys.path`` and
``__main__`` as ``python -m MODULE``, ``python -c CODE`` or ``python SCRIPT`` would set them, and at its end what
the interpreter's own exit runs (non-daemon threads joined, ``atexit``). Lightning's and Fabric's launchers inside such a process
start their other ranks through the same server (their ``python -m ...`` command line, environment and working
directory unchanged), so a two-process ``sppo fit`` pays the imports zero times, not twice.

What such a process does not test, and where that is tested for real: the interpreter's start-up and a console
script (``tests/data/test_prepare.py::test_console_script``, ``tests/test_docs_commands.py``), torchrun
(``tests/training/test_failures.py``), and one ``sppo fit`` with Lightning's launcher starting its second rank as a
fresh interpreter (``tests/training/test_cli.py``'s reference run). ``tests/test_preloaded.py`` runs the same small
programs both ways and compares what they give.

State that an import computes from the environment is recomputed in the child (Lightning's rank, read from
``RANK``/``LOCAL_RANK``/``SLURM_PROCID`` when imported); warnings the imports raised in the server, none at present,
are raised again in each child, as each fresh interpreter would.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import socket
import subprocess
import sys
import tempfile
import threading
import types
import warnings
from pathlib import Path
from typing import Any

__all__ = ["Popen", "run", "server_address"]

ROOT = Path(__file__).resolve().parents[1]
ADDRESS_VARIABLE = "SPPO_TEST_PRELOADED"
"""The server's socket, for processes it started (a launcher inside them starts its ranks through it too)."""
PRELOAD = ["torch", "torch.distributed", "lightning", "lightning_sppo", "lightning_sppo.training.cli"]
_LAUNCHERS = ["lightning.fabric.strategies.launchers.subprocess_script",
              "lightning.pytorch.strategies.launchers.subprocess_script"]  # fmt: skip
_server: subprocess.Popen | None = None
_address: str | None = None


# -- the client side --------------------------------------------------------------------------------------------


class Popen:
    """``subprocess.Popen(args, env=..., cwd=..., stdin/stdout/stderr=...)`` for a Python command line
    (``[sys.executable, "-m", MODULE, ...]``, ``-c CODE`` or ``SCRIPT``), forked from the server.

    ``stdin``, ``stdout`` and ``stderr`` are open files or file descriptors (default: this process's own); no
    pipes. The process runs in a process group of its own, or in ``group``'s (a launcher's ranks join its group)."""

    def __init__(self, args, env=None, cwd=None, stdin=None, stdout=None, stderr=None, group: int | None = None):
        self.args = list(map(str, args))
        if not is_python_command(self.args):
            raise ValueError(f"not a Python command line: {self.args}")
        fds = [_fileno(stream, default) for stream, default in ((stdin, 0), (stdout, 1), (stderr, 2))]
        env = dict(os.environ if env is None else env)
        env[ADDRESS_VARIABLE] = server_address()
        request = {"args": self.args, "env": env, "cwd": str(cwd or os.getcwd()), "group": group}
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.connect(env[ADDRESS_VARIABLE])
        socket.send_fds(self._socket, [json.dumps(request).encode() + b"\n"], fds)
        self._reader = self._socket.makefile("r")
        self.pid = int(self._reader.readline())
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._socket], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._socket], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def _read_status(self) -> None:
        line = self._reader.readline()
        self.returncode = int(line) if line else -9  # the server went away: nobody waits for it any more
        self._reader.close()
        self._socket.close()


def run(args, env=None, cwd=None, timeout: float | None = None, input: str = "") -> subprocess.CompletedProcess:
    """``subprocess.run(args, env=env, cwd=cwd, input=input, capture_output=True, text=True, timeout=timeout)``,
    forked from the server. On a timeout the whole process group (the command and the ranks it started) is
    killed."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        with tempfile.TemporaryFile("w+") as stdin:
            stdin.write(input)
            stdin.seek(0)
            process = Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=out, stderr=err)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait()
            raise
        _kill_group(process.pid)  # ranks it started and left behind, as a finished job's would be by its launcher
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())


def is_python_command(args: list[str]) -> bool:
    """``python -m MODULE ...``, ``python -c CODE ...`` or ``python SCRIPT ...`` with this interpreter, and no other
    interpreter options."""
    if len(args) < 2 or args[0] != sys.executable:
        return False
    return args[1] in ("-m", "-c") and len(args) > 2 or not args[1].startswith("-")


def server_address() -> str:
    """The server's socket: the one this process was started from, else a server this process starts (once)."""
    global _server, _address
    if os.environ.get(ADDRESS_VARIABLE):
        return os.environ[ADDRESS_VARIABLE]
    if _server is None or _server.poll() is not None:
        _address = os.path.join(tempfile.mkdtemp(prefix="sppo-preloaded-"), "socket")
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        _server = subprocess.Popen(
            [sys.executable, "-m", "tests.preloaded", _address],
            cwd=ROOT, env=os.environ | {"PYTHONPATH": pythonpath}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        if _server.stdout.readline().strip() != b"ready":  # the preload failed: its traceback is on stderr
            raise RuntimeError(f"the preloaded server did not start (exit status {_server.wait()})")
        atexit.register(_server.stdin.close)  # the server exits when this process does
    return _address


def _fileno(stream: Any, default: int) -> int:
    return default if stream is None else stream if isinstance(stream, int) else stream.fileno()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing left of it
        os.killpg(pid, 9)


# -- the server side -------------------------------------------------------------------------------------------


def serve(address: str) -> None:
    """Import ``PRELOAD``, then fork one child per request until this process's stdin closes."""
    with warnings.catch_warnings(record=True) as preload_warnings:
        warnings.simplefilter("default")
        for name in PRELOAD:
            __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    print("ready", flush=True)
    clients: dict[int, socket.socket] = {}  # pid -> the connection its exit status goes to
    while True:
        readable = select.select([listener, sys.stdin], [], [], 0.05)[0]
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            break  # the test process has gone
        if listener in readable:
            connection, _ = listener.accept()
            try:
                request, fds = _receive(connection)
            except (OSError, ValueError):  # a client that went away mid-request: nothing to start
                connection.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for other in (listener, connection, *clients.values()):  # a client sees EOF once the server is gone
                    other.close()
                _become(request, fds, preload_warnings)
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):  # the client went away: its child is reaped all the same
                connection.sendall(f"{pid}\n".encode())
            clients[pid] = connection
        _reap(clients)
    for pid in clients:
        _kill_group(pid)


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    """One request: a JSON line, with the three file descriptors on its first part."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while not message.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            raise ConnectionError("a request ended early")
        message += more
    return json.loads(message), fds


def _reap(clients: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = clients.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):  # the client gave up waiting
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            connection.close()


def _become(request: dict, fds: list[int], preload_warnings: list) -> None:
    """In the forked child: become the requested command, run it, and exit as the interpreter would."""
    group = request["group"]
    os.setpgid(0, group if group is not None else 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    own_pythonpath = _pythonpath(os.environ)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    option, args = request["args"][1], request["args"][1:]
    # sys.argv and sys.path as the interpreter sets them: first the working directory for -m, "" for -c, the
    # script's folder for a script; then the request's PYTHONPATH, in place of the server's; then the rest.
    sys.argv = args[1:] if option == "-m" else ["-c", *args[2:]] if option == "-c" else args
    first = os.getcwd() if option == "-m" else "" if option == "-c" else os.path.dirname(os.path.realpath(option))
    sys.path[:] = [first, *_pythonpath(os.environ), *(p for p in sys.path[1:] if p not in own_pythonpath)]
    _recompute_import_time_state()
    for caught in preload_warnings:
        warnings.warn_explicit(caught.message, caught.category, caught.filename, caught.lineno)
    code = 0
    try:
        if option == "-m":
            with (
                warnings.catch_warnings()
            ):  # the server imported the module: runpy's warning is ours, not the program's
                warnings.filterwarnings("ignore", r".* found in sys\.modules after import of package", RuntimeWarning)
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif option == "-c":
            _run_code(args[1])
        else:
            runpy.run_path(option, run_name="__main__")
    except SystemExit as exit_:
        code = _exit_status(exit_.code)
    except BaseException as error:
        error.__traceback__ = _program_frames(error.__traceback__)  # what the default hook prints
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    os._exit(_shut_down(code))


def _pythonpath(env: dict[str, str]) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _run_code(code: str) -> None:
    """``python -c CODE``: the code in a new ``__main__`` module."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(code, "<string>", "exec"), main.__dict__)


def _program_frames(tb: Any) -> Any:
    """The traceback from the program's first frame on, as the interpreter would print it (no runpy, no server)."""
    ours = (__file__, runpy.__file__, "<frozen runpy>")  # the frames of _become and runpy
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def _recompute_import_time_state() -> None:
    import numpy
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0  # read from the environment when Lightning was imported
    numpy.random.seed()  # seeded at import: without this every child would draw the same numbers
    # Warnings shown once per place are shown again, as in a new process.
    getattr(warnings, "_filters_mutated", lambda: None)()
    for name in _LAUNCHERS:
        sys.modules[name].subprocess = _LauncherSubprocess()


class _LauncherSubprocess:
    """The ``subprocess`` module as a launcher sees it: its Python command lines start through the server, in the
    launcher's process group (killed with it)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(args, env=None, cwd=None, **kwargs):  # noqa: N802 (the name it replaces)
        if kwargs or not is_python_command([str(a) for a in args]):
            return subprocess.Popen(args, env=env, cwd=cwd, **kwargs)
        return Popen(args, env=env, cwd=cwd, group=os.getpgid(0))


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter prints it
    return 1


def _shut_down(code: int) -> int:
    """What the interpreter does on its way out: join non-daemon threads, run ``atexit``, flush."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed by the program
            stream.flush()
    return code


if __name__ == "__main__":
    serve(sys.argv[1])
