"""``SPPO_TEST_THREADS_AT_EXIT=PREFIX python tests/training/exit_probe.py fit ...``: the ``sppo`` command, writing
to ``PREFIX.<local rank>`` the threads still running in its process when the interpreter is about to finalize
(this module's exit hook is registered first, so it runs last). Lightning's launcher starts the other ranks with
this same command line and environment."""

from __future__ import annotations

import atexit
import json
import os
import threading


def _threads_at_exit() -> None:
    python = sorted(thread.name for thread in threading.enumerate() if thread is not threading.main_thread())
    native = []
    for task in sorted(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else []:
        with open(f"/proc/self/task/{task}/comm") as f:
            native.append(f.read().strip())
    with open(f"{os.environ['SPPO_TEST_THREADS_AT_EXIT']}.{os.environ.get('LOCAL_RANK', '0')}", "w") as f:
        json.dump({"python": python, "native": native}, f)


atexit.register(_threads_at_exit)  # before anything else registers its hook: runs last

if __name__ == "__main__":
    from lightning_sppo.training.cli import main

    main()
